"""The real operator on the test cluster, as the tests run it.

- :func:`install_operator_identity`: the chart's own ServiceAccount and RBAC (rendered by
  ``helm template``, applied as they are) in a fresh namespace, its admission policy on the
  operator's own writes, and a kubeconfig with a token of that ServiceAccount; so every
  operator test runs with exactly the permissions the chart grants, and none it refuses.
- :class:`OperatorProcess`: ``python -m spotrl_operator`` as a subprocess of the test
  (its log in a file, killable with any signal), started and waited for until it leads
  (or stands by).
- :class:`Jobs`: create RLJobs, wait on their status, delete them (and wait for the
  operator's finalizer) afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from spotrl_e2e.cluster import Cluster
from spotrl_e2e.kube import ApiError, Credentials, KubeClient, path
from spotrl_e2e.procs import Process, free_port

Obj = dict[str, Any]
REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "spotrl"
CRD = REPO / "crds" / "rljobs.spotrl.dev.yaml"
RLJOBS = "spotrl.dev/v1alpha1"
RELEASE = "spotrl"  # the chart's objects are then named "spotrl"
# A node selector no node matches: the operator's controller pod is created and stays Pending.
NOWHERE = {"spotrl.dev/test-placement": "nowhere"}


def apply_crd(cluster: Cluster) -> None:
    """The generated CRD, applied, and served (see :meth:`KubeCluster.install_crd`)."""
    cluster.install_crd(CRD)


def helm(cluster: Cluster, *args: str, timeout: float = 120) -> str:
    """Runs the pinned helm as the cluster admin; raises with its output on failure."""
    out = subprocess.run(
        [str(cluster.tools.helm), *args],
        env={"KUBECONFIG": str(cluster.kubeconfig), "HOME": str(cluster.workdir), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if out.returncode != 0:
        raise RuntimeError(f"helm {' '.join(args)} exited {out.returncode}:\n{out.stdout}{out.stderr}")
    return out.stdout


def render_chart(cluster: Cluster, namespace: str, *sets: str, only: tuple[str, ...] = ()) -> list[Obj]:
    args = ["template", RELEASE, str(CHART), "--namespace", namespace, "--kube-version", "1.35.4"]
    for s in sets:
        args += ["--set", s]
    for template in only:
        args += ["--show-only", template]
    return [d for d in yaml.safe_load_all(helm(cluster, *args)) if d]


def token_kubeconfig(cluster: Cluster, namespace: str, service_account: str, file: Path) -> Path:
    """A kubeconfig with a fresh token (TokenRequest) of the ServiceAccount."""
    token = cluster.kubectl("create", "token", service_account, "-n", namespace, "--duration=2h").stdout.strip()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "test", "cluster": {"server": cluster.server, "certificate-authority": str(cluster.ca)}}],
        "users": [{"name": service_account, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "test", "user": service_account, "namespace": namespace}}],
        "current-context": "sa",
    }
    file.write_text(yaml.safe_dump(config))
    return file


def service_account_client(cluster: Cluster, namespace: str, service_account: str) -> KubeClient:
    token = cluster.kubectl("create", "token", service_account, "-n", namespace, "--duration=1h").stdout.strip()
    return KubeClient(Credentials(cluster.server, cluster.ca, token=token))


def install_operator_identity(cluster: Cluster, namespace: str, workdir: Path, *sets: str) -> Path:
    """The chart's ServiceAccount, its two ClusterRoles (the jobs' namespaces, and Nodes) bound
    cluster-wide, the leader Role(Binding) in ``namespace``, and the admission policy that holds
    the operator's writes to what SpotRL made (cluster-wide, one at a time: each module's
    replaces the last); returns a kubeconfig that authenticates as that ServiceAccount.
    ``sets``: chart values (``kueue.enabled=true``)."""
    only = ("templates/serviceaccount.yaml", "templates/rbac.yaml", "templates/operatorpolicy.yaml")
    docs = render_chart(cluster, namespace, *sets, only=only)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ClusterRole",
        "ClusterRole",
        "ClusterRoleBinding",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ServiceAccount",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ], kinds
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
    wait_operator_policy(service_account_client(cluster, namespace, RELEASE), namespace)
    return token_kubeconfig(cluster, namespace, RELEASE, workdir / f"operator-{namespace}.kubeconfig")


OPERATOR_POLICY_SAYS = "the SpotRL operator writes only objects SpotRL makes for RLJobs"


def wait_operator_policy(operator: KubeClient, namespace: str, timeout: float = 30) -> None:
    """Until the operator's admission policy is in force (the API server loads a policy, and a
    change of its binding, asynchronously): a ServiceAccount SpotRL did not make, sent by the
    operator's own client (``operator``) as a dry run, is refused."""

    def refused() -> bool:
        sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "policy-probe"}}
        try:
            operator.create(path("v1", "serviceaccounts", namespace), sa, dryRun="All")
        except ApiError as err:
            return err.status == 403 and OPERATOR_POLICY_SAYS in err.message
        return False

    wait_until(refused, timeout, "the operator's admission policy in force")


