"""The Helm chart: lint, a server-side dry run of what it renders, and a real install whose
operator (a pod of the test cluster, with the chart's ServiceAccount and RBAC) runs an RLJob
that trains, with the real `spotrl controller`, to its end."""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from operator_harness import (
    CHART,
    NOWHERE,
    OPERATOR_POLICY_SAYS,
    REPO,
    RLJOBS,
    Jobs,
    JobStorage,
    OperatorProcess,
    apply_crd,
    helm,
    service_account_client,
    tiny_job,
    token_kubeconfig,
    wait_operator_policy,
    wait_until,
)
from test_preemption import SPOT, TRAIN_TIMEOUT
from test_preemption import tiny_job as example_job

from spotrl_e2e.cluster import Cluster
from spotrl_e2e.docs import command_lines, marked_block
from spotrl_e2e.kube import ApiError, path
from spotrl_e2e.tools import find_tools
from spotrl_operator import resources
from spotrl_operator.resources import JobRef
from spotrl_operator.settings import Settings, add_arguments, from_args

pytestmark = pytest.mark.cluster
RELEASE = "spotrl-chart"
# What the test control plane serves (Kubernetes 1.35 with the beta API on), helm template is told.
MUTATING_POLICY = "admissionregistration.k8s.io/v1beta1/MutatingAdmissionPolicy"
UPGRADE_PAGE = Path("docs/operations/upgrading.md")
PENDING = {"scheduling": {"nodeSelector": NOWHERE}}


def render(
    cluster: Cluster, namespace: str, *sets: str, release: str = RELEASE, api_versions: tuple[str, ...] = ()
) -> list[dict]:
    """``helm template`` of the chart; ``api_versions``: what the API server serves beyond
    helm's defaults (as ``helm install`` would discover)."""
    args = ["template", release, str(CHART), "--namespace", namespace, "--kube-version", "1.35.4", "--include-crds"]
    args += [f"--api-versions={v}" for v in api_versions]
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


