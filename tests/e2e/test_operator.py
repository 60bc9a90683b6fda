"""The real operator (``python -m spotrl_operator`` with the chart's ServiceAccount and RBAC)
against the real API server, controllers and node agent, and the real S3 server.

These tests need no training controller: their controller pods are created but cannot be
scheduled (a node selector no node matches), or a barrier request is answered by the real
:class:`KubeBridge` running with the job's runtime ServiceAccount. The preemption paths
with the real `spotrl controller` are in ``test_preemption.py``.
"""

from __future__ import annotations

import base64
import logging
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from operator_harness import (
    NOWHERE,
    Jobs,
    OperatorProcess,
    lease_holder,
    service_account_client,
    tiny_job,
    token_kubeconfig,
    wait_until,
)

from spotrl_e2e.cluster import Cluster
from spotrl_e2e.kube import ApiError, path
from spotrl_e2e.s3 import S3Bucket
from spotrl_operator.actuate import Actuator, ConflictError
from spotrl_operator.resources import DEFAULT_SECRET_ANNOTATION
from spotrl_operator.settings import Settings
from spotrl_runtime.api.times import Deadline
from spotrl_runtime.controller.control import CutInfo
from spotrl_runtime.controller.kube_bridge import KubeBridge
from spotrl_runtime.kube import Kube

pytestmark = pytest.mark.cluster
PENDING = {"scheduling": {"nodeSelector": NOWHERE}}


def owned_by(obj: dict, uid: str) -> bool:
    refs = obj["metadata"].get("ownerReferences") or []
    return any(r["kind"] == "RLJob" and r["uid"] == uid and r.get("controller") for r in refs)


def test_children_are_owned_named_deterministically_and_collected(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs
) -> None:
    job = jobs.create(tiny_job("tiny", checkpoint={"storage": "s3://bucket-x/tiny"}, **PENDING))
    uid = job["metadata"]["uid"]
    st = jobs.wait("tiny", lambda s: s.get("attempt") == 1 and s.get("phase") == "Pending", 20, "attempt 1, Pending")
    assert st["totalSteps"] == 20
    assert st["preemptions"] == 0

    admin = cluster.admin()
    children = {
        path("v1", "serviceaccounts", namespace, "tiny-runtime"): "ServiceAccount",
        path("rbac.authorization.k8s.io/v1", "roles", namespace, "tiny-runtime"): "Role",
        path("rbac.authorization.k8s.io/v1", "rolebindings", namespace, "tiny-runtime"): "RoleBinding",
        path("v1", "services", namespace, "tiny"): "Service",
        path("policy/v1", "poddisruptionbudgets", namespace, "tiny-controller"): "PodDisruptionBudget",
        path("v1", "pods", namespace, "tiny-controller-1"): "Pod",
    }
    for url, kind in children.items():
        obj = admin.wait_for(url, lambda o: o is not None, 15, kind)
        assert obj is not None
        assert obj["kind"] == kind
        assert owned_by(obj, uid), f"{kind} lacks the RLJob as controlling owner: {obj['metadata']}"
    pdb = admin.get(path("policy/v1", "poddisruptionbudgets", namespace, "tiny-controller"))
    assert pdb["spec"]["minAvailable"] == 1, "closed until a cut commits"
    pod = admin.get(path("v1", "pods", namespace, "tiny-controller-1"))
    assert pod["spec"]["serviceAccountName"] == "tiny-runtime"
    assert pod["spec"]["containers"][0]["command"] == ["spotrl", "controller"]
    assert pod["metadata"]["labels"]["spotrl.dev/attempt"] == "1"
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env["SPOTRL_STORAGE"] == "s3://bucket-x/tiny"
    assert env["SPOTRL_ATTEMPT"] == "1"

    jobs.said("tiny", {"ControllerCreated", "Pending"})
    table = cluster.kubectl("get", "rljobs", "-n", namespace).stdout
    header, row = table.splitlines()[:2]
    assert header.split() == ["NAME", "PHASE", "STEP", "TOTAL", "LAST-CUT", "PREEMPTIONS", "ERROR", "AGE"]
    assert row.split()[:3] == ["tiny", "Pending", "20"]

    # Deleting the job: the finalizer stops the pod; garbage collection takes the rest. The
    # collector learns a new CRD's kind from discovery, which it refreshes every 30 s, so a
    # CRD applied moments ago can take up to that long before its children are collected.
    jobs.delete("tiny")
    for url, kind in children.items():
        admin.wait_for(url, lambda o: o is None, 90, f"{kind} garbage-collected")