class OperatorProcess:
    """``python -m spotrl_operator`` with the chart's identity, logging to ``<workdir>/<name>.log``."""

    def __init__(
        self,
        cluster: Cluster,
        kubeconfig: Path,
        lease_namespace: str,
        workdir: Path,
        name: str = "operator",
        args: tuple[str, ...] = (),
        lease_seconds: float = 4.0,
        source: Path | None = None,
        env: dict[str, str] | None = None,
    ):
        """``source``: a checkout of another commit whose operator runs instead of this one's
        (its ``operator/`` and ``runtime/`` come first on the path; the dependencies are this venv's).
        ``env``: variables added to the process's environment."""
        self.cluster = cluster
        self.name = f"{name}-{uuid.uuid4().hex[:4]}"
        self.metrics_port = free_port()
        argv = [
            sys.executable,
            "-m",
            "spotrl_operator",
            "--kubeconfig",
            str(kubeconfig),
            "--lease-name",
            RELEASE,
            "--lease-namespace",
            lease_namespace,
            "--lease-seconds",
            str(lease_seconds),
            "--identity",
            self.name,
            "--metrics-address",
            "127.0.0.1",
            "--metrics-port",
            str(self.metrics_port),
            "--reconcile-interval",
            "1",
            # Compressed like the control plane's own timings: a silent node is Unknown in 10 s
            # and its pods tolerate that for 5 s (real clusters: 40-50 s and 300 s). The grace
            # stays below the toleration, as 30 s is below 300 s, so a lost node's controller is
            # force-deleted by the operator (NodeLost), not evicted by the taint manager first.
            "--node-lost-seconds",
            "2",
            *args,
        ]
        added = dict(env or {})
        if source is not None:
            added["PYTHONPATH"] = os.pathsep.join(str(source / d) for d in ("operator", "runtime"))
        self.process = Process(self.name, argv, workdir, env={**os.environ, **added} if added else None)

    def start(self, wait: str | None = "lead", timeout: float = 30) -> OperatorProcess:
        """Starts it; ``wait``: "lead" (until Kopf runs), "standby", or None."""
        self.process.start()
        if wait == "lead":
            self.process.wait_ready(lambda: "ready: running RLJobs" in self.log(), timeout, "leading and ready")
        elif wait == "standby":
            self.process.wait_ready(lambda: "standing by" in self.log(), timeout, "standing by")
        return self

    def log(self) -> str:
        return self.process.log.read_text(errors="replace") if self.process.log.exists() else ""

    def running(self) -> bool:
        return self.process.exit_code() is None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` to the operator and waits for it to exit."""
        assert self.process.popen is not None
        self.process.popen.send_signal(sig)
        self.process.popen.wait(30)

    def stop(self) -> None:
        self.process.stop(timeout=20)

    def metrics(self) -> dict[str, float]:
        """Its Prometheus samples (name{labels} → value)."""
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out


def tiny_job(name: str, **spec_overrides: Any) -> Obj:
    """A small valid RLJob; nested overrides merge into the spec's sections."""
    spec: Obj = {
        "policy": {"model": "builtin:tiny-arith"},
        "dataset": {"uri": "builtin:arithmetic"},
        "reward": {"name": "arithmetic_exact"},
        "generation": {"groupSize": 4, "promptsPerStep": 4, "maxNewTokens": 3},
        "training": {"totalSteps": 20, "microBatchSize": 16},
        "checkpoint": {"everySteps": 5, "barrierDeadlineSeconds": 20},
    }
    for key, value in spec_overrides.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return {"apiVersion": RLJOBS, "kind": "RLJob", "metadata": {"name": name}, "spec": spec}


class Jobs:
    """RLJobs of one test in one namespace (deleted, and waited for, at the end)."""

    def __init__(self, cluster: Cluster, namespace: str):
        self.cluster = cluster
        self.ns = namespace
        self.admin = cluster.admin()
        self.names: list[str] = []

    def url(self, name: str | None = None, sub: str | None = None) -> str:
        return path(RLJOBS, "rljobs", self.ns, name, sub)

    def create(self, job: Obj) -> Obj:
        self.names.append(job["metadata"]["name"])
        return self.admin.create(self.url(), job)

    def get(self, name: str) -> Obj | None:
        return self.admin.get_or_none(self.url(name))

    def status(self, name: str) -> Obj:
        return (self.get(name) or {}).get("status") or {}

    def wait(self, name: str, check: Callable[[Obj], bool], timeout: float, what: str) -> Obj:
        """Waits until ``check(status)`` holds; returns that status."""
        job = self.admin.wait_for(
            self.url(name), lambda o: o is not None and check(o.get("status") or {}), timeout, what
        )
        assert job is not None
        return dict(job.get("status") or {})

    def patch_spec(self, name: str, spec: Obj) -> None:
        self.admin.patch(self.url(name), {"spec": spec})

    def patch_status(self, name: str, status: Obj) -> Obj:
        return self.admin.patch(self.url(name, "status"), {"status": status})

    def events(self, name: str) -> list[Obj]:
        """Events about the RLJob, oldest first."""
        items = self.admin.get(
            path("v1", "events", self.ns), fieldSelector=f"involvedObject.kind=RLJob,involvedObject.name={name}"
        )["items"]
        return sorted(items, key=lambda e: (e.get("firstTimestamp") or "", e["metadata"]["name"]))

    def reasons(self, name: str) -> list[str]:
        return [e["reason"] for e in self.events(name)]

    def said(self, name: str, wanted: set[str], timeout: float = 10) -> set[str]:
        """Waits until the job's Events include every reason in ``wanted``; returns all reasons.
        The operator posts a pass's Events right after that pass's status write, so a test that
        has just seen the status can read the Events a moment before they exist."""
        found: set[str] = set()

        def enough() -> bool:
            found.clear()
            found.update(self.reasons(name))
            return wanted <= found

        try:
            wait_until(enough, timeout, f"the Events {sorted(wanted)}")
        except TimeoutError as err:
            raise AssertionError(f"{err}; the job's Events say {sorted(found)}") from None
        return set(found)

    def barrier_commit(self, name: str, timeout: float) -> tuple[str, str]:
        """``(cutId, committedAt)`` of the job's first barrier cut, once it committed. ``status.barrier``
        shows the commit only until the operator starts the next attempt, which it does as soon
        as it acts on it (the old pod need not exit first), so this reads what stays: the
        ``BarrierCommitted`` Event and the operator's recovery marks (``status.recovering``,
        later ``status.lastRecovery``)."""
        found: list[tuple[str, str]] = []

        def committed() -> bool:
            said = [e["message"] for e in self.events(name) if e["reason"] == "BarrierCommitted"]
            st = self.status(name)
            barrier = st.get("barrier") or {}
            answered = barrier if barrier.get("state") == "Committed" else {}
            marks = [answered, st.get("recovering"), st.get("lastRecovery")]
            at = next((m["committedAt"] for m in marks if m and m.get("committedAt")), None)
            if said and at:
                found.append((said[-1].rsplit(" committed cut ", 1)[1], at))
            return bool(found)

        wait_until(committed, timeout, f"{name}'s barrier cut to commit")
        return found[-1]

    def delete(self, name: str, timeout: float = 60) -> None:
        """Deletes the RLJob and waits until the operator's finalizer let it go."""
        self.admin.delete(self.url(name))
        self.admin.wait_for(self.url(name), lambda o: o is None, timeout, f"RLJob {self.ns}/{name} gone")

    def cleanup(self) -> None:
        for name in self.names:
            with suppress(ApiError):
                self.delete(name, timeout=60)

    def pods(self, name: str) -> list[Obj]:
        items = self.admin.get(path("v1", "pods", self.ns), labelSelector=f"spotrl.dev/job={name}")["items"]
        return sorted(items, key=lambda p: p["metadata"]["name"])


def events_of_reason(jobs: Jobs, name: str, reason: str) -> list[Obj]:
    return [e for e in jobs.events(name) if e["reason"] == reason]


def wait_until(check: Callable[[], bool], timeout: float, what: str, interval: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def lease_holder(cluster: Cluster, namespace: str) -> str | None:
    lease = cluster.admin().get_or_none(path("coordination.k8s.io/v1", "leases", namespace, RELEASE))
    return ((lease or {}).get("spec") or {}).get("holderIdentity")


def describe(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)[-4000:]


# ----------------------------------------------------------------------------- the e2e target

TARGET = os.environ.get("SPOTRL_E2E_TARGET", "local")
"""local: the test control plane; kind: a kind cluster made by e2e/kind/run.sh."""


@dataclass(frozen=True)
class JobStorage:
    """A fresh bucket an RLJob writes its cuts to, seen from the pods and from the test."""

    bucket: str
    pod_endpoint: str
    """The S3 endpoint as the job's pods reach it."""
    host_endpoint: str
    """The S3 endpoint as this test process reaches it."""
    access_key: str
    secret_key: str
    region: str = "us-east-1"

    def uri(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"

    def client(self) -> Any:
        """A boto3 S3 client for this bucket, from the test process."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.host_endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}),
        )

    def keys(self, prefix: str) -> list[str]:
        """Every key under ``prefix``, sorted."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents") or [])

    def secret(self, name: str = "s3") -> dict:
        """A Secret with the keys, for spec.checkpoint.credentialsSecret."""
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name},
            "stringData": {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key},
        }


def kind_bucket() -> JobStorage:
    """A fresh bucket on the kind cluster's S3 server (the one run.sh started)."""
    host = os.environ["SPOTRL_E2E_S3_HOST_ENDPOINT"]
    keys = os.environ["SPOTRL_E2E_S3_ACCESS_KEY"], os.environ["SPOTRL_E2E_S3_SECRET_KEY"]
    storage = JobStorage(f"e2e-{uuid.uuid4().hex[:12]}", os.environ["SPOTRL_E2E_S3_POD_ENDPOINT"], host, *keys)
    storage.client().create_bucket(Bucket=storage.bucket)
    return storage


def condition_of(jobs: Jobs, name: str, ctype: str) -> dict[str, Any] | None:
    """The RLJob's condition of type ``ctype``, or None."""
    conds = jobs.status(name).get("conditions") or []
    return next((c for c in conds if c["type"] == ctype), None)


class NoCuts:
    """A Controllable that is never asked for a barrier: a bridge started for status alone."""

    def request_barrier(self, reason: str, deadline: Any) -> Any:
        from spotrl_runtime.controller.control import BarrierFailed

        raise BarrierFailed("not in this test")


def runtime_bridge(cluster: Cluster, namespace: str, job: str, tmp_path: Path) -> Any:
    """The real KubeBridge of attempt 1 of ``job``, as its controller pod would run it: with the
    job's runtime ServiceAccount, no controller behind it (:class:`NoCuts`). Stop it after."""
    from kubernetes import config

    from spotrl_runtime.controller.kube_bridge import KubeBridge

    kubeconfig = token_kubeconfig(cluster, namespace, f"{job}-runtime", tmp_path / f"{job}-runtime.kubeconfig")
    client = config.new_client_from_config(config_file=str(kubeconfig))
    return KubeBridge(job, namespace, 1, api_client=client).start(NoCuts())
