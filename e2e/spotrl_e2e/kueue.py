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

In a kind cluster (``e2e/kind/run.sh``, before the chart) Kueue runs as users run it: a
Deployment of its manager (the toolchain's binary in an image, ``e2e/kind/images.sh``) with its
own ClusterRole, its configuration in a ConfigMap, its webhook certificate in a Secret (issued
here by a CA made for it) and its webhooks behind a Service: ``python -m spotrl_e2e.kueue
install`` (:func:`in_cluster`).
"""

from __future__ import annotations

import base64
import shutil
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from spotrl_e2e.kubecluster import KubeCluster
from spotrl_e2e.pki import ClusterPKI
from spotrl_e2e.procs import Process, free_port

Obj = dict[str, Any]
EXTERNAL_FRAMEWORK = "RLJob.v1alpha1.spotrl.dev"
API = "/apis/kueue.x-k8s.io/v1beta2"
METRICS_CERTS = "/etc/kueue/metrics/certs"
NAMESPACE = "kueue-system"
MANAGER = "kueue-controller-manager"
WEBHOOK_SERVICE = "kueue-webhook-service"


def config(webhook_port: int, health: str, cert_dir: str, webhook_host: str = "127.0.0.1") -> Obj:
    """The manager's Configuration (``config.kueue.x-k8s.io/v1beta2``; decoded strictly)."""
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": NAMESPACE,
        "manageJobsWithoutQueueName": False,
        "internalCertManagement": {"enable": False},
        "webhook": {"port": webhook_port, "host": webhook_host, "certDir": cert_dir},
        "metrics": {"bindAddress": "0"},
        "health": {"healthProbeBindAddress": health},
        "leaderElection": {"leaderElect": False},
        "clientConnection": {"qps": 50, "burst": 100},
        "integrations": {"frameworks": ["batch/job"], "externalFrameworks": [EXTERNAL_FRAMEWORK]},
        "featureGates": {"VisibilityOnDemand": False},
    }


def local_webhooks(manifest: str, port: int, ca_pem: bytes) -> list[Obj]:
    """Kueue's webhook configurations, pointed at the local manager: each service reference
    becomes ``https://127.0.0.1:<port><path>`` with the cluster CA."""
    ca = base64.b64encode(ca_pem).decode()
    return webhooks(manifest, lambda path: {"url": f"https://127.0.0.1:{port}{path}", "caBundle": ca})


def service_webhooks(manifest: str, ca_pem: bytes) -> list[Obj]:
    """Kueue's webhook configurations behind its Service in :data:`NAMESPACE`, with ``ca_pem``."""
    ca = base64.b64encode(ca_pem).decode()
    return webhooks(
        manifest,
        lambda path: {
            "service": {"name": WEBHOOK_SERVICE, "namespace": NAMESPACE, "path": path, "port": 443},
            "caBundle": ca,
        },
    )


def webhooks(manifest: str, client_config: Callable[[str], Obj]) -> list[Obj]:
    """Kueue's webhook configurations (named as Kueue names them), each webhook's client
    config made by ``client_config(path)``; only Kueue's own kinds (``kueue.x-k8s.io``), not
    the built-in job integrations, which no test here runs."""
    out = []
    for doc in yaml.safe_load_all(manifest):
        if not doc:
            continue
        hooks = []
        for hook in doc.get("webhooks") or []:
            groups = {g for rule in hook.get("rules") or [] for g in rule.get("apiGroups") or []}
            if groups != {"kueue.x-k8s.io"}:
                continue
            hook["clientConfig"] = client_config(hook["clientConfig"]["service"]["path"])
            hooks.append(hook)
        doc["metadata"] = {"name": f"kueue-{doc['metadata']['name']}"}
        doc["webhooks"] = hooks
        out.append(doc)
    return out