def test_helm_refuses_a_value_the_chart_does_not_have_or_of_the_wrong_type(tmp_path: Path) -> None:
    """values.schema.json as the pinned helm applies it (no cluster needed): template and lint
    refuse a misspelt nested key and a mistyped value, naming where. Every level and every
    value: tests/unit/test_chart_values_schema.py."""
    tools = find_tools()
    tools.require("helm")

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
        return subprocess.run(
            [str(tools.helm), *args], env=env, capture_output=True, text=True, timeout=60, check=False
        )

    template = ["template", RELEASE, str(CHART), "--kube-version", "1.35.4"]
    assert run(*template, "--set", "leaderElection.leaseSeconds=5").returncode == 0
    refused = {
        "leaderElection.leaseSecs=5": ("/leaderElection", "'leaseSecs' not allowed"),
        "signals.deadlineCaps.karpentr=60": ("/signals/deadlineCaps", "'karpentr' not allowed"),
        "replicas=two": ("/replicas", "got string, want integer"),
        "storage=s3://bucket": ("/storage", "got string, want object"),
    }
    for value, (where, says) in refused.items():
        out = run(*template, "--set", value)
        assert out.returncode != 0, f"helm template --set {value} passed"
        assert f"at '{where}'" in out.stderr, (value, out.stderr)
        assert says in out.stderr, (value, out.stderr)
    lint = run("lint", str(CHART), "--strict", "--set", "leaderElection.leaseSecs=5")
    assert lint.returncode != 0, lint.stdout
    assert "at '/leaderElection': additional properties 'leaseSecs' not allowed" in lint.stdout, lint.stdout


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
        "runtimeEnvLocked[0]=HF_HOME",
    )
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == [
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "Deployment",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Role",
        "Role",
        "RoleBinding",
        "RoleBinding",
        "Service",
        "ServiceAccount",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "ValidatingAdmissionPolicyBinding",
    ]
    # The operator never reads a Secret (retentionPolicy Delete runs a pod that does).
    assert "secrets" not in json.dumps([d["rules"] for d in docs if d["kind"] in ("ClusterRole", "Role")])
    # With watchNamespaces the operator's rights are a Role in each of those namespaces, and
    # nothing cluster-wide but reading Nodes.
    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    (cluster_binding,) = [d for d in docs if d["kind"] == "ClusterRoleBinding"]
    assert cluster_binding["roleRef"]["name"] == cluster_role["metadata"]["name"] == f"{RELEASE}-nodes"
    assert cluster_role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}]
    roles = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs if d["kind"] == "Role"}
    jobs_role = roles[(namespace, RELEASE)]
    assert {
        "apiGroups": [""],
        "resources": ["serviceaccounts"],
        "verbs": ["get", "list", "watch", "create", "patch", "delete"],
    } in jobs_role["rules"]
    assert "nodes" not in str(jobs_role["rules"])
    bindings = {d["metadata"]["name"]: d for d in docs if d["kind"] == "RoleBinding"}
    assert bindings[RELEASE]["metadata"]["namespace"] == namespace
    assert bindings[RELEASE]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": RELEASE}
    args = operator_args(docs)
    for flag in (
        "--default-storage=s3://bucket-x/root",
        "--default-s3-endpoint=http://minio:9000",
        "--default-credentials-secret=s3",
        "--extra-taint-key=example.com/going-away",
        "--deadline-cap=karpenter=60",
        "--deadline-cap=gke=20",
        f"--namespace={namespace}",
        "--refused-namespace=kube-system",
        f"--refused-namespace={namespace}",
        "--runtime-env=HF_HOME=/cache",
        "--runtime-env-locked=HF_HOME",
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
        "allowSystemNamespaces=true",
    )
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"PodDisruptionBudget", "NetworkPolicy", "ValidatingAdmissionPolicy"}, kinds
    assert "--no-network-policy" in operator_args(docs)
    assert "--allowed-images=registry.example.com/ml/" in operator_args(docs)
    assert not [a for a in operator_args(docs) if a.startswith("--refused-namespace")]
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
        assert container["envFrom"] == [{"secretRef": {"name": "s3"}}]
        # The operator's record of that default, a write the admission policy lets through.
        admin.wait_for(
            f"{jobs_url}/tiny",
            lambda o: (o or {})["metadata"].get("annotations", {}).get(resources.DEFAULT_SECRET_ANNOTATION) == "s3",
            30,
            "the default Secret recorded on the job",
        )
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


def _grant(cluster: Cluster, namespace: str, subject: dict[str, str], rules: list[dict[str, Any]]) -> None:
    """A Role of ``rules`` in ``namespace``, bound to ``subject``."""
    rbac = "rbac.authorization.k8s.io/v1"
    admin, name = cluster.admin(), subject["name"]
    admin.create(
        path(rbac, "roles", namespace), {"apiVersion": rbac, "kind": "Role", "metadata": {"name": name}, "rules": rules}
    )
    binding = {
        "apiVersion": rbac,
        "kind": "RoleBinding",
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [subject],
    }
    admin.create(path(rbac, "rolebindings", namespace), binding)


