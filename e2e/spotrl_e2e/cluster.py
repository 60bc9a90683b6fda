"""The test cluster: control plane + node agent, and the failure modes of spot nodes.

From Python (tests use the ``cluster`` fixture)::

    cluster = Cluster(Path("/tmp/c")).start()
    cluster.kubectl("get", "nodes")
    cluster.lose_node("spot-a")
    cluster.stop()

From a shell (``make cluster-up`` / ``make cluster-down``)::

    python -m spotrl_e2e.cluster up --dir /tmp/spotrl-cluster     # prints export KUBECONFIG=...
    python -m spotrl_e2e.cluster down --dir /tmp/spotrl-cluster

What talks only to the API server or runs kubectl (clients, namespaces, pods, cordon,
taint, evict, drain ...) is in :class:`spotrl_e2e.kubecluster.KubeCluster`, shared with
the kind harness; ``Cluster`` adds how this cluster starts and how its nodes fail.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import urllib3

from spotrl_e2e.controlplane import ControlPlane, Timings
from spotrl_e2e.kube import Credentials
from spotrl_e2e.kubecluster import KubeCluster
from spotrl_e2e.nodeagent.config import AgentConfig, NodeSpec
from spotrl_e2e.procs import Process, StartupError, free_port, stop_pidfile
from spotrl_e2e.tools import Tools, find_tools

Obj = dict[str, Any]

# Two spot nodes and one on-demand node, each with one (pretend) GPU.
DEFAULT_NODES = (
    NodeSpec("spot-a", capacity_type="spot", gpus=1),
    NodeSpec("spot-b", capacity_type="spot", gpus=1),
    NodeSpec("ondemand-a", capacity_type="on-demand", gpus=1),
)
_STOP_ORDER = (
    ("nodeagent", "spotrl_e2e.nodeagent"),
    ("kube-scheduler", "kube-scheduler"),
    ("kube-controller-manager", "kube-controller-manager"),
    ("kube-apiserver", "kube-apiserver"),
    ("etcd", "etcd"),
    ("versitygw", "versitygw"),
)


def runtime_image_env() -> dict[str, str]:
    """The environment the runtime image sets (Dockerfile ``ENV``) that a pod's process here
    must see too: the image ships the demo policy prebuilt (``SPOTRL_PREBUILT_MODELS``), so the
    host's model cache stands in for that folder, built once if it is not there yet."""
    from spotrl_runtime.models.cache import PREBUILT_ENV
    from spotrl_runtime.models.tiny_arith import tiny_arith_dir

    return {PREBUILT_ENV: str(tiny_arith_dir().parent)}


