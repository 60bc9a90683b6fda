"""The Helm chart: lint, a server-side dry run of what it renders, and a real install whose
operator (a pod of the test cluster, with the chart's ServiceAccount and RBAC) runs an RLJob."""

from __future__ import annotations

import contextlib
import json
import urllib.request

import pytest
import yaml
from operator_harness import CHART, NOWHERE, RLJOBS, apply_crd, helm, tiny_job, wait_until

from spotrl_e2e.cluster import Cluster
from spotrl_e2e.kube import path

pytestmark = pytest.mark.cluster
RELEASE = "spotrl-chart"


def render(cluster: Cluster, namespace: str, *sets: str) -> list[dict]:
    args = ["template", RELEASE, str(CHART), "--namespace", namespace, "--kube-version", "1.35.4", "--include-crds"]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(cluster, *args)) if d]


def operator_args(docs: list[dict]) -> list[str]:
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["spotrl", "operator"]
    # Service links would set SPOTRL_METRICS_PORT=tcp://... from the chart's own Service.
    assert deploy["spec"]["template"]["spec"]["enableServiceLinks"] is False
    return list(container["args"])


def test_the_chart_lints_and_its_objects_pass_a_server_side_dry_run(cluster: Cluster, namespace: str) -> None:
    out = helm(cluster, "lint", str(CHART), "--strict")
    assert "0 chart(s) failed" in out

    docs = render(
        cluster,
        namespace,
        "storage.default=s3://bucket-x/root",
        "storage.s3Endpoint=http://minio:9000",
        "storage.credentialsSecret=s3",
        "signals.extraTaintKeys[0]=example.com/going-away",
        "signals.deadlineCaps.karpenter=60",
        f"watchNamespaces[0]={namespace}",
        "runtimeEnv.HF_HOME=/cache",
    )
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ClusterRole",
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "Deployment",
        "Role",
        "RoleBinding",
        "RoleBinding",
        "Service",
        "ServiceAccount",
    ]
    # With watchNamespaces the operator's rights hold in those namespaces only; Nodes alone are
    # read cluster-wide.
    roles = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ClusterRole"}
    (cluster_binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    assert cluster_binding["roleRef"]["name"].endswith("-nodes")
    assert roles[cluster_binding["roleRef"]["name"]]["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}
    ]
    (jobs_binding,) = [d for d in docs if d["kind"] == "RoleBinding" and d["roleRef"]["kind"] == "ClusterRole"]
    assert jobs_binding["metadata"]["namespace"] == namespace
    assert not jobs_binding["roleRef"]["name"].endswith("-nodes")
    assert "nodes" not in str(roles[jobs_binding["roleRef"]["name"]]["rules"])
    args = operator_args(docs)
    for flag in (
        "--default-storage=s3://bucket-x/root",
        "--default-s3-endpoint=http://minio:9000",
        "--default-credentials-secret=s3",
        "--extra-taint-key=example.com/going-away",
        "--deadline-cap=karpenter=60",
        "--deadline-cap=gke=20",
        f"--namespace={namespace}",
        "--runtime-env=HF_HOME=/cache",
        f"--lease-name={RELEASE}",
    ):
        assert flag in args, f"{flag} missing from {args}"
    dry = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(docs), check=False)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.count("(server dry run)") == len(docs)

    # Switches: no Secrets without readSecrets, no Lease RBAC without leader election.
    docs = render(cluster, namespace, "rbac.readSecrets=false", "leaderElection.enabled=false", "replicas=1")
    assert all("secrets" not in r["resources"] for d in docs if d["kind"] == "ClusterRole" for r in d["rules"])
    # Every namespace: both roles bound cluster-wide.
    assert sorted(d["roleRef"]["name"] for d in docs if d["kind"] == "ClusterRoleBinding") == [
        f"{RELEASE}",
        f"{RELEASE}-nodes",
    ]
    assert "Role" not in [d["kind"] for d in docs]
    assert "--no-leader-election" in operator_args(docs)