def test_the_admission_policy_checks_what_a_jobs_pods_would_read_on_every_write(
    cluster: Cluster, namespace: str
) -> None:
    """Whoever can write an RLJob must not borrow the operator's rights: the job's pods read the
    Secrets and ConfigMaps it names (the chart's default Secret when it names none), with its
    reward and its dataset, and run the image it names. The policy checks the writer's own
    rights (a SubjectAccessReview through CEL's authorizer) on every create and update, the
    operator's own writes excepted, and refuses a runtimeEnv name the admin locked. Where the
    API server serves MutatingAdmissionPolicy, the default Secret is recorded on the job as it is
    written, so the one checked is the one its pods mount whatever the operator's default."""
    apply_crd(cluster)
    # A release name of its own: the installed-chart test's policy (cluster-scoped, same
    # name) may still be in the API server's cache for a moment after its uninstall.
    release = "spotrl-vap"
    sets = ("imagePolicy.allowedImages[0]=registry.example.com/ml/", "storage.credentialsSecret=shared")
    docs = render(
        cluster, namespace, *sets, "runtimeEnvLocked[0]=HTTPS_PROXY", release=release, api_versions=(MUTATING_POLICY,)
    )
    policy = [
        d
        for d in docs
        if d["kind"].startswith("MutatingAdmissionPolicy")
        or (d["kind"].startswith("ValidatingAdmissionPolicy") and d["metadata"]["name"].endswith("-rljobs"))
    ]
    assert len(policy) == 4
    admin = cluster.admin()
    for name in ("mine", "theirs", "shared"):
        admin.create(
            path("v1", "secrets", namespace),
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": {"k": "v"}},
        )
    writes = ["get", "create", "update", "patch"]
    user = {"apiGroup": "rbac.authorization.k8s.io", "kind": "User"}
    # alice may write RLJobs and read the Secret "mine" and the ConfigMap "mine"; bob may write
    # RLJobs and read the chart's default Secret "shared", and write their status. Neither may
    # read the other's Secret.
    jobs_rule = {"apiGroups": ["spotrl.dev"], "resources": ["rljobs"], "verbs": writes}
    _grant(cluster, namespace, {**user, "name": "alice"}, [
        jobs_rule,
        {"apiGroups": [""], "resources": ["secrets", "configmaps"], "resourceNames": ["mine"], "verbs": ["get"]},
    ])  # fmt: skip
    _grant(cluster, namespace, {**user, "name": "bob"}, [
        jobs_rule,
        {"apiGroups": ["spotrl.dev"], "resources": ["rljobs/status"], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["shared"], "verbs": ["get"]},
    ])  # fmt: skip
    # The chart's operator account (this release's), with no right on any Secret.
    operator = {"kind": "ServiceAccount", "name": release, "namespace": namespace}
    _grant(cluster, namespace, operator, [{**jobs_rule, "resources": ["rljobs", "rljobs/status"]}])
    as_operator = f"system:serviceaccount:{namespace}:{release}"
    jobs = path(RLJOBS, "rljobs", namespace)
    mine = {"storage": "s3://bucket-x/j", "credentialsSecret": "mine"}

    def run(who: str, *argv: str, input: str | None = None) -> tuple[int, str]:
        r = cluster.kubectl(*argv, "-n", namespace, f"--as={who}", input=input, check=False)
        return r.returncode, r.stderr

    def manifest(name: str, recorded: str | None = None, **spec: Any) -> str:
        job = tiny_job(name, **{"checkpoint": mine, **spec})
        annotations = {} if recorded is None else {resources.DEFAULT_SECRET_ANNOTATION: recorded}
        return yaml.safe_dump({**job, "metadata": {"name": name, "namespace": namespace, "annotations": annotations}})

    def create(name: str, who: str = "alice", **spec: Any) -> tuple[int, str]:
        """``who`` creates the job (by default naming the Secret "mine")."""
        return run(who, "create", "-f", "-", input=manifest(name, **spec))

    def recorded_default(name: str) -> str | None:
        annotations = admin.get(f"{jobs}/{name}")["metadata"].get("annotations") or {}
        return annotations.get(resources.DEFAULT_SECRET_ANNOTATION)

    def patch(who: str, name: str, spec: dict[str, Any]) -> tuple[int, str]:
        return run(who, "patch", "rljob", name, "--type=merge", "-p", json.dumps({"spec": spec}))

    def env(name: str, source: str, ref: str, key: str = "k") -> dict[str, Any]:
        return {"runtimeEnv": [{"name": name, "valueFrom": {source: {"name": ref, "key": key}}}]}

    theirs = {"storage": "s3://bucket-x/j", "credentialsSecret": "theirs"}
    try:
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(policy))
        # The policy is in force once its first refusal is seen and an image it allows passes:
        # the API server loads policies asynchronously, and drops a deleted one the same way.
        probes = iter(range(1000))

        def in_force() -> bool:
            refused = "credentialsSecret" in create(f"probe-{next(probes)}", checkpoint=theirs)[1]
            allowed = f"probe-{next(probes)}"
            if create(allowed, scheduling={"image": "registry.example.com/ml/probe:1"})[0] != 0:
                return False
            return refused and recorded_default(allowed) == "shared"

        wait_until(in_force, 30, "the policy in force")

        # The Secret a job names.
        rc, err = create("steal", checkpoint=theirs)
        assert rc != 0
        assert "spec.checkpoint.credentialsSecret: alice may not get Secret" in err, err
        assert admin.get_or_none(f"{jobs}/steal") is None, "half-applied"
        assert create("own")[0] == 0

        # The chart's default Secret, which the pods of a job that names none read.
        rc, err = create("defaulted", checkpoint={"storage": "s3://bucket-x/j"})
        assert rc != 0
        assert (
            f"spec.checkpoint.credentialsSecret is not set, so the job's pods would read the cluster's default "
            f"Secret {namespace}/shared (chart value storage.credentialsSecret, or the one recorded in the job's "
            f"annotation {resources.DEFAULT_SECRET_ANNOTATION}), and alice may not get it"
        ) in err, err
        assert admin.get_or_none(f"{jobs}/defaulted") is None, "half-applied"
        rc, err = create("bobs", who="bob", checkpoint={"storage": "s3://bucket-x/j"})
        assert rc == 0, err
        # Recorded as it was written (no operator runs here): the Secret the policy checked.
        assert recorded_default("bobs") == "shared"
        # The default the operator recorded on a job is the one its pods keep mounting, checked
        # in place of the chart's; taking the record off is checked against the chart's.
        recorded = {"checkpoint": {"storage": "s3://bucket-x/j"}}
        rc, err = run("alice", "create", "-f", "-", input=manifest("recorded", recorded="mine", **recorded))
        assert rc == 0, err
        rc, err = run("alice", "create", "-f", "-", input=manifest("recorded-theirs", recorded="theirs", **recorded))
        assert rc != 0
        assert f"default Secret {namespace}/theirs" in err, err
        rc, err = run("alice", "annotate", "rljob", "recorded", f"{resources.DEFAULT_SECRET_ANNOTATION}-")
        assert rc != 0
        assert f"default Secret {namespace}/shared" in err, err
        rc, err = run("bob", "annotate", "rljob", "recorded", f"{resources.DEFAULT_SECRET_ANNOTATION}-")
        assert rc == 0, err
        assert recorded_default("recorded") == "shared"

        # A Secret's or ConfigMap's key in spec.runtimeEnv reaches the pods' environment too.
        rc, err = create("env-steal", **env("HF_TOKEN", "secretKeyRef", "theirs"))
        assert rc != 0
        assert f"spec.runtimeEnv: alice may not get every Secret it names ({namespace}/theirs)" in err, err
        assert admin.get_or_none(f"{jobs}/env-steal") is None, "half-applied"
        assert create("env-own", **env("HF_TOKEN", "secretKeyRef", "mine"))[0] == 0
        rc, err = create("cm-steal", **env("HF_ENDPOINT", "configMapKeyRef", "theirs"))
        assert rc != 0
        assert f"spec.runtimeEnv: alice may not get every ConfigMap it names ({namespace}/theirs)" in err, err
        assert create("cm-own", **env("HF_ENDPOINT", "configMapKeyRef", "mine"))[0] == 0

        # A name the admin locked, refused naming it; any other name is the job's.
        rc, err = create("proxy", runtimeEnv=[{"name": "HTTPS_PROXY", "value": "http://mine:8080"}])
        assert rc != 0
        assert "spec.runtimeEnv: HTTPS_PROXY locked by the cluster admin (chart value runtimeEnvLocked)" in err, err
        assert create("cache", runtimeEnv=[{"name": "HF_HOME", "value": "/cache"}])[0] == 0

        rc, err = create("image", scheduling={"image": "docker.io/attacker/miner:1"})
        assert rc != 0
        assert "spec.scheduling.image docker.io/attacker/miner:1 is not allowed" in err, err
        assert "imagePolicy.allowedImages" in err
        assert create("image-ok", scheduling={"image": "registry.example.com/ml/policy:3"})[0] == 0

        # bob may update alice's job but not read her Secret: any change of his is refused (the
        # key her pods read, the reward and the dataset that run with it, a label), not only
        # one that names a new Secret. alice's own changes, by kubectl apply, still pass.
        rc, err = run("alice", "apply", "-f", "-", input=manifest("alices", **env("HF_TOKEN", "secretKeyRef", "mine")))
        assert rc == 0, err
        stored = admin.get(f"{jobs}/alices")
        for spec in (
            env("HF_TOKEN", "secretKeyRef", "mine", key="other"),
            {"reward": {"name": None, "importPath": "probe:leaks"}},
            {"dataset": {"uri": "s3://bucket-x/probe"}},
        ):
            rc, err = patch("bob", "alices", spec)
            assert rc != 0, spec
            assert f"spec.checkpoint.credentialsSecret: bob may not get Secret {namespace}/mine" in err, err
        # The same for a Secret in runtimeEnv alone (the job mounts the default, which bob may read).
        admin.create(
            jobs, tiny_job("env-only", checkpoint={"storage": "s3://bucket-x/j"}, **env("T", "secretKeyRef", "mine"))
        )
        rc, err = patch("bob", "env-only", {"dataset": {"uri": "s3://bucket-x/probe"}})
        assert rc != 0
        assert f"spec.runtimeEnv: bob may not get every Secret it names ({namespace}/mine)" in err, err
        rc, err = run("bob", "label", "rljob", "alices", "team=b")
        assert rc != 0
        assert "bob may not get Secret" in err, err
        assert admin.get(f"{jobs}/alices")["metadata"]["resourceVersion"] == stored["metadata"]["resourceVersion"]
        changed = manifest(
            "alices", reward={"name": None, "importPath": "probe:leaks"}, **env("HF_TOKEN", "secretKeyRef", "mine")
        )
        rc, err = run("alice", "apply", "-f", "-", input=changed)
        assert rc == 0, err
        assert admin.get(f"{jobs}/alices")["spec"]["reward"]["importPath"] == "probe:leaks"
        # The same both ways: alice may not touch bob's job, which mounts the default Secret.
        rc, err = run("alice", "label", "rljob", "bobs", "team=a")
        assert rc != 0
        assert f"Secret {namespace}/shared" in err, err
        # A status write is no update of the job (the policy does not see it): the API server
        # keeps spec and metadata as they were.
        write = {"metadata": {"labels": {"team": "b"}}, "spec": {"dataset": {"uri": "s3://bucket-x/probe"}}}
        rc, err = run(
            "bob", "patch", "rljob", "alices", "--subresource=status", "--type=merge", "-p", json.dumps(write)
        )
        assert rc == 0, err
        after = admin.get(f"{jobs}/alices")
        assert after["spec"]["dataset"]["uri"] == "builtin:arithmetic"
        assert "team" not in (after["metadata"].get("labels") or {})

        # The operator, which may read no Secret, writes finalizers, annotations and status.
        for argv in (
            ["patch", "rljob", "alices", "--type=merge", "-p", '{"metadata": {"finalizers": ["spotrl.dev/test"]}}'],
            ["annotate", "rljob", "alices", "kopf.zalando.org/last-handled-configuration=x"],
            ["patch", "rljob", "alices", "--type=json", "-p", '[{"op": "remove", "path": "/metadata/finalizers"}]'],
            ["patch", "rljob", "alices", "--subresource=status", "--type=merge", "-p", '{"status": {"step": 1}}'],
        ):
            rc, err = run(as_operator, *argv)
            assert rc == 0, (argv, err)
    finally:
        cluster.kubectl("delete", "-f", "-", "--ignore-not-found", input=yaml.safe_dump_all(policy), check=False)