def test_the_runtime_service_account_reads_its_rljob_and_patches_its_status_only(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs
) -> None:
    for name in ("a", "b"):
        jobs.create(tiny_job(name, checkpoint={"storage": f"s3://bucket-x/{name}"}, **PENDING))
    jobs.wait("a", lambda s: s.get("attempt") == 1, 20, "job a started")
    cluster.admin().wait_for(
        path("rbac.authorization.k8s.io/v1", "rolebindings", namespace, "a-runtime"), lambda o: o is not None, 15, "rb"
    )
    sa = service_account_client(cluster, namespace, "a-runtime")

    def code(fn: Callable[[], object]) -> int:
        try:
            fn()
        except ApiError as err:
            return err.status
        return 200

    own = jobs.url("a")
    allowed = {
        "get its RLJob": lambda: sa.get(own),
        "list its RLJob by name": lambda: sa.get(jobs.url(), fieldSelector="metadata.name=a"),
        "watch its RLJob by name": lambda: sa.get(
            jobs.url(), fieldSelector="metadata.name=a", watch="true", timeoutSeconds="1"
        ),
        "patch its status": lambda: sa.patch(f"{own}/status", {"status": {"step": 3}}),
        "get its status": lambda: sa.get(f"{own}/status"),
    }
    denied = {
        "list every RLJob": lambda: sa.get(jobs.url()),
        "get another RLJob": lambda: sa.get(jobs.url("b")),
        "patch another's status": lambda: sa.patch(f"{jobs.url('b')}/status", {"status": {"step": 3}}),
        "patch its spec": lambda: sa.patch(own, {"spec": {"suspend": True}}),
        "delete its RLJob": lambda: sa.delete(own),
        "create an RLJob": lambda: sa.create(jobs.url(), tiny_job("c")),
        "list pods": lambda: sa.get(path("v1", "pods", namespace)),
        "read a secret": lambda: sa.get(path("v1", "secrets", namespace, "anything")),
        "list nodes": lambda: sa.get(path("v1", "nodes")),
    }
    got = {what: code(fn) for what, fn in {**allowed, **denied}.items()}
    assert {w: got[w] for w in allowed} == dict.fromkeys(allowed, 200)
    assert {w: got[w] for w in denied} == dict.fromkeys(denied, 403)
    assert jobs.status("a")["step"] == 3


def test_an_invalid_rljob_is_rejected_with_the_field_named(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs
) -> None:
    import yaml

    cases = {
        "spec.training.totalSteps": tiny_job("bad1", training={"totalSteps": 0}),
        "spec.generation.kvCacheMemory": tiny_job("bad2", generation={"backend": "vllm", "kvCacheMemory": "lots"}),
        "sparePoolBatches": tiny_job("bad3", preemption={"onDroppedPrompt": "replace"}),
    }
    for field, doc in cases.items():
        out = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False)
        assert out.returncode != 0, f"{field}: accepted"
        assert field in out.stderr, f"{field} not named in: {out.stderr}"
    assert cluster.admin().get(jobs.url())["items"] == []
    assert cluster.admin().get(path("v1", "pods", namespace))["items"] == []


def put_job_files(s3: S3Bucket, prefix: str) -> dict[str, bytes]:
    files = {
        f"{prefix}/cuts/0000000001/manifest.json": b"{}",
        f"{prefix}/cuts/0000000001/w1-0a1b2c3d/ledger.json": b"[]",
        f"{prefix}/cuts/0000000002/w1-0a1b2c3d/policy.pt": b"torn",
        f"{prefix}/LATEST.json": b'{"cut": "0000000001"}',
        f"{prefix}/audit/0000000001.0001.json": b"{}",
        f"{prefix}/attempts/0000000001.json": b"{}",
    }
    client = s3.client()
    for key, data in files.items():
        client.put_object(Bucket=s3.bucket, Key=key, Body=data)
    return files