class Cluster(KubeCluster):
    """A running test cluster. Every file lives under ``workdir``."""

    tools: Tools

    def __init__(
        self,
        workdir: Path,
        nodes: Sequence[NodeSpec] = DEFAULT_NODES,
        timings: Timings | None = None,
    ):
        super().__init__(workdir.resolve())
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.tools = find_tools()
        self.controlplane = ControlPlane(self.workdir, self.tools, timings or Timings())
        self.node_specs: list[NodeSpec] = [NodeSpec.from_dict(asdict(n)) for n in nodes]
        self._initial_nodes = [n.name for n in self.node_specs]
        self.agent: Process | None = None
        self.ray_tmp: Path | None = None
        """The pods' folder for Ray's files (their SPOTRL_RAY_TMP): short, since Ray's socket
        paths must fit in 107 bytes, which a folder under ``workdir`` may not; removed at stop
        with whatever a killed pod left there."""
        self.control_port = 0
        self.startup_seconds: dict[str, float] = {}
        self._http = urllib3.PoolManager(retries=False)

    # ------------------------------------------------------------------ start / stop
    @property
    def kubeconfig(self) -> Path:
        return self.controlplane.admin_kubeconfig

    @property
    def server(self) -> str:
        return self.controlplane.server

    @property
    def ca(self) -> Path:
        return self.controlplane.pki.ca.cert

    @property
    def image_sources(self) -> Path:
        """Where a test puts another release's code for the pods of an image tagged with that
        folder's name (:attr:`spotrl_e2e.nodeagent.config.AgentConfig.image_sources`)."""
        return self.workdir / "images"

    def start(self, detached: bool = False) -> Cluster:
        """Starts the control plane and the node agent and waits until every node is Ready and
        schedulable. ``detached``: the servers outlive this process (``cluster up``)."""
        t0 = time.monotonic()
        try:
            self.controlplane.start(detached)
            self.startup_seconds.update(self.controlplane.startup_seconds)
            self._start_agent(detached)
            for spec in self.node_specs:
                self.wait_node_ready(spec.name, timeout=30)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds["total"] = time.monotonic() - t0
        self._save_state()
        return self

    def _start_agent(self, detached: bool) -> None:
        pki = self.controlplane.pki
        for i, spec in enumerate(self.node_specs, start=1):
            pki.node(spec.name)
            pki.node_serving(spec.name, f"127.0.{i}.1")
        self.control_port = free_port()
        self.ray_tmp = Path(tempfile.mkdtemp(prefix="spotrl-ray-", dir="/tmp"))
        config = AgentConfig(
            server=self.server,
            ca=str(self.ca),
            pki_dir=str(pki.dir),
            workdir=str(self.workdir / "nodes"),
            python_bin=str(Path(sys.executable).parent),
            control_port=self.control_port,
            nodes=self.node_specs,
            image_env={**runtime_image_env(), "SPOTRL_RAY_TMP": str(self.ray_tmp)},
            image_sources=str(self.image_sources),
        )
        config_path = self.workdir / "nodeagent.json"
        config.save(config_path)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        argv = [sys.executable, "-m", "spotrl_e2e.nodeagent", "--config", config_path]
        self.agent = Process("nodeagent", argv, self.workdir, env).start(detached)

        def healthy() -> bool:
            return self._control("GET", "/healthz").get("ready") is True

        self.agent.wait_ready(healthy, 30, "ready (control channel /healthz)")

    def _save_state(self) -> None:
        state = {
            "server": self.server,
            "ray_tmp": str(self.ray_tmp) if self.ray_tmp else None,
            "kubeconfig": str(self.kubeconfig),
            "control_port": self.control_port,
            "ports": self.controlplane.ports.__dict__,
            "nodes": [asdict(n) for n in self.node_specs],
            "initial_nodes": self._initial_nodes,
            "startup_seconds": self.startup_seconds,
        }
        (self.workdir / "cluster.json").write_text(json.dumps(state, indent=1))

    @classmethod
    def attach(cls, workdir: Path) -> Cluster:
        """A handle on a cluster that ``cluster up`` started in ``workdir``."""
        state_file = workdir / "cluster.json"
        if not state_file.exists():
            raise FileNotFoundError(f"no cluster state in {state_file}: start one with `make cluster-up`")
        state = json.loads(state_file.read_text())
        self = cls(workdir, [NodeSpec.from_dict(n) for n in state["nodes"]])
        self._initial_nodes = state["initial_nodes"]
        for k, v in state["ports"].items():
            setattr(self.controlplane.ports, k, v)
        self.control_port = state["control_port"]
        self.startup_seconds = state["startup_seconds"]
        self.ray_tmp = Path(state["ray_tmp"]) if state.get("ray_tmp") else None
        return self

    def stop(self) -> None:
        """Stops the node agent (which kills every pod process) and the control plane."""
        if self.agent is not None:
            self.agent.stop(timeout=15)
            self.agent = None
        self.controlplane.stop()
        if self.ray_tmp is not None:
            shutil.rmtree(self.ray_tmp, ignore_errors=True)
            self.ray_tmp = None

    # ------------------------------------------------------------------ clients
    def _admin_credentials(self) -> Credentials:
        return self.controlplane.admin_credentials()

    def _control(self, method: str, url_path: str, body: Obj | None = None, timeout: float = 60) -> Any:
        resp = self._http.request(
            method,
            f"http://127.0.0.1:{self.control_port}{url_path}",
            body=json.dumps(body or {}).encode() if method == "POST" else None,
            headers={"Content-Type": "application/json"},
            timeout=timeout,
        )
        data = json.loads(resp.data or b"null")
        if resp.status >= 400:
            raise RuntimeError(f"node agent: {method} {url_path}: {data.get('error', data)}")
        return data

    # ------------------------------------------------------------------ namespaces & pods
    def pod_dir(self, namespace: str, name: str) -> Path:
        """The folder of a pod's latest incarnation on its node (``root/`` is its working
        directory, ``volumes/<name>`` its volumes, ``logs/`` its output). Kept after the pod
        is deleted, until the cluster stops."""
        dirs = sorted((self.workdir / "nodes" / "pods").glob(f"{namespace}_{name}_*"), key=lambda p: p.stat().st_mtime)
        if not dirs:
            raise FileNotFoundError(f"pod {namespace}/{name} never ran on a node of this cluster")
        return dirs[-1]

    def pod_log(self, namespace: str, name: str, container: str | None = None) -> str:
        """A container's output (the latest run), read from the node's files."""
        logs = sorted(
            (self.pod_dir(namespace, name) / "logs").glob(f"{container or '*'}.[0-9]*.log"),
            key=lambda p: p.stat().st_mtime,
        )
        return logs[-1].read_text(errors="replace") if logs else ""

    def pod_pids(self, namespace: str, name: str) -> dict[str, int]:
        """The process id of each running container of a pod, from the node agent."""
        for node in self._control("GET", "/nodes"):
            for pod in node["pods"]:
                if (pod["namespace"], pod["name"]) == (namespace, name):
                    return {c: info["pid"] for c, info in pod["containers"].items() if "running" in info["state"]}
        return {}

    # ------------------------------------------------------------------ nodes
    def node_state(self, name: str) -> str:
        """What the agent says about the machine: running, shutting-down, shutdown, lost."""
        return str(self._control_node(name)["state"])

    def _control_node(self, name: str) -> Obj:
        for n in self._control("GET", "/nodes"):
            if n["name"] == name:
                return dict(n)
        raise KeyError(f"the node agent plays no node {name!r}")

    def graceful_shutdown(self, name: str, grace_seconds: float = 15, wait: bool = True) -> None:
        self._control("POST", f"/nodes/{name}/shutdown", {"grace_seconds": grace_seconds})
        if wait:
            deadline = time.monotonic() + grace_seconds + 30
            while self.node_state(name) != "shutdown":
                if time.monotonic() > deadline:
                    raise TimeoutError(f"node {name} did not finish its graceful shutdown: {self._control_node(name)}")
                time.sleep(0.2)

    def lose_node(self, name: str) -> None:
        """The node agent SIGKILLs every process of the node and stops renewing its Lease and status."""
        self._control("POST", f"/nodes/{name}/lose")

    def restore_node(self, name: str, wait: bool = True) -> None:
        self._control("POST", f"/nodes/{name}/restore")
        if wait:
            self.wait_node_ready(name, timeout=60)

    def delete_node(self, name: str) -> None:
        if self.node_state(name) == "running":
            self.lose_node(name)
        self.admin().delete(f"/api/v1/nodes/{name}")

    def add_node(self, spec: NodeSpec, wait: bool = True) -> None:
        """A new machine joins (what Karpenter does after a spot loss)."""
        index = len(self.node_specs) + 1
        pki = self.controlplane.pki
        pki.node(spec.name)
        pki.node_serving(spec.name, f"127.0.{index}.1")
        self._control("POST", "/nodes", {**asdict(spec), "index": index})
        self.node_specs.append(spec)
        self._save_state()
        if wait:
            self.wait_node_ready(spec.name)

    def reset_nodes(self, timeout: float = 60) -> None:
        initial = {s.name: s for s in self.node_specs if s.name in self._initial_nodes}
        for n in self._control("GET", "/nodes"):
            if n["name"] in initial and n["state"] != "running":
                self._control("POST", f"/nodes/{n['name']}/restore")
        for name, spec in initial.items():
            self.wait_node_ready(name, timeout)
            self._reset_node_object(name, [t.to_api() for t in spec.taints])

    # ------------------------------------------------------------------ info
    def describe(self) -> str:
        """A few lines for a person: where things are and how to use them."""
        lines = [
            f"export KUBECONFIG={self.kubeconfig}",
            f"# API server {self.server}; nodes: {', '.join(s.name for s in self.node_specs)}",
            f"# files and logs under {self.workdir}; pods' folders under {self.workdir / 'nodes' / 'pods'}",
            f"# node agent control channel: http://127.0.0.1:{self.control_port}/nodes",
        ]
        if self.startup_seconds:
            lines.append(f"# started in {self.startup_seconds.get('total', 0):.1f} s")
        return "\n".join(lines)


