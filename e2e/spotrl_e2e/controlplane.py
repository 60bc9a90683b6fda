"""etcd, kube-apiserver, kube-controller-manager and kube-scheduler on loopback.

Real authentication (client certificates, service-account tokens), ``Node,RBAC``
authorization and the usual admission plugins; the node lifecycle timings are shortened
so that a lost node goes NotReady in about 10 s and its pods are evicted 5 s later.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spotrl_e2e.kube import Credentials, KubeClient
from spotrl_e2e.pki import SERVICE_CIDR, ClusterPKI, write_kubeconfig
from spotrl_e2e.procs import Process, free_port
from spotrl_e2e.tools import Tools, find_tools

# What kube-controller-manager runs: the controllers SpotRL's operator and tests rely on.
CONTROLLERS = (
    "garbage-collector-controller",
    "namespace-controller",
    "disruption-controller",
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "pod-garbage-collector-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",
    "replicaset-controller",
    "deployment-controller",
    "statefulset-controller",
    "job-controller",
    "ttl-after-finished-controller",
    # No endpoints/endpointslice controllers: the API server refuses loopback addresses (our pod
    # IPs) in Endpoints and EndpointSlices, so those controllers would only retry and warn.
)

ADMISSION_PLUGINS = (
    "NamespaceLifecycle",
    "LimitRanger",
    "ServiceAccount",
    "TaintNodesByCondition",
    "Priority",
    "DefaultTolerationSeconds",
    "DefaultStorageClass",
    "StorageObjectInUseProtection",
    "RuntimeClass",
    "DefaultIngressClass",
    "PodTopologyLabels",
    "NodeRestriction",
    "PodSecurity",  # on by default; named: the e2e namespaces enforce `restricted`
    "MutatingAdmissionPolicy",
    "MutatingAdmissionWebhook",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionWebhook",
    "ResourceQuota",
    # Off by default upstream, on in OpenShift: a blockOwnerDeletion owner reference needs
    # `update` on the owner's finalizers; on here so that the chart's RBAC is tested for it.
    "OwnerReferencesPermissionEnforcement",
)


# What the API server's audit log records (``ControlPlane.audit_log``): every write by a
# ServiceAccount outside kube-system (the operator, Kopf's own client included, and the jobs'
# runtime accounts), at Metadata level (who, what, when; never a body), one event per request.
# The controllers' accounts (kube-system) and everything else are not recorded: the log stays
# small on the session's cluster, and a test reads it to see who wrote what, and when.
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived", "ResponseStarted"],
    "rules": [
        {"level": "None", "userGroups": ["system:serviceaccounts:kube-system"]},
        {
            "level": "Metadata",
            "userGroups": ["system:serviceaccounts"],
            "verbs": ["create", "update", "patch", "delete", "deletecollection"],
        },
        {"level": "None"},
    ],
}
AUDIT_LOG_MAX_MB = 50  # then rotated once: at most twice this on disk, whatever the session runs


@dataclass
class Timings:
    """How fast the control plane notices trouble. Real clusters: 40-50 s and 300 s."""

    # A node whose Lease is not renewed for this long goes NotReady/Unknown.
    node_monitor_grace_period: int = 10
    # Pods tolerate not-ready / unreachable nodes this long before the taint manager evicts them.
    default_toleration_seconds: int = 5


@dataclass
class Endpoints:
    """Where the servers listen (filled in by :meth:`ControlPlane.start`)."""

    etcd: int = 0
    etcd_peer: int = 0
    apiserver: int = 0
    controller_manager: int = 0
    scheduler: int = 0

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.apiserver}"


@dataclass
class ControlPlane:
    """The servers of one test cluster, everything under ``workdir``."""

    workdir: Path
    tools: Tools = field(default_factory=find_tools)
    timings: Timings = field(default_factory=Timings)

    def __post_init__(self) -> None:
        self.pki = ClusterPKI(self.workdir / "pki")
        self.ports = Endpoints()
        self.processes: list[Process] = []
        self.admin_kubeconfig = self.workdir / "kubeconfig"
        self.audit_dir = self.workdir / "audit"
        self.startup_seconds: dict[str, float] = {}

    @property
    def server(self) -> str:
        return self.ports.server

    @property
    def audit_log(self) -> Path:
        """The API server's audit log (JSON lines; see :data:`AUDIT_POLICY`); rotated files are
        ``audit-<time>.log`` beside it."""
        return self.audit_dir / "audit.log"

    def audit_events(self) -> list[dict[str, Any]]:
        """Every event of the audit log, the rotated files' included, in no particular order (a
        line the API server is still writing, not yet ended, is left out)."""
        events = []
        for log in sorted(self.audit_dir.glob("audit*.log")):
            whole, _, _ = log.read_text().rpartition("\n")
            events += [json.loads(line) for line in whole.splitlines() if line.strip()]
        return events

    def admin_credentials(self) -> Credentials:
        return Credentials(self.server, self.pki.ca.cert, client=self.pki.admin())

    def admin(self) -> KubeClient:
        """A client with cluster-admin rights (group system:masters)."""
        return KubeClient(self.admin_credentials())

    def start(self, detached: bool = False) -> ControlPlane:
        """Starts etcd, the API server, then the controller manager and the scheduler; waits for
        each to be healthy. Raises :class:`~spotrl_e2e.procs.StartupError` with the failing
        server's log tail."""
        self.tools.require("etcd", "kube_apiserver", "kube_controller_manager", "kube_scheduler", "kubectl")
        t0 = time.monotonic()
        try:
            self._start_etcd(detached)
            self.startup_seconds["etcd"] = time.monotonic() - t0
            self._start_apiserver(detached)
            self.startup_seconds["kube-apiserver"] = time.monotonic() - t0
            self._start_controllers(detached)
            self.startup_seconds["controllers"] = time.monotonic() - t0
        except BaseException:
            self.stop()
            raise
        self._write_state()
        return self

    def _start_etcd(self, detached: bool) -> None:
        self.ports.etcd, self.ports.etcd_peer = free_port(), free_port()
        client = f"http://127.0.0.1:{self.ports.etcd}"
        peer = f"http://127.0.0.1:{self.ports.etcd_peer}"
        argv = [
            self.tools.etcd,
            "--name=spotrl",
            f"--data-dir={self.workdir / 'etcd-data'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=spotrl={peer}",
            # Test data: no fsync, and nothing needs to survive a crash of the machine.
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]
        proc = Process("etcd", argv, self.workdir).start(detached)
        self.processes.append(proc)
        import urllib3

        def healthy() -> bool:
            body = urllib3.request("GET", f"{client}/health", timeout=2, retries=False).data
            return bool(json.loads(body).get("health") == "true")

        proc.wait_ready(healthy, 20, "healthy (GET /health)")

    def _start_apiserver(self, detached: bool) -> None:
        pki = self.pki
        serving, kubelet_client = pki.apiserver(), pki.apiserver_kubelet_client()
        self.ports.apiserver = free_port()
        t = self.timings
        self.audit_dir.mkdir(parents=True, exist_ok=True)
        policy = self.audit_dir / "policy.json"
        policy.write_text(json.dumps(AUDIT_POLICY, indent=1))
        argv = [
            self.tools.kube_apiserver,
            f"--etcd-servers=http://127.0.0.1:{self.ports.etcd}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--secure-port={self.ports.apiserver}",
            f"--tls-cert-file={serving.cert}",
            f"--tls-private-key-file={serving.key}",
            f"--client-ca-file={pki.ca.cert}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki.sa_pub}",
            f"--service-account-signing-key-file={pki.sa_key}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=" + ",".join(ADMISSION_PLUGINS),
            # MutatingAdmissionPolicy, beta and off in 1.35 (on in 1.36): the chart's records
            # the default credentials Secret on each RLJob as it is written.
            "--feature-gates=MutatingAdmissionPolicy=true",
            "--runtime-config=admissionregistration.k8s.io/v1beta1=true",
            f"--default-not-ready-toleration-seconds={t.default_toleration_seconds}",
            f"--default-unreachable-toleration-seconds={t.default_toleration_seconds}",
            f"--kubelet-client-certificate={kubelet_client.cert}",
            f"--kubelet-client-key={kubelet_client.key}",
            f"--kubelet-certificate-authority={pki.ca.cert}",
            "--kubelet-preferred-address-types=InternalIP",
            "--allow-privileged=true",
            # The `kubernetes` Service cannot point at a loopback address; nothing here needs it.
            "--endpoint-reconciler-type=none",
            "--profiling=false",
            "--event-ttl=1h",
            f"--cert-dir={self.workdir / 'apiserver-certs'}",
            f"--audit-policy-file={policy}",
            f"--audit-log-path={self.audit_log}",
            "--audit-log-format=json",
            f"--audit-log-maxsize={AUDIT_LOG_MAX_MB}",
            "--audit-log-maxbackup=1",
        ]
        proc = Process("kube-apiserver", argv, self.workdir).start(detached)
        self.processes.append(proc)
        admin = self.admin()

        def ready() -> bool:
            return admin.request("GET", "/readyz", timeout=3) is not None

        proc.wait_ready(ready, 60, "ready (GET /readyz)")
        write_kubeconfig(self.admin_kubeconfig, self.server, pki.ca.cert, "spotrl-admin", client=pki.admin())

    def _start_controllers(self, detached: bool) -> None:
        pki = self.pki
        kcm_kubeconfig = write_kubeconfig(
            self.workdir / "kube-controller-manager.kubeconfig",
            self.server,
            pki.ca.cert,
            "system:kube-controller-manager",
            client=pki.controller_manager(),
        )
        sched_kubeconfig = write_kubeconfig(
            self.workdir / "kube-scheduler.kubeconfig",
            self.server,
            pki.ca.cert,
            "system:kube-scheduler",
            client=pki.scheduler(),
        )
        self.ports.controller_manager, self.ports.scheduler = free_port(), free_port()
        kcm_serving = pki.issue(
            "kube-controller-manager-serving", "kube-controller-manager", ips=("127.0.0.1",), server=True
        )
        sched_serving = pki.issue("kube-scheduler-serving", "kube-scheduler", ips=("127.0.0.1",), server=True)
        t = self.timings
        kcm_argv = [
            self.tools.kube_controller_manager,
            f"--kubeconfig={kcm_kubeconfig}",
            f"--authentication-kubeconfig={kcm_kubeconfig}",
            f"--authorization-kubeconfig={kcm_kubeconfig}",
            # Our CA for client certificates; no front proxy, so no lookup of its CA in the cluster.
            f"--client-ca-file={pki.ca.cert}",
            "--authentication-skip-lookup=true",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports.controller_manager}",
            f"--tls-cert-file={kcm_serving.cert}",
            f"--tls-private-key-file={kcm_serving.key}",
            "--leader-elect=false",
            "--controllers=" + ",".join(CONTROLLERS),
            # Each controller authenticates as its own service account, so RBAC applies to it.
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki.sa_key}",
            f"--root-ca-file={pki.ca.cert}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            "--node-monitor-period=1s",
            f"--node-monitor-grace-period={t.node_monitor_grace_period}s",
            f"--node-startup-grace-period={t.node_monitor_grace_period}s",
            # Taint several lost nodes at once, not one every 10 s.
            "--node-eviction-rate=10",
            "--profiling=false",
        ]
        sched_argv = [
            self.tools.kube_scheduler,
            f"--kubeconfig={sched_kubeconfig}",
            f"--authentication-kubeconfig={sched_kubeconfig}",
            f"--authorization-kubeconfig={sched_kubeconfig}",
            # Our CA for client certificates; no front proxy, so no lookup of its CA in the cluster.
            f"--client-ca-file={pki.ca.cert}",
            "--authentication-skip-lookup=true",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports.scheduler}",
            f"--tls-cert-file={sched_serving.cert}",
            f"--tls-private-key-file={sched_serving.key}",
            "--leader-elect=false",
            "--profiling=false",
        ]
        kcm = Process("kube-controller-manager", kcm_argv, self.workdir).start(detached)
        sched = Process("kube-scheduler", sched_argv, self.workdir).start(detached)
        self.processes += [kcm, sched]
        admin = self.admin()
        for proc, port in ((kcm, self.ports.controller_manager), (sched, self.ports.scheduler)):
            url = f"https://127.0.0.1:{port}/healthz"  # checked against our CA; open to any client
            proc.wait_ready(_get_ok(admin, url), 30, f"healthy (GET {url})")
        # The service-account controller makes `default` in every namespace; pods wait for it.
        admin.wait_for(
            "/api/v1/namespaces/default/serviceaccounts/default", lambda o: o is not None, 30, "ServiceAccount default"
        )

    def _write_state(self) -> None:
        state = {"server": self.server, "ports": self.ports.__dict__, "kubeconfig": str(self.admin_kubeconfig)}
        (self.workdir / "controlplane.json").write_text(json.dumps(state, indent=1))

    def stop(self) -> None:
        """Stops every server, the last started first."""
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()


def _get_ok(client: KubeClient, url: str) -> Callable[[], bool]:
    return lambda: client.request("GET", url) is not None