def keys(s3: S3Bucket) -> set[str]:
    pages = s3.client().get_paginator("list_objects_v2").paginate(Bucket=s3.bucket)
    return {o["Key"] for page in pages for o in page.get("Contents", [])}


def stuck(status: dict) -> dict | None:
    return next((c for c in status.get("conditions") or [] if c["type"] == "ReconcileError"), None)


def test_a_job_whose_pod_the_api_server_refuses_says_why_backs_off_and_recovers(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs
) -> None:
    """A priority class that does not exist passes the CRD and fails the pod's admission (403),
    a 4xx no retry of the same request fixes. The job says so at once (condition, Event,
    `kubectl get`), retries on failureBudget's doubling backoff, and starts once the class exists."""
    admin = cluster.admin()
    classes = path("scheduling.k8s.io/v1", "priorityclasses")
    missing = f"spotrl-e2e-{namespace[-6:]}"
    jobs.create(
        tiny_job(
            "stuck",
            checkpoint={"storage": "s3://bucket-x/stuck"},
            failureBudget={"backoffSeconds": 2, "maxBackoffSeconds": 8},
            scheduling={"nodeSelector": NOWHERE, "priorityClassName": missing},
        )
    )
    created = time.monotonic()
    # The first pass writes attempt 1, is refused the pod, and says so: one reconcile interval
    # (1 s here), plus the requests.
    st = jobs.wait("stuck", lambda s: stuck(s) is not None, 5, "the ReconcileError condition")
    seen_after = time.monotonic() - created
    cond = stuck(st)
    assert cond is not None
    assert (cond["status"], cond["reason"]) == ("True", "Forbidden")
    assert "creating pod stuck-controller-1 failed 1 time(s): HTTP 403" in cond["message"], cond["message"]
    assert missing in cond["message"], "the API server's own words"
    assert "cannot succeed until something changes" in cond["message"]
    assert st["attempt"] == 1, "the refused pod is tried again under the same attempt, not counted anew"

    table = cluster.kubectl("get", "rljobs", "stuck", "-n", namespace).stdout
    print(table)
    row = table.splitlines()[1].split()
    assert row[:2] == ["stuck", "Pending"]
    assert "Forbidden" in row, row
    described = cluster.kubectl("describe", "rljob", "stuck", "-n", namespace).stdout
    print(described)
    assert "ReconcileError" in described
    assert "ReconcileFailed" in described
    assert missing in described

    # Backoff: 2, 4, 8, 8 ... s between tries, not one a second.
    time.sleep(20)
    (event,) = [e for e in jobs.events("stuck") if e["reason"] == "ReconcileFailed"]
    tries = int(event.get("count") or 1)
    assert 3 <= tries <= 6, f"{tries} tries in {time.monotonic() - created:.0f} s"
    cond = stuck(jobs.status("stuck"))
    assert cond is not None
    assert f"failed {tries} time(s)" in cond["message"], (tries, cond["message"])
    assert "stuck-controller-1" not in [p["metadata"]["name"] for p in jobs.pods("stuck")]

    # The cluster admin creates the class: the next try (at most 8 s on) succeeds.
    admin.create(
        classes,
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", "metadata": {"name": missing}, "value": 10},
    )
    try:
        st = jobs.wait("stuck", lambda s: stuck(s) is None, 20, "the condition to go")
        assert [p["metadata"]["name"] for p in jobs.pods("stuck")] == ["stuck-controller-1"]
        # The Event follows the status write that took the condition away, so it may land a moment later.
        wait_until(lambda: "Reconciled" in jobs.reasons("stuck"), 10, "the Reconciled Event")
        assert (st["attempt"], st["restarts"]) == (1, 0), "a refused create is no crash"
        row = cluster.kubectl("get", "rljobs", "stuck", "-n", namespace, "--no-headers").stdout.split()
        assert "Forbidden" not in row
    finally:
        jobs.delete("stuck")
        admin.delete(f"{classes}/{missing}")
    print(f"condition seen {seen_after:.1f} s after the create; {tries} tries in the first 20 s")


