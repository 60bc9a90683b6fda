"""The Helm chart: lint, a server-side dry run of what it renders, and a real install whose
operator (a pod of the test cluster, with the chart's ServiceAccount and RBAC) runs an RLJob
that trains, with the real `spotrl controller`, to its end."""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_harness import CHART, REPO, RLJOBS, JobStorage, apply_crd, helm, tiny_job, wait_until
from test_preemption import SPOT, TRAIN_TIMEOUT
from test_preemption import tiny_job as example_job

from spotrl_e2e.cluster import Cluster
from spotrl_e2e.docs import command_lines, marked_block
from spotrl_e2e.kube import path
from spotrl_operator.settings import add_arguments, from_args

pytestmark = pytest.mark.cluster
RELEASE = "spotrl-chart"
UPGRADE_PAGE = Path("docs/operations/upgrading.md")


def render(cluster: Cluster, namespace: str, *sets: str, release: str = RELEASE) -> list[dict]:
    args = ["template", release, str(CHART), "--namespace", namespace, "--kube-version", "1.35.4", "--include-crds"]
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
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Role",
        "RoleBinding",
        "RoleBinding",
        "Service",
        "ServiceAccount",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    ]
    # The operator never reads a Secret (retentionPolicy Delete runs a pod that does).
    assert "secrets" not in json.dumps([d["rules"] for d in docs if d["kind"] in ("ClusterRole", "Role")])
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
        "--controller-requests=cpu=500m,memory=4Gi",
        "--worker-requests=cpu=500m,memory=2Gi",
        "--allowed-images=spotrl-runtime-cpu:,spotrl-runtime-cpu@",
        "--retention-image=spotrl-operator:0.1.0",
        "--runtime-do-not-disrupt",
        "--no-runtime-safe-to-evict",
        '--metrics-from=[{"namespaceSelector":{}}]',
    ):
        assert flag in args, f"{flag} missing from {args}"
    dry = cluster.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump_all(docs), check=False)
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.count("(server dry run)") == len(docs)

    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    affinity = deploy["spec"]["template"]["spec"]["affinity"]
    assert (
        affinity["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"][
            "topologyKey"
        ]
        == "kubernetes.io/hostname"
    ), "two replicas on one node go on one notice"
    prefer = affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"]
    assert {"key": "karpenter.sh/capacity-type", "operator": "NotIn", "values": ["spot"]} in prefer["matchExpressions"]
    (pdb,) = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert pdb["spec"]["minAvailable"] == 1

    # Switches: no Lease RBAC without leader election, no PDB with one replica, no policies.
    docs = render(
        cluster,
        namespace,
        "leaderElection.enabled=false",
        "replicas=1",
        "networkPolicy.enabled=false",
        "admissionPolicy.enabled=false",
        "imagePolicy.allowedImages[0]=registry.example.com/ml/",
    )
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"PodDisruptionBudget", "NetworkPolicy", "ValidatingAdmissionPolicy"}, kinds
    assert "--no-network-policy" in operator_args(docs)
    assert "--allowed-images=registry.example.com/ml/" in operator_args(docs)
    # Every namespace: both roles bound cluster-wide.
    assert sorted(d["roleRef"]["name"] for d in docs if d["kind"] == "ClusterRoleBinding") == [
        f"{RELEASE}",
        f"{RELEASE}-nodes",
    ]
    assert "Role" not in [d["kind"] for d in docs]
    assert "--no-leader-election" in operator_args(docs)