def test_the_installed_chart_runs_an_rljob(cluster: Cluster, namespace: str) -> None:
    apply_crd(cluster)
    release_ns = cluster.create_namespace("spotrl-chart")
    admin = cluster.admin()
    try:
        helm(
            cluster,
            "install",
            RELEASE,
            str(CHART),
            "--namespace",
            release_ns,
            "--set",
            "replicas=2",
            "--set",
            "leaderElection.leaseSeconds=4",
            "--set",
            "nodeSelector.karpenter\\.sh/capacity-type=on-demand",
            "--set",
            "storage.default=s3://bucket-x/root",
            "--set",
            f"watchNamespaces[0]={namespace}",
            "--wait",
            "--timeout",
            "90s",
        )
        pods = admin.get(path("v1", "pods", release_ns), labelSelector="app.kubernetes.io/component=operator")["items"]
        assert len(pods) == 2
        assert {p["spec"]["nodeName"] for p in pods} == {"ondemand-a"}
        names = {p["metadata"]["name"] for p in pods}
        # watchNamespaces: the operator may act in the job's namespace and nowhere else.
        account = f"system:serviceaccount:{release_ns}:{pods[0]['spec']['serviceAccountName']}"

        def can(verb: str, resource: str, ns: str | None) -> bool:
            where = ["-n", ns] if ns else []
            out = cluster.kubectl("auth", "can-i", verb, resource, *where, f"--as={account}", check=False)
            return out.stdout.strip() == "yes"

        assert can("create", "pods", namespace)
        assert can("patch", "rljobs.spotrl.dev/status", namespace)
        assert not can("create", "pods", "default")
        assert not can("get", "secrets", "default")
        assert can("watch", "nodes", None)

        def holder() -> str | None:
            lease = admin.get_or_none(path("coordination.k8s.io/v1", "leases", release_ns, RELEASE))
            return ((lease or {}).get("spec") or {}).get("holderIdentity")

        wait_until(lambda: holder() in names, 30, "one replica to hold the lease")
        leader = holder()
        (leader_pod,) = [p for p in pods if p["metadata"]["name"] == leader]

        jobs_url = path(RLJOBS, "rljobs", namespace)
        admin.create(jobs_url, tiny_job("tiny", scheduling={"nodeSelector": NOWHERE}))
        job = admin.wait_for(
            f"{jobs_url}/tiny",
            lambda o: ((o or {}).get("status") or {}).get("attempt") == 1,
            60,
            "the chart's operator to start the job",
        )
        assert job is not None
        pod = admin.wait_for(path("v1", "pods", namespace, "tiny-controller-1"), lambda o: o is not None, 15, "pod")
        assert pod is not None
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert env["SPOTRL_STORAGE"] == f"s3://bucket-x/root/{namespace}/tiny", "storage.default reaches the pods"
        assert pod["spec"]["containers"][0]["image"] == "ghcr.io/spotrl/spotrl-runtime:0.1.0"

        with urllib.request.urlopen(f"http://{leader_pod['status']['podIP']}:9400/metrics", timeout=5) as r:
            metrics = r.read().decode()
        assert "spotrl_operator_leader 1.0" in metrics

        admin.delete(f"{jobs_url}/tiny")
        admin.wait_for(f"{jobs_url}/tiny", lambda o: o is None, 60, "the RLJob deleted through the finalizer")
    finally:
        url = path(RLJOBS, "rljobs", namespace, "tiny")
        if admin.delete(url) is not None:  # a failed test: let the operator finalize it first
            with contextlib.suppress(TimeoutError):
                admin.wait_for(url, lambda o: o is None, 30, "the RLJob gone")
        out = helm(cluster, "uninstall", RELEASE, "--namespace", release_ns, "--wait", "--timeout", "60s")
        assert "uninstalled" in out
        left = admin.get(path("v1", "pods", release_ns))["items"]
        assert [p for p in left if not p["metadata"].get("deletionTimestamp")] == [], json.dumps(left)[:500]
        cluster.delete_namespace(release_ns)