@pytest.mark.parametrize("policy", ["Retain", "Delete"])
def test_deletion_applies_the_retention_policy_to_the_cuts(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs, s3_bucket: S3Bucket, policy: str
) -> None:
    cluster.admin().create(
        path("v1", "secrets", namespace),
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "s3"},
            "data": {
                "AWS_ACCESS_KEY_ID": base64.b64encode(s3_bucket.access_key.encode()).decode(),
                "AWS_SECRET_ACCESS_KEY": base64.b64encode(s3_bucket.secret_key.encode()).decode(),
            },
        },
    )
    root = f"jobs/{namespace}/tiny"
    job_files = put_job_files(s3_bucket, root)
    others = {f"{root}/notes/keep.txt", f"jobs/{namespace}/tiny-other/cuts/0000000001/manifest.json"}
    for key in others:
        s3_bucket.client().put_object(Bucket=s3_bucket.bucket, Key=key, Body=b"not the job's")
    checkpoint = {
        "storage": f"s3://{s3_bucket.bucket}/{root}",
        "s3Endpoint": s3_bucket.endpoint,
        "credentialsSecret": "s3",
        "retentionPolicy": policy,
    }
    jobs.create(tiny_job("tiny", checkpoint=checkpoint, **PENDING))
    jobs.wait("tiny", lambda s: s.get("attempt") == 1, 20, "started")

    jobs.delete("tiny", timeout=60)
    left = keys(s3_bucket)
    assert others <= left, "keys under the root that are not the job's stay"
    if policy == "Retain":
        assert set(job_files) <= left
    else:
        assert not set(job_files) & left, f"left behind: {sorted(set(job_files) & left)}"
    # The Event outlives the RLJob (kept by the API server for its TTL).
    events = cluster.admin().get(path("v1", "events", namespace), fieldSelector="involvedObject.name=tiny")["items"]
    reasons = {e["reason"]: e["message"] for e in events}
    if policy == "Retain":
        assert "s3://" in reasons["CutsRetained"]
    else:
        assert "removed 6 objects" in reasons["CutsDeleted"]
        # The deletion ran in a pod with the job's Secret (the operator may read none); it is gone.
        assert (
            cluster.admin().get(path("v1", "pods", namespace), labelSelector="spotrl.dev/retention-of=tiny")["items"]
            == []
        )