def precondition(obj: dict) -> dict:
    """DeleteOptions that delete ``obj`` only, not another made under its name since."""
    return {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": obj["metadata"]["uid"]}}


def test_the_operators_own_writes_are_held_to_what_spotrl_made(
    cluster: Cluster, namespace: str, operator_identity: tuple[str, Path]
) -> None:
    """RBAC lets the operator write ServiceAccounts (and pods, Roles...) anywhere it is bound; the
    chart's policy on its own ServiceAccount refuses what SpotRL did not make: a create or an
    update without SpotRL's labels and an RLJob owner, a change or deletion of someone else's
    object, anything in kube-system or the operator's namespace. The same writes of SpotRL's
    own objects pass (the operator's whole lifecycle runs under this policy: install_operator_identity)."""
    operator_ns, _ = operator_identity
    operator = service_account_client(cluster, operator_ns, "spotrl")
    wait_operator_policy(operator, namespace)
    admin = cluster.admin()
    job = admin.create(path(RLJOBS, "rljobs", namespace), tiny_job("web"))
    ref = JobRef("web", namespace, job["metadata"]["uid"])
    accounts = path("v1", "serviceaccounts", namespace)

    def refused(call: Callable[[], object], says: str) -> None:
        with pytest.raises(ApiError) as info:
            call()
        assert info.value.status == 403, info.value
        assert says in info.value.message, info.value.message

    theirs = admin.create(accounts, {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "web-runtime"}})
    url = f"{accounts}/web-runtime"
    changes = "the SpotRL operator changes and deletes only objects SpotRL made, and ServiceAccount"
    refused(lambda: operator.patch(url, {"metadata": {"ownerReferences": None}}), changes)
    refused(lambda: operator.delete(url), changes)
    refused(lambda: operator.delete(url, precondition(theirs)), changes)
    after = admin.get(url)
    assert after["metadata"]["resourceVersion"] == theirs["metadata"]["resourceVersion"], "changed"
    # Labelled as SpotRL's but made by someone else and owned by no RLJob: still not SpotRL's.
    fake = {"metadata": {"labels": resources.instance_labels("web")}}
    refused(lambda: operator.patch(url, fake), changes)
    admin.delete(url)

    writes = OPERATOR_POLICY_SAYS
    unlabelled = resources.service_account(ref, Settings())
    unlabelled["metadata"]["labels"] = {}
    refused(lambda: operator.create(accounts, unlabelled), writes)
    unowned = resources.service_account(ref, Settings())
    del unowned["metadata"]["ownerReferences"]
    refused(lambda: operator.create(accounts, unowned), writes)
    elsewhere = resources.service_account(JobRef("web", "kube-system", ref.uid), Settings())
    refused(
        lambda: operator.create(path("v1", "serviceaccounts", "kube-system"), elsewhere),
        "the SpotRL operator makes nothing in namespace kube-system",
    )
    about_a_pod = resources.event(
        {"name": "web", "namespace": namespace, "uid": ref.uid}, "Normal", "Probe", "x", "2026-01-01T00:00:00Z", "op"
    )
    about_a_pod["involvedObject"] = {"apiVersion": "v1", "kind": "Pod", "name": "web", "namespace": namespace}
    refused(lambda: operator.create(path("v1", "events", namespace), about_a_pod), writes)

    # SpotRL's own: made, changed as the keyless deletion pod holds it, and deleted (by uid).
    mine = operator.create(accounts, resources.service_account(ref, Settings()))
    kept = resources.retention_service_account(ref, Settings())
    operator.patch(url, {"metadata": {"ownerReferences": None, "labels": kept["metadata"]["labels"]}})
    assert operator.delete(url, precondition(mine)) is not None
    operator.create(accounts, kept)  # made again after a foreground deletion took it
    operator.delete(url)
    event = resources.event(
        {"name": "web", "namespace": namespace, "uid": ref.uid}, "Normal", "Probe", "x", "2026-01-01T00:00:00Z", "op"
    )
    operator.create(path("v1", "events", namespace), event)


