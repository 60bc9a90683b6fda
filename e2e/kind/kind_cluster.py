"""The end-to-end tests' cluster on kind: the failure-mode helpers of the test control plane
(``spotrl_e2e.cluster.Cluster``) with the same names, done the way they happen on kind.

- cordon, taint, evict, drain: the API and ``kubectl``, exactly as on any cluster;
- abrupt node loss: ``docker stop`` of the node's container (kubelet and every container
  die at once; the node controller marks the node NotReady/Unknown), restore: ``docker
  start``;
- graceful node shutdown: not offered (kind nodes have no logind inhibitor for the
  kubelet's graceful shutdown); tests that need it are skipped on kind with that reason.

Used by ``tests/e2e`` when ``SPOTRL_E2E_TARGET=kind`` (set by ``e2e/kind/run.sh``), with
``KUBECONFIG`` pointing at the kind cluster and ``SPOTRL_KIND_CLUSTER`` naming it.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from spotrl_e2e.cluster import Drain
from spotrl_e2e.kube import Credentials, KubeClient, path
from spotrl_e2e.pki import KeyPair

Obj = dict[str, Any]
_CONTROLLER_TAINTS = ("node.kubernetes.io/",)


class KindTools:
    """kubectl and helm from PATH (or $KUBECTL / $HELM)."""

    def __init__(self) -> None:
        self.kubectl = Path(os.environ.get("KUBECTL") or shutil.which("kubectl") or "kubectl")
        self.helm = Path(os.environ.get("HELM") or shutil.which("helm") or "helm")


class KindCluster:
    """A running kind cluster (``kind create cluster --name NAME``), seen through KUBECONFIG."""

    graceful_shutdown_reason = "kind nodes cannot do the kubelet's graceful node shutdown (no logind inhibitor)"

    def __init__(self, name: str, kubeconfig: Path, workdir: Path | None = None):
        self.name = name
        self.kubeconfig = kubeconfig
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="spotrl-kind-"))
        self.tools = KindTools()
        config = yaml.safe_load(kubeconfig.read_text())
        ctx = next(c for c in config["contexts"] if c["name"] == config["current-context"])["context"]
        cluster = next(c for c in config["clusters"] if c["name"] == ctx["cluster"])["cluster"]
        user = next(u for u in config["users"] if u["name"] == ctx["user"])["user"]
        self.server = cluster["server"]
        self.ca = self._write("ca.crt", cluster["certificate-authority-data"])
        self._client = KeyPair(
            self._write("admin.crt", user["client-certificate-data"]),
            self._write("admin.key", user["client-key-data"]),
        )
        self._admin: KubeClient | None = None
        self._initial = {n["metadata"]["name"]: self._own_taints(n) for n in self.admin().get("/api/v1/nodes")["items"]}

    @classmethod
    def from_env(cls) -> KindCluster:
        kubeconfig = os.environ.get("KUBECONFIG")
        if not kubeconfig:
            raise RuntimeError("SPOTRL_E2E_TARGET=kind needs KUBECONFIG pointing at the kind cluster")
        return cls(os.environ.get("SPOTRL_KIND_CLUSTER", "spotrl-e2e"), Path(kubeconfig))

    def _write(self, name: str, b64: str) -> Path:
        file = self.workdir / name
        file.write_bytes(base64.b64decode(b64))
        file.chmod(0o600)
        return file

    @staticmethod
    def _own_taints(node: Obj) -> list[Obj]:
        taints = node.get("spec", {}).get("taints") or []
        return [t for t in taints if not t["key"].startswith(_CONTROLLER_TAINTS)]

    # ------------------------------------------------------------------ clients
    def admin(self) -> KubeClient:
        if self._admin is None:
            self._admin = KubeClient(Credentials(self.server, self.ca, client=self._client))
        return self._admin

    def api_client(self) -> Any:
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def kubectl(
        self, *args: str, check: bool = True, timeout: float = 60, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            [str(self.tools.kubectl), *args],
            env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and out.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} exited {out.returncode}:\n{out.stdout}{out.stderr}")
        return out

    def apply(self, manifest: Obj | str | Path) -> str:
        if isinstance(manifest, Path):
            return self.kubectl("apply", "-f", str(manifest)).stdout
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
        return self.kubectl("apply", "-f", "-", input=text).stdout

    # ------------------------------------------------------------------ namespaces & pods
    def create_namespace(self, prefix: str = "test") -> str:
        name = f"{prefix[:40].rstrip('-')}-{uuid.uuid4().hex[:6]}".lower()
        self.admin().create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        self.admin().wait_for(
            f"/api/v1/namespaces/{name}/serviceaccounts/default", lambda o: o is not None, 30, "ServiceAccount default"
        )
        return name

    def delete_namespace(self, name: str, wait: bool = False, timeout: float = 60) -> None:
        self.admin().delete(f"/api/v1/namespaces/{name}")
        if wait:
            self.admin().wait_for(f"/api/v1/namespaces/{name}", lambda o: o is None, timeout, f"namespace {name} gone")

    def wait_pod(
        self, namespace: str, name: str, until: str | Callable[[Obj | None], bool], timeout: float = 30
    ) -> Obj | None:
        if isinstance(until, str):
            phase = until
            return self.admin().wait_for(
                path("v1", "pods", namespace, name),
                lambda p: p is not None and p.get("status", {}).get("phase") == phase,
                timeout,
                f"pod {namespace}/{name} phase {phase}",
            )
        return self.admin().wait_for(path("v1", "pods", namespace, name), until, timeout, f"pod {namespace}/{name}")

    def pod_log(self, namespace: str, name: str, container: str | None = None) -> str:
        args = ["logs", "-n", namespace, name] + (["-c", container] if container else [])
        return self.kubectl(*args, check=False).stdout

    # ------------------------------------------------------------------ nodes
    def node(self, name: str) -> Obj:
        return self.admin().get(f"/api/v1/nodes/{name}")

    @staticmethod
    def node_ready(node: Obj | None) -> str | None:
        for c in (node or {}).get("status", {}).get("conditions", []):
            if c["type"] == "Ready":
                return str(c["status"])
        return None

    def wait_node_ready(self, name: str, timeout: float = 120) -> Obj:
        node = self.admin().wait_for(
            f"/api/v1/nodes/{name}", lambda n: self.node_ready(n) == "True", timeout, f"node {name} Ready"
        )
        assert node is not None
        return node

    def wait_node_condition(self, name: str, status: str, timeout: float = 120) -> Obj:
        node = self.admin().wait_for(
            f"/api/v1/nodes/{name}", lambda n: self.node_ready(n) == status, timeout, f"node {name} Ready={status}"
        )
        assert node is not None
        return node

    def cordon(self, name: str) -> None:
        self.kubectl("cordon", name)

    def uncordon(self, name: str) -> None:
        self.kubectl("uncordon", name)

    def taint(self, name: str, key: str, value: str | None = None, effect: str = "NoSchedule") -> None:
        self.kubectl("taint", "nodes", name, f"{key}={value or ''}:{effect}", "--overwrite")

    def untaint(self, name: str, key: str, effect: str | None = None) -> None:
        self.kubectl("taint", "nodes", name, f"{key}{':' + effect if effect else ''}-", check=False)

    def evict(self, namespace: str, pod: str, grace_seconds: int | None = None) -> tuple[int, str]:
        body: Obj = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": namespace}}
        if grace_seconds is not None:
            body["deleteOptions"] = {"gracePeriodSeconds": grace_seconds}
        from spotrl_e2e.kube import ApiError

        try:
            self.admin().create(path("v1", "pods", namespace, pod, "eviction"), body)
        except ApiError as err:
            return err.status, err.message
        return 201, "evicted"

    def drain(self, name: str, timeout: float = 120, extra_args: Sequence[str] = ()) -> Drain:
        out = self.workdir / f"drain-{name}-{uuid.uuid4().hex[:6]}.log"
        args = [
            str(self.tools.kubectl),
            "drain",
            name,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--force",
            f"--timeout={int(timeout)}s",
            *extra_args,
        ]
        with open(out, "wb") as f:
            proc = subprocess.Popen(
                args,
                env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        return Drain(proc, out)

    def graceful_shutdown(self, name: str, grace_seconds: float = 15, wait: bool = True) -> None:
        import pytest

        pytest.skip(self.graceful_shutdown_reason)

    def lose_node(self, name: str) -> None:
        """Abrupt loss: the node's container stops at once (kubelet and pods with it)."""
        subprocess.run(["docker", "stop", "--time", "0", name], check=True, capture_output=True, timeout=60)

    def restore_node(self, name: str, wait: bool = True) -> None:
        subprocess.run(["docker", "start", name], check=True, capture_output=True, timeout=60)
        if wait:
            self.wait_node_ready(name)

    def delete_node(self, name: str) -> None:
        self.lose_node(name)
        self.admin().delete(f"/api/v1/nodes/{name}")

    def reset_nodes(self, timeout: float = 180) -> None:
        """Every node back: running, Ready, uncordoned, with its initial taints only."""
        for name, taints in self._initial.items():
            state = subprocess.run(
                ["docker", "inspect", "-f", "{{.State.Running}}", name], capture_output=True, text=True, check=False
            ).stdout.strip()
            if state == "false":
                subprocess.run(["docker", "start", name], check=True, capture_output=True, timeout=60)
            if self.admin().get_or_none(f"/api/v1/nodes/{name}") is None:
                deadline = time.monotonic() + timeout
                while self.admin().get_or_none(f"/api/v1/nodes/{name}") is None and time.monotonic() < deadline:
                    time.sleep(1)
            self.wait_node_ready(name, timeout)
            node = self.node(name)
            own = [t for t in node["spec"].get("taints") or [] if t["key"].startswith(_CONTROLLER_TAINTS)]
            node["spec"]["taints"] = own + taints
            node["spec"].pop("unschedulable", None)
            self.admin().replace(f"/api/v1/nodes/{name}", node)