@pytest.mark.parametrize("propagation", ["Background", "Foreground"])
def test_a_job_without_a_credentials_secret_has_its_cuts_deleted_as_its_own_service_account(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs, s3_bucket: S3Bucket, propagation: str
) -> None:
    """With no credentials Secret the deletion pod runs as the job's ServiceAccount, to which a
    cloud identity is bound (the keys here come through spec.runtimeEnv, as a cloud identity's
    would through the SDK). A foreground deletion has the garbage collector delete the RLJob's
    objects first, that ServiceAccount among them. A finalizer on the job's controller pod holds
    the operator's finalizer back until the collector has acted, so the deletion pod's turn comes
    with the ServiceAccount gone (in the background case, still there and owned)."""
    admin = cluster.admin()
    keys_data = {"AWS_ACCESS_KEY_ID": s3_bucket.access_key, "AWS_SECRET_ACCESS_KEY": s3_bucket.secret_key}
    admin.create(
        path("v1", "secrets", namespace), {"kind": "Secret", "metadata": {"name": "keys"}, "stringData": keys_data}
    )
    root = f"jobs/{namespace}/tiny"
    job_files = put_job_files(s3_bucket, root)
    keys_env = [{"name": k, "valueFrom": {"secretKeyRef": {"name": "keys", "key": k}}} for k in keys_data]
    checkpoint = {
        "storage": f"s3://{s3_bucket.bucket}/{root}",
        "s3Endpoint": s3_bucket.endpoint,
        "retentionPolicy": "Delete",
    }
    jobs.create(tiny_job("tiny", checkpoint=checkpoint, runtimeEnv=keys_env, **PENDING))
    jobs.wait("tiny", lambda s: s.get("attempt") == 1, 20, "started")
    sa_url = path("v1", "serviceaccounts", namespace, "tiny-runtime")
    pod_url = path("v1", "pods", namespace, "tiny-controller-1")
    assert admin.wait_for(pod_url, lambda o: o is not None, 15, "the controller pod") is not None
    admin.patch(pod_url, {"metadata": {"finalizers": ["spotrl.dev/test-hold"]}})

    admin.delete(jobs.url("tiny"), {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation})
    admin.wait_for(pod_url, lambda o: o is not None and bool(o["metadata"].get("deletionTimestamp")), 15, "held")
    if propagation == "Foreground":
        admin.wait_for(sa_url, lambda o: o is None, 15, "the garbage collector to delete the ServiceAccount")
    else:
        time.sleep(2)  # the collector leaves an owned object while its owner is held by a finalizer
        assert admin.get(sa_url)["metadata"]["ownerReferences"]
    admin.patch(pod_url, {"metadata": {"finalizers": None}})

    admin.wait_for(jobs.url("tiny"), lambda o: o is None, 60, "the RLJob gone")
    left = keys(s3_bucket)
    assert not set(job_files) & left, f"left behind: {sorted(set(job_files) & left)}"
    events = admin.get(path("v1", "events", namespace), fieldSelector="involvedObject.name=tiny")["items"]
    reasons = {e["reason"]: e["message"] for e in events}
    assert "removed 6 objects" in reasons["CutsDeleted"], reasons
    assert admin.get(path("v1", "pods", namespace), labelSelector="spotrl.dev/retention-of=tiny")["items"] == []
    # Held for the pod, owned by no one: only the operator deletes it (the collector never would).
    assert admin.get_or_none(sa_url) is None, "the ServiceAccount held for the deletion pod outlived it"


def test_a_job_keeps_the_default_secret_it_was_created_with(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess], jobs: Jobs
) -> None:
    """The operator records the default credentials Secret on each job when it first sees it,
    and the job's pods keep mounting that one after the default changed (a helm upgrade): the
    admission policy checked the job's author against it, not against the new one. Taking the
    record off (an update the policy checks against the new default) records the new one."""
    start_operator(args=("--default-credentials-secret=new",))
    older = tiny_job("older", checkpoint={"storage": "s3://bucket-x/older"}, **PENDING)
    older["metadata"]["annotations"] = {DEFAULT_SECRET_ANNOTATION: "old"}  # as an older default left it
    jobs.create(older)
    jobs.create(tiny_job("fresh", checkpoint={"storage": "s3://bucket-x/fresh"}, **PENDING))
    admin = cluster.admin()

    def recorded(name: str) -> str | None:
        return ((jobs.get(name) or {})["metadata"].get("annotations") or {}).get(DEFAULT_SECRET_ANNOTATION)

    for name, secret in (("older", "old"), ("fresh", "new")):
        pod = admin.wait_for(path("v1", "pods", namespace, f"{name}-controller-1"), lambda o: o is not None, 20, name)
        assert pod is not None
        assert pod["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": secret}}], name
    wait_until(lambda: (recorded("older"), recorded("fresh")) == ("old", "new"), 10, "each job's default recorded")
    admin.patch(jobs.url("older"), {"metadata": {"annotations": {DEFAULT_SECRET_ANNOTATION: None}}})
    wait_until(lambda: recorded("older") == "new", 10, "the new default recorded")