def test_with_watch_namespaces_the_operator_runs_jobs_on_roles_and_refuses_its_own_namespace(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    """watchNamespaces: the operator holds Roles in those namespaces (no ClusterRole but reading
    Nodes) and runs a job there on them alone; a job in its own namespace (watched here, so the
    refusal is the operator's, not RBAC's) fails, says why, and gets nothing made there."""
    apply_crd(cluster)
    release, release_ns = "spotrl-watch", cluster.create_namespace("spotrl-watch")
    sets = ["--set", f"watchNamespaces[0]={namespace}", "--set", f"watchNamespaces[1]={release_ns}"]
    only = ["--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac.yaml"]
    out = helm(cluster, "template", release, str(CHART), "-n", release_ns, "--kube-version", "1.35.4", *sets, *only)
    docs = [d for d in yaml.safe_load_all(out) if d]
    assert [d["metadata"]["name"] for d in docs if d["kind"].startswith("Cluster")] == [f"{release}-nodes"] * 2
    admin = cluster.admin()
    jobs, own = Jobs(cluster, namespace), Jobs(cluster, release_ns)
    op = None
    try:
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
        kubeconfig = token_kubeconfig(cluster, release_ns, release, tmp_path / "operator.kubeconfig")
        args = ("--lease-name", release, "--namespace", namespace, "--namespace", release_ns)
        refused = ("--refused-namespace", "kube-system", "--refused-namespace", release_ns)  # as the chart's
        op = OperatorProcess(cluster, kubeconfig, release_ns, tmp_path, args=(*args, *refused)).start()
        jobs.create(tiny_job("tiny", checkpoint={"storage": "s3://bucket-x/tiny"}, **PENDING))
        jobs.wait("tiny", lambda s: s.get("attempt") == 1, 30, "the job started in a watched namespace")
        pod = admin.wait_for(path("v1", "pods", namespace, "tiny-controller-1"), lambda o: o is not None, 20, "pod")
        assert pod is not None
        assert admin.get_or_none(path("v1", "serviceaccounts", namespace, "tiny-runtime")) is not None

        own.create(tiny_job("mine", checkpoint={"storage": "s3://bucket-x/mine"}, **PENDING))
        st = own.wait("mine", lambda s: s.get("phase") == "Failed", 30, "the job in the operator's namespace refused")
        (cond,) = [c for c in st["conditions"] if c["type"] == "Failed"]
        assert cond["reason"] == "InvalidConfiguration"
        assert f"runs no RLJob in namespace {release_ns}" in cond["message"], cond
        assert "allowSystemNamespaces" in cond["message"]
        assert "Failed" in own.reasons("mine")
        assert admin.get_or_none(path("v1", "serviceaccounts", release_ns, "mine-runtime")) is None
        assert own.pods("mine") == []
        own.delete("mine")
    finally:
        jobs.cleanup()
        own.cleanup()
        if op is not None:
            op.stop()
        cluster.kubectl("delete", "--ignore-not-found", "-f", "-", input=yaml.safe_dump_all(docs), check=False)
        cluster.delete_namespace(release_ns)
