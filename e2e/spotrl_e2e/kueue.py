"""Kueue on the test control plane: its CRDs, its manager as a local process, and its
webhooks served over TLS to the API server, with RLJobs as an external framework.

Kueue is built from its Go module into the toolchain (``e2e/toolchain/build.sh``: the manager,
and from the same module its v1beta2 CRDs and webhook configurations). The manager runs
against the cluster's admin kubeconfig with a configuration made here:

- ``integrations.externalFrameworks: [RLJob.v1alpha1.spotrl.dev]``: the operator is the RLJob's
  job controller (:mod:`spotrl_operator.queueing`);
- no internal certificate management: the webhook server's certificate is issued by the
  cluster's own CA (:class:`~spotrl_e2e.pki.ClusterPKI`) for 127.0.0.1, and the webhook
  configurations point at ``https://127.0.0.1:<port>/<path>`` with that CA;
- no leader election, no visibility server, metrics off.

Kueue reads its metrics certificate from a fixed path, ``/etc/kueue/metrics/certs``, when it
manages no certificates itself. So that nothing is written outside the test's folder, the
manager runs in a mount namespace of its own where ``/etc`` is an overlay whose writes land in
that folder (``unshare`` and ``mount``: the tests run as root here and in CI).
"""

from __future__ import annotations

import base64
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from spotrl_e2e.kube import wait_crd_served
from spotrl_e2e.kubecluster import KubeCluster
from spotrl_e2e.pki import ClusterPKI
from spotrl_e2e.procs import Process, free_port

Obj = dict[str, Any]
EXTERNAL_FRAMEWORK = "RLJob.v1alpha1.spotrl.dev"
API = "/apis/kueue.x-k8s.io/v1beta2"
METRICS_CERTS = "/etc/kueue/metrics/certs"