def test_retention_delete_refuses_a_storage_that_is_not_the_jobs_own_prefix(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs, s3_bucket: S3Bucket
) -> None:
    """With one credentials Secret shared by tenants, a job whose storage names another job's
    root must not delete it: the operator refuses, says so, and the RLJob still goes."""
    victim = put_job_files(s3_bucket, "jobs/team-b/victim")
    checkpoint = {
        "storage": f"s3://{s3_bucket.bucket}/jobs/team-b/victim",
        "s3Endpoint": s3_bucket.endpoint,
        "retentionPolicy": "Delete",
    }
    jobs.create(tiny_job("tiny", checkpoint=checkpoint, **PENDING))
    jobs.wait("tiny", lambda s: s.get("attempt") == 1, 20, "started")
    jobs.delete("tiny", timeout=60)
    assert set(victim) <= keys(s3_bucket), "another job's cuts were deleted"
    events = cluster.admin().get(path("v1", "events", namespace), fieldSelector="involvedObject.name=tiny")["items"]
    (refused,) = [e for e in events if e["reason"] == "CutsNotDeleted"]
    assert refused["type"] == "Warning"
    assert f"<storage>/{namespace}/tiny" in refused["message"]
    assert "nothing was deleted" in refused["message"]
    pods = cluster.admin().get(path("v1", "pods", namespace))["items"]
    assert not [p for p in pods if "retention" in p["metadata"]["name"]], "no deletion pod for a refusal"


def test_suspend_stops_the_controller_and_resume_starts_a_fresh_one_without_counting_a_preemption(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs
) -> None:
    """Nobody answers this barrier (the controller never ran): it is Missed after its
    deadline, and the suspend goes on from the last committed cut."""
    jobs.create(tiny_job("tiny", checkpoint={"storage": "s3://bucket-x/tiny", "barrierDeadlineSeconds": 5}, **PENDING))
    jobs.wait("tiny", lambda s: s.get("attempt") == 1, 20, "started")
    jobs.patch_spec("tiny", {"suspend": True})
    st = jobs.wait("tiny", lambda s: (s.get("barrier") or {}).get("reason") == "suspend", 10, "suspend barrier")
    assert st["barrier"]["state"] == "Requested"
    assert st["barrier"]["attempt"] == 1
    assert st["phase"] == "Checkpointing"

    st = jobs.wait("tiny", lambda s: s.get("phase") == "Suspended", 20, "Suspended")
    assert st["barrier"]["state"] == "Missed"
    conditions = {c["type"]: c for c in st["conditions"]}
    assert conditions["BarrierMissed"]["status"] == "True"
    assert conditions["Suspended"]["status"] == "True"
    wait_until(lambda: jobs.pods("tiny") == [], 15, "the controller pod gone")
    jobs.said("tiny", {"BarrierRequested", "BarrierMissed", "Suspended"})

    jobs.patch_spec("tiny", {"suspend": False})
    st = jobs.wait("tiny", lambda s: s.get("attempt") == 2, 15, "attempt 2")
    assert st["preemptions"] == 0, "a suspend is not a preemption"
    assert st["restarts"] == 0
    assert "barrier" not in st
    wait_until(lambda: [p["metadata"]["name"] for p in jobs.pods("tiny")] == ["tiny-controller-2"], 15, "pod 2")
    st = jobs.status("tiny")
    assert {c["type"]: c["status"] for c in st["conditions"]}["Suspended"] == "False"


class HeldCut:
    """A Controllable whose barrier cut commits when the test says so."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.release = threading.Event()
        self.calls: list[str] = []

    def request_barrier(self, reason: str, deadline: Deadline) -> CutInfo:
        self.calls.append(reason)
        self.asked.set()
        assert self.release.wait(60)
        return CutInfo("0000000007", 7, "s3://bucket-x/tiny/cuts/0000000007", "barrier", time.time(), 0.1)


def runtime_bridge(cluster: Cluster, namespace: str, job: str, attempt: int, tmp: Path) -> KubeBridge:
    """The real bridge with the job's runtime ServiceAccount (as in the controller pod)."""
    from kubernetes import config

    kubeconfig = token_kubeconfig(cluster, namespace, f"{job}-runtime", tmp / f"{job}-runtime.kubeconfig")
    return KubeBridge(job, namespace, attempt, api_client=config.new_client_from_config(config_file=str(kubeconfig)))