def test_the_charts_cloud_values_reach_the_operators_settings(cluster: Cluster, namespace: str) -> None:
    """The values a cloud setup needs (a workload identity on the jobs' ServiceAccounts, a pod
    label for it, consolidation allowed) are flags the operator parses into its settings."""
    role = "arn:aws:iam::111122223333:role/spotrl"
    docs = render(
        cluster,
        namespace,
        "runtimePods.doNotDisrupt=false",
        "runtimePods.safeToEvict=true",
        "runtimePods.labels.azure\\.workload\\.identity/use=true",
        "runtimePods.annotations.example\\.com/team=rl",
        f"runtimeServiceAccount.annotations.eks\\.amazonaws\\.com/role-arn={role}",
    )
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = from_args(parser.parse_args(operator_args(docs)))
    assert settings.runtime_do_not_disrupt is False
    assert settings.runtime_safe_to_evict is True
    assert settings.runtime_pod_labels == {"azure.workload.identity/use": "true"}
    assert settings.runtime_pod_annotations == {"example.com/team": "rl"}
    assert settings.runtime_service_account_annotations == {"eks.amazonaws.com/role-arn": role}
    defaults = from_args(parser.parse_args(operator_args(render(cluster, namespace))))
    assert (defaults.runtime_do_not_disrupt, defaults.runtime_safe_to_evict) == (True, False), "on by default"


def upgrade_commands(release_ns: str) -> list[list[str]]:
    """The upgrade block of the upgrading guide, its release (name and namespace) this test's."""
    block = marked_block((REPO / UPGRADE_PAGE).read_text(), UPGRADE_PAGE, "<!-- upgrade:begin -->")
    commands = [shlex.split(line.replace("spotrl-system", release_ns)) for line in command_lines(block)]
    assert [c[:2] for c in commands] == [["kubectl", "apply"], ["helm", "upgrade"]], commands
    commands[1][2] = RELEASE
    return [[str(REPO / a) if a.startswith("charts/") else a for a in c] for c in commands]