def config(webhook_port: int, health_port: int, cert_dir: Path) -> Obj:
    """The manager's Configuration (``config.kueue.x-k8s.io/v1beta2``; decoded strictly)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": "kueue-system",
        "manageJobsWithoutQueueName": False,
        "internalCertManagement": {"enable": False},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": str(cert_dir)},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "leaderElection": {"leaderElect": False},
        "clientConnection": {"qps": 50, "burst": 100},
        "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [EXTERNAL_FRAMEWORK]},
        "featureGates": {"VisibilityOnDemand": False},
    }


def local_webhooks(manifest: str, port: int, ca_pem: bytes) -> list[Obj]:
    """Kueue's webhook configurations, pointed at the local manager: each service reference
    becomes ``https://127.0.0.1:<port><path>`` with the cluster CA; only Kueue's own kinds
    (``kueue.x-k8s.io``), not the built-in job integrations, which these tests do not run."""
    out = []
    ca = base64.b64encode(ca_pem).decode()
    for doc in yaml.safe_load_all(manifest):
        if not doc:
            continue
        hooks = []
        for hook in doc.get("webhooks") or []:
            groups = {g for rule in hook.get("rules") or [] for g in rule.get("apiGroups") or []}
            if groups != {"kueue.x-k8s.io"}:
                continue
            where = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{where}", "caBundle": ca}
            hooks.append(hook)
        doc["metadata"] = {"name": f"kueue-{doc['metadata']['name']}"}
        doc["webhooks"] = hooks
        out.append(doc)
    return out


class Kueue:
    """Kueue's CRDs, webhooks and manager on a :class:`KubeCluster` whose CA this side holds."""

    def __init__(self, cluster: KubeCluster, pki: ClusterPKI, binary: Path, manifests: Path, workdir: Path):
        self.cluster = cluster
        self.pki = pki
        self.binary = binary
        self.manifests = manifests
        self.workdir = workdir
        self.webhook_port = free_port()
        self.health_port = free_port()
        self.process: Process | None = None

    def install_crds(self) -> None:
        """Every Kueue CRD (its controllers watch them all); server-side, since the Workload's
        is 1.4 MB, beyond a client-side apply's annotation."""
        crds = sorted((self.manifests / "crds").glob("*.yaml"))
        self.cluster.kubectl("apply", "--server-side", "--force-conflicts", *(f"-f={c}" for c in crds))
        for crd in crds:
            wait_crd_served(self.cluster.admin(), yaml.safe_load(crd.read_text())["metadata"]["name"], 60)

    def start(self, timeout: float = 60) -> Kueue:
        self.install_crds()
        self.workdir.mkdir(parents=True, exist_ok=True)
        certs = self.workdir / "certs"
        certs.mkdir(exist_ok=True)
        pair = self.pki.issue("kueue-webhook", "kueue-webhook", ips=("127.0.0.1",), server=True)
        shutil.copy(pair.cert, certs / "tls.crt")
        shutil.copy(pair.key, certs / "tls.key")
        cfg = self.workdir / "kueue-config.yaml"
        cfg.write_text(yaml.safe_dump(config(self.webhook_port, self.health_port, certs)))
        overlay = self.workdir / "etc-overlay"
        for d in ("up", "work"):
            (overlay / d).mkdir(parents=True, exist_ok=True)
        script = (
            f"mount -t overlay overlay -o lowerdir=/etc,upperdir={overlay}/up,workdir={overlay}/work /etc"
            f" && mkdir -p {METRICS_CERTS} && cp {certs}/tls.crt {certs}/tls.key {METRICS_CERTS}/"
            f' && exec "$0" --config {cfg} --kubeconfig {self.cluster.kubeconfig} --zap-log-level=2'
        )
        argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(self.binary)]
        self.process = Process("kueue", argv, self.workdir).start()
        self.process.wait_ready(self._healthy, timeout, "ready (/readyz)")
        webhooks = local_webhooks(
            (self.manifests / "webhooks.yaml").read_text(), self.webhook_port, self.pki.ca.cert.read_bytes()
        )
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(webhooks))
        return self

    def _healthy(self) -> bool:
        out = subprocess.run(
            ["curl", "-sf", f"http://127.0.0.1:{self.health_port}/readyz"], capture_output=True, timeout=5, check=False
        )
        return out.returncode == 0

    def log(self) -> str:
        return self.process.log.read_text(errors="replace") if self.process is not None else ""

    def stop(self) -> None:
        """Stops the manager and takes its webhooks out of the API server (a stopped server with
        Fail webhooks would refuse every write of Kueue's objects)."""
        self.cluster.kubectl(
            "delete",
            "--ignore-not-found",
            "mutatingwebhookconfiguration/kueue-mutating-webhook-configuration",
            "validatingwebhookconfiguration/kueue-validating-webhook-configuration",
            check=False,
        )
        if self.process is not None:
            self.process.stop()

    # ------------------------------------------------------------------ Kueue's objects
    def apply(self, *docs: Obj) -> None:
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(list(docs)))

    def workloads(self, namespace: str) -> list[Obj]:
        return self.cluster.admin().get(f"{API}/namespaces/{namespace}/workloads").get("items") or []

    def delete(self, kind: str, name: str) -> None:
        self.cluster.kubectl(
            "delete", "--ignore-not-found", "--wait=false", f"{kind}.kueue.x-k8s.io/{name}", check=False
        )


def resource_flavor(name: str, node_labels: dict[str, str]) -> Obj:
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "ResourceFlavor",
        "metadata": {"name": name},
        "spec": {"nodeLabels": node_labels},
    }


def cluster_queue(
    name: str, flavor: str, cpu: str, memory: str, cohort: str | None = None, lending: str | None = None
) -> Obj:
    """A ClusterQueue over every namespace with quota for cpu and memory in one flavor, which
    preempts lower priorities within itself and reclaims its lent quota from its cohort."""
    resources: list[Obj] = [{"name": "cpu", "nominalQuota": cpu}, {"name": "memory", "nominalQuota": memory}]
    if lending is not None:
        for r in resources:
            r["lendingLimit"] = r["nominalQuota"] if r["name"] == "memory" else lending
    spec: Obj = {
        "namespaceSelector": {},
        "resourceGroups": [
            {"coveredResources": ["cpu", "memory"], "flavors": [{"name": flavor, "resources": resources}]}
        ],
        "preemption": {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "Any"},
    }
    if cohort:
        spec["cohortName"] = cohort
    return {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": name}, "spec": spec}


def local_queue(namespace: str, name: str, cq: str) -> Obj:
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "LocalQueue",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"clusterQueue": cq},
    }


def priority_class(name: str, value: int) -> Obj:
    return {
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": "WorkloadPriorityClass",
        "metadata": {"name": name},
        "value": value,
    }