def suspended_mid_barrier(
    cluster: Cluster, namespace: str, jobs: Jobs, tmp_path: Path, held: HeldCut
) -> tuple[KubeBridge, dict]:
    """The job ``tiny`` (its controller pod Pending) suspended, its barrier requested and seen by
    the real bridge, whose cut ``held`` holds: (the running bridge, to stop; the request)."""
    jobs.create(
        tiny_job("tiny", checkpoint={"storage": "s3://bucket-x/tiny", "barrierDeadlineSeconds": 120}, **PENDING)
    )
    jobs.wait("tiny", lambda s: s.get("attempt") == 1, 20, "started")
    bridge = runtime_bridge(cluster, namespace, "tiny", 1, tmp_path).start(held)
    try:
        jobs.patch_spec("tiny", {"suspend": True})
        assert held.asked.wait(20), "the bridge never saw the barrier request"
        request = jobs.status("tiny")["barrier"]
        assert request["state"] == "Requested"
    except BaseException:
        held.release.set()
        bridge.stop()
        raise
    return bridge, request


def test_an_operator_killed_in_the_middle_of_a_barrier_is_finished_by_the_next(
    cluster: Cluster, namespace: str, start_operator: Callable[..., OperatorProcess], jobs: Jobs, tmp_path: Path
) -> None:
    first = start_operator(name="first")
    held = HeldCut()
    bridge, request = suspended_mid_barrier(cluster, namespace, jobs, tmp_path, held)
    try:
        wait_until(lambda: "BarrierRequested" in jobs.reasons("tiny"), 10, "the request's Event")

        first.kill(signal.SIGKILL)  # mid-barrier: requested, not yet committed
        held.release.set()
        st = jobs.wait("tiny", lambda s: s["barrier"]["state"] == "Committed", 20, "the bridge's answer")
        assert st["barrier"]["requestId"] == request["requestId"]
        assert st["barrier"]["cutId"] == "0000000007"
        assert st["lastCut"]["id"] == "0000000007"
        assert len(jobs.pods("tiny")) == 1, "no operator: nobody acted on the commit yet"

        start_operator(name="second")
        st = jobs.wait("tiny", lambda s: s.get("phase") == "Suspended", 30, "the new operator finishes the suspend")
        assert st["barrier"]["requestId"] == request["requestId"], "the same barrier, not a new one"
        wait_until(lambda: jobs.pods("tiny") == [], 15, "the controller pod gone")
        assert held.calls == ["suspend"], "the controller was asked once"
        requested = [e for e in jobs.events("tiny") if e["reason"] == "BarrierRequested"]
        assert len(requested) == 1
        assert requested[0]["count"] == 1
        committed = [e for e in jobs.events("tiny") if e["reason"] == "BarrierCommitted"]
        assert len(committed) == 1
    finally:
        held.release.set()
        bridge.stop()


def test_replicas_elect_one_leader_and_a_standby_takes_over(
    cluster: Cluster,
    namespace: str,
    operator_identity: tuple[str, Path],
    start_operator: Callable[..., OperatorProcess],
    jobs: Jobs,
) -> None:
    lease_ns = operator_identity[0]
    leader = start_operator(name="one")
    standby = start_operator(name="two", wait="standby")
    assert lease_holder(cluster, lease_ns) == leader.name
    jobs.create(tiny_job("a", checkpoint={"storage": "s3://bucket-x/a"}, **PENDING))
    jobs.wait("a", lambda s: s.get("attempt") == 1, 20, "job a started")
    # Passes of the leader after the one that started the job (one a second, here): time in
    # which a second creation, its own or the standby's, would show.
    ok = 'spotrl_operator_reconciles_total{result="ok"}'
    passes = leader.metrics().get(ok, 0)  # counted after the pass's writes: maybe not yet the first
    wait_until(lambda: leader.metrics().get(ok, 0) >= passes + 3, 20, "three more passes of the leader")
    assert [p["metadata"]["name"] for p in jobs.pods("a")] == ["a-controller-1"]
    created = [e for e in jobs.events("a") if e["reason"] == "ControllerCreated"]
    assert [e["count"] for e in created] == [1]
    assert "ready: running RLJobs" not in standby.log()
    assert standby.metrics()["spotrl_operator_leader"] == 0
    assert leader.metrics()["spotrl_operator_leader"] == 1

    t0 = time.monotonic()
    leader.kill(signal.SIGKILL)
    wait_until(lambda: "ready: running RLJobs" in standby.log(), 20, "the standby to take over")
    took = time.monotonic() - t0
    assert lease_holder(cluster, lease_ns) == standby.name
    assert took < 4 + 6, f"takeover took {took:.1f} s with a 4 s lease"
    jobs.create(tiny_job("b", checkpoint={"storage": "s3://bucket-x/b"}, **PENDING))
    jobs.wait("b", lambda s: s.get("attempt") == 1, 20, "job b started by the new leader")
    # The new leader counts a job by phase after a pass over it has acted: both jobs counted,
    # so job a has had its pass under the new leader.
    wait_until(
        lambda: sum(v for k, v in standby.metrics().items() if k.startswith("spotrl_operator_jobs{")) >= 2,
        20,
        "the new leader's pass over job a",
    )
    st = jobs.status("a")
    assert st["attempt"] == 1, "the new leader continues job a, it does not start it again"
    assert [p["metadata"]["name"] for p in jobs.pods("a")] == ["a-controller-1"]