def test_the_installed_chart_runs_an_rljob(cluster: Cluster, namespace: str, e2e_storage: JobStorage) -> None:
    """The chart's operator, installed as a user would, trains a real RLJob to the end (the
    tiny example, on a spot node, three steps) with its cuts and audit where the chart's storage
    defaults say: the storage, the S3 endpoint and the credentials Secret come from the
    chart's values, not from the job."""
    apply_crd(cluster)
    bucket = e2e_storage.bucket
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
            f"storage.default=s3://{bucket}/root",
            "--set",
            f"storage.s3Endpoint={e2e_storage.pod_endpoint}",
            "--set",
            "storage.credentialsSecret=s3",
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
        assert not can("get", "secrets", namespace), "the operator reads no Secret, not even a job's"
        assert not can("list", "secrets", namespace)
        assert can("create", "networkpolicies.networking.k8s.io", namespace)
        assert can("watch", "nodes", None)

        def holder() -> str | None:
            lease = admin.get_or_none(path("coordination.k8s.io/v1", "leases", release_ns, RELEASE))
            return ((lease or {}).get("spec") or {}).get("holderIdentity")

        wait_until(lambda: holder() in names, 30, "one replica to hold the lease")
        leader = holder()
        (leader_pod,) = [p for p in pods if p["metadata"]["name"] == leader]

        jobs_url = path(RLJOBS, "rljobs", namespace)
        admin.create(path("v1", "secrets", namespace), e2e_storage.secret())
        job = example_job("tiny", e2e_storage, SPOT)
        job["spec"]["training"]["totalSteps"] = 3
        for key in ("storage", "s3Endpoint", "credentialsSecret"):  # the chart's defaults, then
            del job["spec"]["checkpoint"][key]
        admin.create(jobs_url, job)
        pod = admin.wait_for(path("v1", "pods", namespace, "tiny-controller-1"), lambda o: o is not None, 60, "pod")
        assert pod is not None
        (container,) = pod["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        root = f"root/{namespace}/tiny"
        assert env["SPOTRL_STORAGE"] == f"s3://{bucket}/{root}", "storage.default reaches the pods"
        assert container["image"] == "spotrl-runtime-cpu:0.1.0", "what `make images` builds"
        done = admin.wait_for(
            f"{jobs_url}/tiny",
            lambda o: ((o or {}).get("status") or {}).get("phase") in ("Succeeded", "Failed"),
            TRAIN_TIMEOUT,
            "the chart's operator to run the job to its end",
        )
        assert done is not None
        st = done["status"]
        assert (st["phase"], st["step"], st["attempt"]) == ("Succeeded", 3, 1), json.dumps(st, indent=1)
        keys = e2e_storage.keys(f"{root}/")
        trained = [k for k in keys if k.startswith(f"{root}/audit/step-")]
        assert len(trained) == 3, f"the steps audited under the chart's default storage: {keys}"
        assert f"{root}/cuts/{st['lastCut']['id']}/manifest.json" in keys, st["lastCut"]

        with urllib.request.urlopen(f"http://{leader_pod['status']['podIP']}:9400/metrics", timeout=5) as r:
            metrics = r.read().decode()
        assert "spotrl_operator_leader 1.0" in metrics
        with urllib.request.urlopen(f"http://{leader_pod['status']['podIP']}:9400/healthz", timeout=5) as r:
            assert r.read() == b"ok\n", "the liveness probe's endpoint: the event loop beats"

        # The documented upgrade, as written: the CRD by server-side apply, then helm upgrade.
        for argv in upgrade_commands(release_ns):
            if argv[0] == "kubectl":
                cluster.kubectl(*argv[1:])
            else:
                helm(cluster, *argv[1:], timeout=180)
        assert "STATUS: deployed" in helm(cluster, "status", RELEASE, "--namespace", release_ns)
        assert "REVISION: 2" in helm(cluster, "status", RELEASE, "--namespace", release_ns)
        wait_until(lambda: holder() is not None, 60, "a replica to lead after the upgrade")

        admin.delete(f"{jobs_url}/tiny")
        admin.wait_for(f"{jobs_url}/tiny", lambda o: o is None, 60, "the RLJob deleted through the finalizer")
    finally:
        url = path(RLJOBS, "rljobs", namespace, "tiny")
        if admin.delete(url) is not None:  # a failed test: let the operator finalize it first
            with contextlib.suppress(TimeoutError):
                admin.wait_for(url, lambda o: o is None, 30, "the RLJob gone")
        out = helm(cluster, "uninstall", RELEASE, "--namespace", release_ns, "--wait", "--timeout", "60s")
        assert "uninstalled" in out

        # The Deployment is gone; its pods go through the garbage collector, a moment later.
        def running() -> list[dict[str, Any]]:
            pods = admin.get(path("v1", "pods", release_ns))["items"]
            return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

        with contextlib.suppress(TimeoutError):
            wait_until(lambda: not running(), 30, "the operator's pods deleted")
        assert running() == [], json.dumps(running())[:500]
        cluster.delete_namespace(release_ns)


def test_the_admission_policy_refuses_a_secret_the_author_cannot_read_and_an_image_not_allowed(
    cluster: Cluster, namespace: str
) -> None:
    """Whoever can create an RLJob must not borrow the operator's rights: the job's pods would
    read the Secret it names, and run the image it names. The policy checks the author's own
    rights (a SubjectAccessReview through CEL's authorizer) at admission."""
    apply_crd(cluster)
    # A release name of its own: the installed-chart test's policy (cluster-scoped, same
    # name) may still be in the API server's cache for a moment after its uninstall.
    docs = render(cluster, namespace, "imagePolicy.allowedImages[0]=registry.example.com/ml/", release="spotrl-vap")
    policy = [d for d in docs if d["kind"].startswith("ValidatingAdmissionPolicy")]
    assert len(policy) == 2
    admin = cluster.admin()
    for name in ("mine", "theirs"):
        admin.create(
            path("v1", "secrets", namespace),
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": {"k": "v"}},
        )
    # alice may write RLJobs in the namespace and read the Secret "mine", nothing more.
    rbac = "rbac.authorization.k8s.io/v1"
    admin.create(
        path(rbac, "roles", namespace),
        {
            "apiVersion": rbac,
            "kind": "Role",
            "metadata": {"name": "alice"},
            "rules": [
                {"apiGroups": ["spotrl.dev"], "resources": ["rljobs"], "verbs": ["get", "create", "update", "patch"]},
                {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["mine"], "verbs": ["get"]},
            ],
        },
    )
    admin.create(
        path(rbac, "rolebindings", namespace),
        {
            "apiVersion": rbac,
            "kind": "RoleBinding",
            "metadata": {"name": "alice"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "alice"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "alice"}],
        },
    )
    try:
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(policy))

        def create(name: str, **spec: dict) -> tuple[int, str]:
            job = {**tiny_job(name, **spec), "metadata": {"name": name, "namespace": namespace}}
            r = cluster.kubectl("create", "-f", "-", "--as=alice", input=yaml.safe_dump(job), check=False)
            return r.returncode, r.stderr

        theirs = {"checkpoint": {"storage": "s3://bucket-x/j", "credentialsSecret": "theirs"}}
        # The policy is in force once its first refusal is seen and an image it allows passes:
        # the API server loads policies asynchronously, and drops a deleted one the same way.
        probes = iter(range(1000))

        def in_force() -> bool:
            refused = "credentialsSecret" in create(f"probe-{next(probes)}", **theirs)[1]
            allowed = create(f"probe-{next(probes)}", scheduling={"image": "registry.example.com/ml/probe:1"})[0] == 0
            return refused and allowed

        wait_until(in_force, 30, "the policy in force")
        rc, err = create("steal", **theirs)
        assert rc != 0
        assert "spec.checkpoint.credentialsSecret" in err, err
        assert "alice may not get Secret" in err, err
        assert admin.get_or_none(path(RLJOBS, "rljobs", namespace, "steal")) is None, "half-applied"

        rc, err = create("own", checkpoint={"storage": "s3://bucket-x/j", "credentialsSecret": "mine"})
        assert rc == 0, err

        # A Secret in spec.runtimeEnv reaches the pods' environment just as well.
        def env_from(secret: str) -> dict:
            return {"runtimeEnv": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": "k"}}}]}

        rc, err = create("env-steal", **env_from("theirs"))
        assert rc != 0
        assert f"spec.runtimeEnv: alice may not get every Secret it names ({namespace}/theirs)" in err, err
        assert admin.get_or_none(path(RLJOBS, "rljobs", namespace, "env-steal")) is None, "half-applied"
        rc, err = create("env-own", **env_from("mine"))
        assert rc == 0, err
        rc, err = create("image", scheduling={"image": "docker.io/attacker/miner:1"})
        assert rc != 0
        assert "spec.scheduling.image docker.io/attacker/miner:1 is not allowed" in err, err
        assert "imagePolicy.allowedImages" in err
        rc, err = create("image-ok", scheduling={"image": "registry.example.com/ml/policy:3"})
        assert rc == 0, err

        # An update that leaves the Secret as it is passes, whoever writes it: the operator
        # (which may read no Secret) patches finalizers and annotations of every RLJob.
        admin.create(path(RLJOBS, "rljobs", namespace), tiny_job("admins", **theirs))
        r = cluster.kubectl("label", "rljob", "admins", "team=a", "-n", namespace, "--as=alice", check=False)
        assert r.returncode == 0, r.stderr
        r = cluster.kubectl(
            "patch", "rljob", "admins", "-n", namespace, "--as=alice", "--type=merge",
            "-p", '{"spec": {"scheduling": {"image": "docker.io/attacker/miner:1"}}}', check=False,
        )  # fmt: skip
        assert r.returncode != 0
        assert "is not allowed" in r.stderr, r.stderr
    finally:
        cluster.kubectl("delete", "-f", "-", "--ignore-not-found", input=yaml.safe_dump_all(policy), check=False)
