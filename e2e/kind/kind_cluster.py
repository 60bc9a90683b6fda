"""The end-to-end tests' cluster on kind: the failure-mode helpers of the test control plane
(``spotrl_e2e.cluster.Cluster``) with the same names, done the way they happen on kind.

- cordon, taint, evict, drain, namespaces, pods: :class:`spotrl_e2e.kubecluster.KubeCluster`,
  the API and ``kubectl``, exactly as on any cluster;
- abrupt node loss: ``docker kill`` of the node's container (kubelet and every container
  die at once; the node controller marks the node NotReady/Unknown), restore: ``docker
  start``;
- graceful node shutdown: not offered (kind nodes have no logind inhibitor for the
  kubelet's graceful node shutdown); tests that need it are skipped on kind with that reason.

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
from pathlib import Path
from typing import Any

import yaml

from spotrl_e2e.kube import Credentials
from spotrl_e2e.kubecluster import CONTROLLER_TAINT_PREFIX, KubeCluster
from spotrl_e2e.pki import KeyPair
from spotrl_e2e.podlogs import PodLogKeeper

Obj = dict[str, Any]


class KindTools:
    """kubectl and helm from PATH (or $KUBECTL / $HELM)."""

    def __init__(self) -> None:
        self.kubectl = Path(os.environ.get("KUBECTL") or shutil.which("kubectl") or "kubectl")
        self.helm = Path(os.environ.get("HELM") or shutil.which("helm") or "helm")


class KindCluster(KubeCluster):
    """A running kind cluster (``kind create cluster --name NAME``), seen through KUBECONFIG."""

    graceful_shutdown_reason = "kind nodes cannot do the kubelet's graceful node shutdown (no logind inhibitor)"

    def __init__(self, name: str, kubeconfig: Path, workdir: Path | None = None):
        super().__init__(workdir or Path(tempfile.mkdtemp(prefix="spotrl-kind-")))
        self.name = name
        self._kubeconfig = kubeconfig
        self.tools = KindTools()
        config = yaml.safe_load(kubeconfig.read_text())
        ctx = next(c for c in config["contexts"] if c["name"] == config["current-context"])["context"]
        cluster = next(c for c in config["clusters"] if c["name"] == ctx["cluster"])["cluster"]
        user = next(u for u in config["users"] if u["name"] == ctx["user"])["user"]
        self._server = str(cluster["server"])
        self._ca = self._write("ca.crt", cluster["certificate-authority-data"])
        self._client = KeyPair(
            self._write("admin.crt", user["client-certificate-data"]),
            self._write("admin.key", user["client-key-data"]),
        )
        self._initial = {n["metadata"]["name"]: self._own_taints(n) for n in self.admin().get("/api/v1/nodes")["items"]}

    @classmethod
    def from_env(cls) -> KindCluster:
        kubeconfig = os.environ.get("KUBECONFIG")
        if not kubeconfig:
            raise RuntimeError("SPOTRL_E2E_TARGET=kind needs KUBECONFIG pointing at the kind cluster")
        return cls(os.environ.get("SPOTRL_KIND_CLUSTER", "spotrl-e2e"), Path(kubeconfig))

    def keep_pod_logs(self) -> PodLogKeeper:
        """Starts following the log of every SpotRL pod (operators, controllers, workers) into
        ``$SPOTRL_E2E_POD_LOGS`` (run.sh: ``$ARTIFACTS/pod-logs``), else ``$ARTIFACTS/pod-logs``,
        else ``workdir/pod-logs``: ``kind export logs`` misses the pods deleted or replaced
        before it runs. :meth:`PodLogKeeper.stop` ends it."""
        artifacts = os.environ.get("ARTIFACTS")
        default = Path(artifacts) / "pod-logs" if artifacts else self.workdir / "pod-logs"
        out = Path(os.environ.get("SPOTRL_E2E_POD_LOGS") or default)
        return PodLogKeeper(self.kubeconfig, self.tools.kubectl, out).start()

    def _write(self, name: str, b64: str) -> Path:
        file = self.workdir / name
        file.write_bytes(base64.b64decode(b64))
        file.chmod(0o600)
        return file

    @staticmethod
    def _own_taints(node: Obj) -> list[Obj]:
        taints = node.get("spec", {}).get("taints") or []
        return [t for t in taints if not t["key"].startswith(CONTROLLER_TAINT_PREFIX)]

    # ------------------------------------------------------------------ where the API server is
    @property
    def kubeconfig(self) -> Path:
        return self._kubeconfig

    @property
    def server(self) -> str:
        return self._server

    @property
    def ca(self) -> Path:
        return self._ca

    def _admin_credentials(self) -> Credentials:
        return Credentials(self.server, self.ca, client=self._client)

    # ------------------------------------------------------------------ nodes
    def wait_node_ready(self, name: str, timeout: float = 120) -> Obj:
        """Ready (a kind node boots slower than the node agent's; the node controller lifts its
        taints on its own schedule, not waited for here)."""
        return self.wait_node_condition(name, "True", timeout)

    def wait_node_condition(self, name: str, status: str, timeout: float = 120) -> Obj:
        return super().wait_node_condition(name, status, timeout)

    def graceful_shutdown(self, name: str, grace_seconds: float = 15, wait: bool = True) -> None:
        import pytest

        pytest.skip(self.graceful_shutdown_reason)

    def lose_node(self, name: str) -> None:
        """Abrupt loss: the node's container stops at once (kubelet and pods with it)."""
        subprocess.run(["docker", "kill", name], check=True, capture_output=True, timeout=60)

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
            self._reset_node_object(name, taints)
