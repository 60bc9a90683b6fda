"""What every test cluster offers that only talks to the Kubernetes API or runs kubectl.

:class:`KubeCluster` is the base of the test control plane (:class:`spotrl_e2e.cluster.Cluster`)
and of the kind harness (``e2e/kind/kind_cluster.py``): clients, ``kubectl``, namespaces,
pods, and the node helpers that any cluster does the same way (cordon, taint, evict, drain).
A subclass says where its API server, credentials and kubectl are, and how its nodes are
lost, restored, shut down and reset; the helpers' names and signatures are the contract
the end-to-end tests rely on, so that they run on either.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml

from spotrl_e2e.kube import ApiError, Credentials, KubeClient, path, wait_crd_served
from spotrl_e2e.nodeagent.config import Taint

Obj = dict[str, Any]

# Taints the control plane puts on and takes off by itself (not-ready, unreachable, ...).
CONTROLLER_TAINT_PREFIX = "node.kubernetes.io/"


class KubeTools(Protocol):
    """The client binaries a cluster's helpers run."""

    @property
    def kubectl(self) -> Path: ...

    @property
    def helm(self) -> Path: ...


class Drain:
    """A ``kubectl drain`` running in the background."""

    def __init__(self, proc: subprocess.Popen[bytes], output: Path):
        self.proc = proc
        self.output_file = output

    def output(self) -> str:
        """What kubectl printed so far (stdout and stderr)."""
        return self.output_file.read_text(errors="replace")

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float) -> int:
        """Waits for kubectl to finish; returns its exit code. TimeoutError shows its output."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"kubectl drain still running after {timeout:.0f} s; output:\n{self.output()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)


class KubeCluster(ABC):
    """A running cluster, seen through the API server as admin. Files (drain logs ...) go
    under ``workdir``."""

    workdir: Path
    tools: KubeTools

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self._admin: KubeClient | None = None

    # ------------------------------------------------------------------ where the API server is
    @property
    @abstractmethod
    def kubeconfig(self) -> Path:
        """An admin kubeconfig (group system:masters) for kubectl and clients."""

    @property
    @abstractmethod
    def server(self) -> str:
        """The API server's URL."""

    @property
    @abstractmethod
    def ca(self) -> Path:
        """The CA certificate (PEM file) that the API server's serving certificate chains to."""

    @abstractmethod
    def _admin_credentials(self) -> Credentials:
        """The admin identity of :meth:`admin`."""

    # ------------------------------------------------------------------ clients
    def admin(self) -> KubeClient:
        """A dict-based client with cluster-admin rights (see :mod:`spotrl_e2e.kube`)."""
        if self._admin is None:
            self._admin = KubeClient(self._admin_credentials())
        return self._admin

    def api_client(self) -> Any:
        """The official client (``kubernetes.client.ApiClient``) with the admin kubeconfig."""
        from kubernetes import config

        return config.new_client_from_config(config_file=str(self.kubeconfig))

    def kubectl(
        self, *args: str, check: bool = True, timeout: float = 60, input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """Runs ``tools.kubectl`` (on the test control plane the pinned one) as admin. ``check``: a
        non-zero exit raises with its output."""
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        out = subprocess.run(
            [str(self.tools.kubectl), *args],
            env=env,
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
        """``kubectl apply`` of a dict, YAML text or a file; returns kubectl's output."""
        if isinstance(manifest, Path):
            return self.kubectl("apply", "-f", str(manifest)).stdout
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
        return self.kubectl("apply", "-f", "-", input=text).stdout

    def install_crd(self, manifest: Path, timeout: float = 30) -> Obj:
        """``kubectl apply`` of a CRD's file; returns the CRD once the API server serves its
        resource (Established, and its storage answering lists: :func:`wait_crd_served`)."""
        self.kubectl("apply", "-f", str(manifest))
        return wait_crd_served(self.admin(), yaml.safe_load(manifest.read_text())["metadata"]["name"], timeout)

    def install_crds(self, manifests: Sequence[Path], timeout: float = 60) -> None:
        """A server-side apply of CRD files (some are beyond a client-side apply's annotation, as
        Kueue's Workload), returning once the API server serves each (:func:`wait_crd_served`)."""
        self.kubectl("apply", "--server-side", "--force-conflicts", *(f"-f={m}" for m in manifests), timeout=120)
        for m in manifests:
            wait_crd_served(self.admin(), yaml.safe_load(m.read_text())["metadata"]["name"], timeout)

    # ------------------------------------------------------------------ namespaces & pods
    def create_namespace(self, prefix: str = "test", pod_security: str | None = None) -> str:
        """A fresh namespace (waits for its default ServiceAccount, as pods need it).
        ``pod_security``: the Pod Security level it enforces (``restricted``, ``baseline``)."""
        name = f"{prefix[:40].rstrip('-')}-{uuid.uuid4().hex[:6]}".lower()
        meta: dict[str, Any] = {"name": name}
        if pod_security:
            meta["labels"] = {
                "pod-security.kubernetes.io/enforce": pod_security,
                "pod-security.kubernetes.io/enforce-version": "latest",
            }
        self.admin().create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": meta})
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
        """Waits for a pod to reach a phase (``until="Running"``), or for ``until(pod)`` to hold
        (``pod`` is None once the pod is gone)."""
        check: Callable[[Obj | None], bool]
        if isinstance(until, str):
            phase = until
            check = lambda p: p is not None and p.get("status", {}).get("phase") == phase  # noqa: E731
            what = f"pod {namespace}/{name} phase {phase}"
        else:
            check, what = until, f"pod {namespace}/{name} condition"
        return self.admin().wait_for(path("v1", "pods", namespace, name), check, timeout, what)

    def pod_log(self, namespace: str, name: str, container: str | None = None) -> str:
        """A container's output (``kubectl logs``; empty if there is none)."""
        args = ["logs", "-n", namespace, name] + (["-c", container] if container else [])
        return self.kubectl(*args, check=False).stdout

    # ------------------------------------------------------------------ nodes
    def node(self, name: str) -> Obj:
        return self.admin().get(f"/api/v1/nodes/{name}")

    @staticmethod
    def node_ready(node: Obj | None) -> str | None:
        """The status of a Node's Ready condition: "True", "False", "Unknown" or None."""
        for c in (node or {}).get("status", {}).get("conditions", []):
            if c["type"] == "Ready":
                return str(c["status"])
        return None

    def wait_node_ready(self, name: str, timeout: float = 30) -> Obj:
        """Ready, and the control plane has lifted its not-ready/unreachable taints."""

        def ready(n: Obj | None) -> bool:
            taints = (n or {}).get("spec", {}).get("taints", [])
            controller = [
                t for t in taints if t["key"] in ("node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable")
            ]
            return self.node_ready(n) == "True" and not controller

        node = self.admin().wait_for(f"/api/v1/nodes/{name}", ready, timeout, f"node {name} Ready")
        assert node is not None
        return node

    def wait_node_condition(self, name: str, status: str, timeout: float = 60) -> Obj:
        """Waits until the node's Ready condition is ``status`` ("False" or "Unknown" ...)."""
        node = self.admin().wait_for(
            f"/api/v1/nodes/{name}", lambda n: self.node_ready(n) == status, timeout, f"node {name} Ready={status}"
        )
        assert node is not None
        return node

    def _update_node(self, name: str, change: Callable[[Obj], None]) -> Obj:
        for _ in range(10):
            node = self.node(name)
            change(node)
            try:
                return self.admin().replace(f"/api/v1/nodes/{name}", node)
            except ApiError as err:
                if err.status != 409:
                    raise
        raise RuntimeError(f"node {name}: kept conflicting with other writers")

    def _reset_node_object(self, name: str, taints: list[Obj]) -> None:
        """Uncordons the Node and leaves it ``taints`` plus those the control plane keeps on it."""

        def change(node: Obj) -> None:
            own = [t for t in node["spec"].get("taints") or [] if t["key"].startswith(CONTROLLER_TAINT_PREFIX)]
            node["spec"]["taints"] = own + taints
            node["spec"].pop("unschedulable", None)

        self._update_node(name, change)

    def cordon(self, name: str) -> None:
        """spec.unschedulable = true (what ``kubectl cordon`` and every drain start with)."""
        self._update_node(name, lambda n: n["spec"].__setitem__("unschedulable", True))

    def uncordon(self, name: str) -> None:
        self._update_node(name, lambda n: n["spec"].pop("unschedulable", None))

    def taint(self, name: str, key: str, value: str | None = None, effect: str = "NoSchedule") -> None:
        """Adds (or replaces) a taint, as a termination handler does (e.g. ``karpenter.sh/disrupted``)."""
        new = Taint(key, value, effect).to_api()

        def change(n: Obj) -> None:
            taints = [t for t in n["spec"].get("taints", []) if (t["key"], t["effect"]) != (key, effect)]
            n["spec"]["taints"] = [*taints, new]

        self._update_node(name, change)

    def untaint(self, name: str, key: str, effect: str | None = None) -> None:
        """Removes the taints with ``key`` (and ``effect``, if given)."""

        def change(n: Obj) -> None:
            keep = [t for t in n["spec"].get("taints", []) if t["key"] != key or (effect and t["effect"] != effect)]
            n["spec"]["taints"] = keep

        self._update_node(name, change)

    def evict(self, namespace: str, pod: str, grace_seconds: int | None = None) -> tuple[int, str]:
        """One call of the Eviction API: (HTTP status, message). 201: evicted; 429: a
        PodDisruptionBudget forbids it now."""
        body: Obj = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": namespace}}
        if grace_seconds is not None:
            body["deleteOptions"] = {"gracePeriodSeconds": grace_seconds}
        try:
            self.admin().create(path("v1", "pods", namespace, pod, "eviction"), body)
        except ApiError as err:
            return err.status, err.message
        return 201, "evicted"

    def drain(self, name: str, timeout: float = 120, extra_args: Sequence[str] = ()) -> Drain:
        """Starts ``kubectl drain`` (cordon, then evictions that honour PDBs and retry on 429
        every 5 s) in the background."""
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

    # ------------------------------------------------------------------ what each cluster does its own way
    @abstractmethod
    def graceful_shutdown(self, name: str, grace_seconds: float = 15, wait: bool = True) -> None:
        """The node shuts down gracefully with a capped grace period (GKE spot: pods get about
        15 s): NotReady, SIGTERM to every pod, at most ``grace_seconds`` each, PDBs ignored, pods
        marked Failed with DisruptionTarget; then its heartbeats stop."""

    @abstractmethod
    def lose_node(self, name: str) -> None:
        """Abrupt loss: every process of the node dies at once and nothing renews its Lease and
        status; the node controller marks it Unknown after the grace period and the taint
        manager evicts its pods."""

    @abstractmethod
    def restore_node(self, name: str, wait: bool = True) -> None:
        """The node boots again: it re-registers; pods it had are run anew (restartPolicy Never:
        failed)."""

    @abstractmethod
    def delete_node(self, name: str) -> None:
        """The machine is gone and the cloud removes its Node object (then pod GC removes its pods)."""

    @abstractmethod
    def reset_nodes(self, timeout: float = 60) -> None:
        """Puts the nodes back as the cluster started: lost or shut-down nodes booted again,
        uncordoned, with their configured taints only. The fixtures call it after each test."""