class Kueue:
    """Kueue's objects on a cluster where Kueue runs (here or installed by :func:`in_cluster`)."""

    def __init__(self, cluster: KubeCluster):
        self.cluster = cluster

    def apply(self, *docs: Obj) -> None:
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(list(docs)))

    def workloads(self, namespace: str) -> list[Obj]:
        return self.cluster.admin().get(f"{API}/namespaces/{namespace}/workloads").get("items") or []

    def delete(self, kind: str, name: str) -> None:
        self.cluster.kubectl(
            "delete", "--ignore-not-found", "--wait=false", f"{kind}.kueue.x-k8s.io/{name}", check=False
        )


class LocalKueue(Kueue):
    """Kueue's CRDs, webhooks and manager as a local process, on a :class:`KubeCluster` whose CA
    this side holds."""

    def __init__(self, cluster: KubeCluster, pki: ClusterPKI, binary: Path, manifests: Path, workdir: Path):
        super().__init__(cluster)
        self.pki = pki
        self.binary = binary
        self.manifests = manifests
        self.workdir = workdir
        self.webhook_port = free_port()
        self.health_port = free_port()
        self.process: Process | None = None

    def install_crds(self) -> None:
        """Every Kueue CRD (its controllers watch them all)."""
        self.cluster.install_crds(sorted((self.manifests / "crds").glob("*.yaml")))

    def start(self, timeout: float = 60) -> LocalKueue:
        self.install_crds()
        self.workdir.mkdir(parents=True, exist_ok=True)
        certs = self.workdir / "certs"
        certs.mkdir(exist_ok=True)
        pair = self.pki.issue("kueue-webhook", "kueue-webhook", ips=("127.0.0.1",), server=True)
        shutil.copy(pair.cert, certs / "tls.crt")
        shutil.copy(pair.key, certs / "tls.key")
        cfg = self.workdir / "kueue-config.yaml"
        cfg.write_text(yaml.safe_dump(config(self.webhook_port, f"127.0.0.1:{self.health_port}", str(certs))))
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


# ----------------------------------------------------------------------------- in a cluster
def in_cluster(manifests: Path, image: str, cert_pem: bytes, key_pem: bytes, ca_pem: bytes) -> list[Obj]:
    """Kueue in a cluster, as its release installs it, less what the tests do not use: the
    manager's Deployment (one replica, no leader election, on the on-demand node, so that a
    test's drain of a spot node never takes it), its ServiceAccount bound to Kueue's own
    manager roles (``manifests/rbac``), its Configuration, its webhook certificate (mounted
    where Kueue reads the metrics certificate too), the webhook Service and configurations.
    The CRDs are applied first, on their own (:func:`install`)."""
    labels = {"app.kubernetes.io/name": "kueue", "control-plane": "controller-manager"}
    sa = {"kind": "ServiceAccount", "name": MANAGER, "namespace": NAMESPACE}
    docs: list[Obj] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": MANAGER, "namespace": NAMESPACE}},
    ]
    for file in sorted((manifests / "rbac").glob("*.yaml")):
        for role in yaml.safe_load_all(file.read_text()):
            if not role:
                continue
            name = f"kueue-{role['metadata']['name']}"
            role["metadata"]["name"] = name
            namespaced = role["kind"] == "Role"
            if namespaced:
                role["metadata"]["namespace"] = NAMESPACE
            binding: Obj = {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "RoleBinding" if namespaced else "ClusterRoleBinding",
                "metadata": {"name": name, **({"namespace": NAMESPACE} if namespaced else {})},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role["kind"], "name": name},
                "subjects": [sa],
            }
            docs += [role, binding]
    cfg = config(9443, ":8081", "/certs", webhook_host="")
    docs += [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "kueue-manager-config", "namespace": NAMESPACE},
            "data": {"controller_manager_config.yaml": yaml.safe_dump(cfg)},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "kueue-webhook-server-cert", "namespace": NAMESPACE},
            "type": "kubernetes.io/tls",
            "data": {
                "tls.crt": base64.b64encode(cert_pem).decode(),
                "tls.key": base64.b64encode(key_pem).decode(),
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": WEBHOOK_SERVICE, "namespace": NAMESPACE},
            "spec": {"selector": labels, "ports": [{"port": 443, "targetPort": 9443, "protocol": "TCP"}]},
        },
        _deployment(image, labels),
    ]
    return docs