def test_a_stale_status_write_is_refused_and_changes_nothing(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs
) -> None:
    """The guard behind 'never clobber the controller's fields': a write based on an old
    resourceVersion gets 409 and writes nothing."""
    jobs.create(tiny_job("tiny", checkpoint={"storage": "s3://bucket-x/tiny"}, **PENDING))
    jobs.wait("tiny", lambda s: s.get("attempt") == 1, 20, "started")
    observed = jobs.get("tiny")
    assert observed is not None
    jobs.patch_status("tiny", {"step": 11, "stepAttempt": 1})  # the controller writes meanwhile
    actuator = Actuator(Kube(cluster.api_client()), Settings())
    with pytest.raises(ConflictError):
        actuator.write_status(observed, {"phase": "Failed", "step": 0})
    st = jobs.status("tiny")
    assert st["step"] == 11
    assert st["phase"] != "Failed"


def test_the_operator_exports_its_metrics(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs
) -> None:
    jobs.create(tiny_job("tiny", checkpoint={"storage": "s3://bucket-x/tiny"}, **PENDING))
    jobs.wait("tiny", lambda s: s.get("attempt") == 1, 20, "started")
    wait_until(lambda: operator.metrics().get('spotrl_operator_jobs{phase="Pending"}', 0) >= 1, 10, "jobs gauge")
    m = operator.metrics()
    assert m['spotrl_operator_reconciles_total{result="ok"}'] >= 1
    assert m["spotrl_operator_controllers_created_total"] >= 1
    assert m["spotrl_operator_leader"] == 1


def test_the_bridge_ignores_requests_for_another_attempt(
    cluster: Cluster,
    namespace: str,
    operator: OperatorProcess,
    jobs: Jobs,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A controller being replaced (attempt 1) must not cut for its successor's request. The
    bridge says when it has seen a request and let it be: the check waits for that, not for a
    while in which a bridge that never saw the request would pass as well."""
    caplog.set_level(logging.INFO, logger="spotrl.kube_bridge")
    jobs.create(tiny_job("tiny", checkpoint={"storage": "s3://bucket-x/tiny", "barrierDeadlineSeconds": 60}, **PENDING))
    jobs.wait("tiny", lambda s: s.get("attempt") == 1, 20, "started")
    held = HeldCut()
    held.release.set()
    stale = runtime_bridge(cluster, namespace, "tiny", 7, tmp_path).start(held)
    try:
        jobs.patch_spec("tiny", {"suspend": True})
        st = jobs.wait("tiny", lambda s: (s.get("barrier") or {}).get("state") == "Requested", 10, "requested")
        seen = f"barrier {st['barrier']['requestId']} is for attempt 1, not for this controller (7): ignored"
        wait_until(lambda: seen in caplog.text, 10, "the bridge to see the request and let it be")
        assert held.calls == []
        assert jobs.status("tiny")["barrier"]["state"] == "Requested"
    finally:
        stale.stop()