def stop_dir(workdir: Path) -> list[str]:
    """Stops whatever ``cluster up`` started in ``workdir`` (pid files); returns what it stopped."""
    stopped = []
    for name, marker in _STOP_ORDER:
        for pidfile in [workdir / f"{name}.pid", *workdir.glob(f"*/{name}.pid")]:
            if stop_pidfile(pidfile, marker, timeout=15):
                stopped.append(name)
    state_file = workdir / "cluster.json"
    ray_tmp = json.loads(state_file.read_text()).get("ray_tmp") if state_file.exists() else None
    if ray_tmp and Path(ray_tmp).name.startswith("spotrl-ray-"):
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return stopped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spotrl_e2e.cluster", description="Start or stop the test cluster.")
    sub = parser.add_subparsers(dest="command", required=True)
    default_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "spotrl-cluster"
    up = sub.add_parser(
        "up", help="start etcd, the control plane, the node agent (and optionally S3) in the background"
    )
    up.add_argument("--dir", type=Path, default=default_dir)
    up.add_argument("--with-s3", action="store_true", help="also start the S3 server (versitygw)")
    down = sub.add_parser("down", help="stop everything `up` started in --dir")
    down.add_argument("--dir", type=Path, default=default_dir)
    args = parser.parse_args(argv)
    workdir: Path = args.dir.resolve()

    if args.command == "down":
        stopped = stop_dir(workdir)
        print(f"stopped: {', '.join(stopped) if stopped else 'nothing was running'} ({workdir})")
        return 0

    if (workdir / "kube-apiserver.pid").exists():
        print(f"a cluster may be running in {workdir}: run `make cluster-down` first", file=sys.stderr)
        return 1
    if workdir.exists() and any(workdir.iterdir()):
        # Only ever wipe a folder an earlier `up` made.
        if not (workdir / "controlplane.json").exists() and not (workdir / "pki" / "ca.crt").exists():
            print(f"{workdir} is not empty and holds no earlier test cluster; pick another --dir", file=sys.stderr)
            return 1
        import shutil

        shutil.rmtree(workdir)
    try:
        cluster = Cluster(workdir).start(detached=True)
    except StartupError as err:
        print(f"cluster up failed: {err}", file=sys.stderr)
        stop_dir(workdir)
        return 1
    print(cluster.describe())
    if args.with_s3:
        from spotrl_e2e.s3 import S3Server

        s3 = S3Server(workdir / "s3").start(detached=True)
        bucket = s3.create_bucket("dev")
        print(f"# S3: endpoint {s3.endpoint}, bucket {bucket.bucket}")
        for k, v in bucket.env().items():
            print(f"export {k}={v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