def _deployment(image: str, labels: dict[str, str]) -> Obj:
    certs = {"name": "cert", "secret": {"secretName": "kueue-webhook-server-cert"}}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": MANAGER, "namespace": NAMESPACE, "labels": labels},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": MANAGER,
                    "nodeSelector": {"karpenter.sh/capacity-type": "on-demand"},
                    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [
                        {
                            "name": "manager",
                            "image": image,
                            "imagePullPolicy": "Never",
                            "args": ["--config=/config/controller_manager_config.yaml", "--zap-log-level=2"],
                            "ports": [{"containerPort": 9443, "name": "webhook-server"}],
                            "readinessProbe": {"httpGet": {"path": "/readyz", "port": 8081}, "periodSeconds": 2},
                            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                            "securityContext": {
                                "runAsUser": 65532,
                                "allowPrivilegeEscalation": False,
                                "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]},
                            },
                            "volumeMounts": [
                                {"name": "config", "mountPath": "/config"},
                                {"name": "cert", "mountPath": "/certs", "readOnly": True},
                                {"name": "cert", "mountPath": METRICS_CERTS, "readOnly": True},
                            ],
                        }
                    ],
                    "volumes": [{"name": "config", "configMap": {"name": "kueue-manager-config"}}, certs],
                },
            },
        },
    }


def install(manifests: Path, image: str, workdir: Path, kubectl: str = "kubectl", timeout: float = 180) -> None:
    """Installs Kueue into the cluster of ``$KUBECONFIG`` (:func:`in_cluster`), its webhook
    certificate issued by a CA made for it in ``workdir``, and returns once its webhooks
    answer (a server-side dry run of a ResourceFlavor passes through them)."""

    def run(*args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        out = subprocess.run([kubectl, *args], input=input, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed:\n{out.stdout}{out.stderr}")
        return out

    crds = sorted((manifests / "crds").glob("*.yaml"))
    run("apply", "--server-side", "--force-conflicts", *(f"-f={c}" for c in crds))
    run("wait", "--for=condition=Established", "--timeout=60s", *(f"-f={c}" for c in crds))
    pki = ClusterPKI(workdir)
    dns = (WEBHOOK_SERVICE, f"{WEBHOOK_SERVICE}.{NAMESPACE}", f"{WEBHOOK_SERVICE}.{NAMESPACE}.svc")
    pair = pki.issue("kueue-webhook", dns[-1], dns=dns, server=True)
    ca = pki.ca.cert.read_bytes()
    objects = in_cluster(manifests, image, pair.cert.read_bytes(), pair.key.read_bytes(), ca)
    run("apply", "-f", "-", input=yaml.safe_dump_all(objects))
    run("rollout", "status", "-n", NAMESPACE, f"deployment/{MANAGER}", f"--timeout={int(timeout)}s")
    run("apply", "-f", "-", input=yaml.safe_dump_all(service_webhooks((manifests / "webhooks.yaml").read_text(), ca)))
    probe = yaml.safe_dump(resource_flavor("kueue-install-probe", {}))
    deadline = time.monotonic() + timeout
    while True:
        out = run("create", "--dry-run=server", "-f", "-", input=probe, check=False)
        if out.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"Kueue's webhooks do not answer after {timeout:.0f} s:\n{out.stderr}")
        time.sleep(1)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import os

    p = argparse.ArgumentParser(prog="python -m spotrl_e2e.kueue", description="Kueue in the cluster of $KUBECONFIG")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("install", help="CRDs, manager, certificate and webhooks; returns once the webhooks answer")
    i.add_argument("--manifests", type=Path, required=True, help="the toolchain's kueue-<version>/manifests")
    i.add_argument("--image", required=True, help="the manager's image, present on the nodes")
    i.add_argument("--workdir", type=Path, required=True, help="where the webhook CA and certificate are kept")
    args = p.parse_args(argv)
    install(args.manifests, args.image, args.workdir, kubectl=os.environ.get("KUBECTL", "kubectl"))
    print(f"kueue: {MANAGER} ready in {NAMESPACE}, its webhooks answering")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
