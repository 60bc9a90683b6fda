"""The operator's edges, on the test control plane with real operator processes: a leader cut
off from the API server, a namespace deleted under its jobs, a budget deleted by hand, a job
made again under its name, a budget and a pod deleted while the operator's watches are in a
gap (410 Gone), many nodes going Unknown at once, and a rolling update of the operator in the
middle of a barrier (the API server's audit log shows who wrote when)."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from operator_harness import NOWHERE, RELEASE, Jobs, OperatorProcess, tiny_job, token_kubeconfig, wait_until

from spotrl_e2e.cluster import Cluster
from spotrl_e2e.kube import path
from spotrl_e2e.stallproxy import StallProxy
from spotrl_e2e.watch_gap_proxy import WatchGapProxy
from spotrl_runtime.kube import Kube

pytestmark = [pytest.mark.cluster]
PENDING = {"scheduling": {"nodeSelector": NOWHERE}}
STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
Obj = dict[str, Any]


def stamped(log: str, needle: str) -> list[datetime]:
    """When each line of an operator's log that contains ``needle`` was written."""
    out = []
    for line in log.splitlines():
        m = STAMP.match(line)
        if m and needle in line:
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f"))
    return out


def through(proxy: StallProxy | WatchGapProxy, kubeconfig: Path, file: Path) -> Path:
    """The kubeconfig, its server reached through the proxy."""
    config = yaml.safe_load(kubeconfig.read_text())
    for entry in config["clusters"]:
        entry["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    file.write_text(yaml.safe_dump(config))
    return file


def test_a_leader_whose_api_calls_stall_stops_acting_before_the_standby_leads(
    cluster: Cluster,
    namespace: str,
    operator_identity: tuple[str, Path],
    start_operator: Callable[..., OperatorProcess],
    jobs: Jobs,
    tmp_path: Path,
) -> None:
    """A partition between the leader and the API server: its renewals hang. It must stop
    writing, and exit, before the standby takes the Lease; the write log of both shows it."""
    lease_ns, kubeconfig = operator_identity
    server = urlsplit(cluster.server)
    proxy = StallProxy((server.hostname or "127.0.0.1", server.port or 443))
    stalled_config = through(proxy, kubeconfig, tmp_path / "through-proxy.kubeconfig")
    leader = OperatorProcess(cluster, stalled_config, lease_ns, tmp_path, "cut-off", ("--log-writes",))
    try:
        leader.start()
        standby = start_operator(args=("--log-writes",), wait="standby", name="standby")
        jobs.create(tiny_job("a", checkpoint={"storage": "s3://bucket-x/a"}, **PENDING))
        jobs.wait("a", lambda s: s.get("attempt") == 1, 20, "job a started by the leader")
        assert stamped(leader.log(), "spotrl.kube.writes: POST"), "the write log shows the leader's creates"

        proxy.stall()
        wait_until(lambda: "ready: running RLJobs" in standby.log(), 30, "the standby to take over")
        wait_until(lambda: not leader.running(), 10, "the cut-off leader to exit")
        assert leader.process.exit_code() == 1

        cut_off, took_over = leader.log(), standby.log()
        (stopped,) = stamped(cut_off, "lost the lease")
        # "exiting: the leader Lease was lost", then "exiting hard: ..." when Kopf is slow to stop:
        # the last one is when the process ended.
        exited = max(stamped(cut_off, "exiting"), default=None)
        (leading,) = stamped(took_over, "leading as")
        last_write = max(stamped(cut_off, "spotrl.kube.writes:"))
        assert last_write < leading, "the cut-off leader wrote after the standby led"
        assert stopped < leading
        assert exited is not None, f"no exit logged:\n{cut_off[-3000:]}"
        assert exited < leading, "the cut-off leader still ran when the standby led"

        # The new leader acts, alone: the job goes on under it.
        jobs.patch_spec("a", {"suspend": True})
        jobs.wait("a", lambda s: s.get("phase") == "Suspended", 30, "the new leader suspends job a")
        assert min(stamped(standby.log(), "spotrl.kube.writes:")) > last_write
    finally:
        proxy.close()
        leader.stop()


def test_a_namespace_deleted_with_jobs_in_every_phase_and_retention_delete_finishes(
    cluster: Cluster, start_operator: Callable[..., OperatorProcess]
) -> None:
    """In a namespace being deleted no pod can start, so no deletion pod can delete the cuts:
    the finalizer says where they stay and lets each job go."""
    operator = start_operator()
    ns = cluster.create_namespace("reliability-ns", pod_security="restricted")
    jobs = Jobs(cluster, ns)

    def job(name: str, **extra: Any) -> Obj:
        storage = {"storage": f"s3://bucket-x/spotrl/{ns}/{name}", "retentionPolicy": "Delete"}
        return tiny_job(name, checkpoint=storage, **PENDING, **extra)

    jobs.create(job("pending"))
    jobs.create(job("suspended", suspend=True))
    jobs.create(job("succeeded"))
    jobs.create(job("failed"))
    jobs.wait("pending", lambda s: s.get("attempt") == 1, 20, "pending started")
    jobs.wait("suspended", lambda s: s.get("phase") == "Suspended", 20, "suspended")
    for name, phase in (("succeeded", "Succeeded"), ("failed", "Failed")):
        jobs.wait(name, lambda s: s.get("attempt") == 1, 20, f"{name} started")
        jobs.patch_status(name, {"phase": phase})
    cluster.delete_namespace(ns, wait=True, timeout=90)
    said = operator.log()
    for name in ("pending", "suspended", "succeeded", "failed"):
        assert f"{ns}/{name} deleted: CutsNotDeleted" in said, said[-3000:]
    assert "the namespace is being deleted" in said


def test_a_budget_deleted_by_hand_is_made_again_closed(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs
) -> None:
    admin = cluster.admin()
    created = jobs.create(tiny_job("tiny", checkpoint={"storage": "s3://bucket-x/tiny"}, **PENDING))
    jobs.wait("tiny", lambda s: s.get("attempt") == 1, 20, "started")
    url = path("policy/v1", "poddisruptionbudgets", namespace, "tiny-controller")
    first = admin.wait_for(url, lambda o: o is not None, 20, "the budget")
    assert first is not None
    admin.delete(url)
    again = admin.wait_for(
        url, lambda o: o is not None and o["metadata"]["uid"] != first["metadata"]["uid"], 20, "the budget again"
    )
    assert again is not None
    assert again["spec"]["minAvailable"] == 1, "made again closed: a drain waits for the barrier"
    assert [o["uid"] for o in again["metadata"]["ownerReferences"]] == [created["metadata"]["uid"]]
    service = path("v1", "services", namespace, "tiny")
    admin.delete(service)
    made = admin.wait_for(service, lambda o: o is not None, 20, "the Service again")
    assert made is not None


def owner_uids(obj: dict) -> list[str]:
    return [o["uid"] for o in obj["metadata"].get("ownerReferences") or []]


def test_a_job_made_again_under_its_name_never_adopts_the_old_ones_objects(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs
) -> None:
    """The old job's Service outlives it (a finalizer holds it, as a slow garbage collector
    would): the new job refuses it, says why, and makes its own once it is gone."""
    admin = cluster.admin()
    spec = {"checkpoint": {"storage": "s3://bucket-x/tiny"}, **PENDING}
    old = jobs.create(tiny_job("tiny", **spec))
    jobs.wait("tiny", lambda s: s.get("attempt") == 1, 20, "the first job started")
    service = path("v1", "services", namespace, "tiny")
    # The attempt is written before the pod and its objects are made: wait for the Service.
    admin.wait_for(service, lambda o: o is not None, 20, "the first job's Service")
    admin.patch(service, {"metadata": {"finalizers": ["test.spotrl.dev/hold"]}})
    rbac = "rbac.authorization.k8s.io/v1"
    names = [("v1", "serviceaccounts", "tiny-runtime"), ("v1", "services", "tiny"), (rbac, "roles", "tiny-runtime")]
    names += [(rbac, "rolebindings", "tiny-runtime"), ("policy/v1", "poddisruptionbudgets", "tiny-controller")]
    objects = {path(g, kind, namespace, name): "" for g, kind, name in names}
    for url in objects:  # the first job's, by uid
        objects[url] = admin.wait_for(url, lambda o: o is not None, 20, url)["metadata"]["uid"]  # type: ignore[index]
    try:
        jobs.delete("tiny")
        held = admin.get(service)
        assert held["metadata"].get("deletionTimestamp") is None or held["metadata"]["finalizers"]
        new = jobs.create(tiny_job("tiny", **spec))
        new_uid = new["metadata"]["uid"]
        assert new_uid != old["metadata"]["uid"]
        st = jobs.wait(
            "tiny",
            lambda s: any(c.get("reason") == "OwnedByAnotherJob" for c in s.get("conditions") or []),
            30,
            "the new job to say the old Service is not its own",
        )
        assert st.get("attempt", 0) <= 1
        # The old job's pod may still be stopping (its garbage collection is not instant): only
        # the new job's own pods count.
        made = [p["metadata"]["name"] for p in jobs.pods("tiny") if new_uid in owner_uids(p)]
        assert made == [], "no pod before its objects are its own"
    finally:
        admin.patch(service, {"metadata": {"finalizers": None}})
    # Made again, not adopted: each object of the job's names is a new one (another uid) that the
    # new job owns, once the garbage collector has taken the old job's (the attempt is written
    # before the objects are made, so it says nothing here).
    for url in objects:
        obj = admin.wait_for(url, lambda o: o is not None and owner_uids(o) == [new_uid], 30, f"the new job's {url}")
        assert obj is not None
        assert obj["metadata"]["uid"] != objects[url], f"{url} was adopted, not made again"
    wait_until(lambda: any(new_uid in owner_uids(p) for p in jobs.pods("tiny")), 30, "the new job's controller pod")


def test_an_account_that_spotrl_did_not_make_is_never_used_changed_or_deleted(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs
) -> None:
    """Someone's ``web-runtime`` ServiceAccount (its RBAC and cloud role bound to that name)
    exists before a job named ``web``: the job is refused, says which account and what to do,
    runs no pod as it, and its deletion (retentionPolicy Delete, no keys: the deletion pod would
    run as the job's account) leaves the account exactly as it was."""
    admin = cluster.admin()
    sa_url = path("v1", "serviceaccounts", namespace, "web-runtime")
    theirs = admin.create(
        path("v1", "serviceaccounts", namespace),
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": "web-runtime", "annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/w"}},
        },
    )
    checkpoint = {"storage": f"s3://bucket-x/jobs/{namespace}/web", "retentionPolicy": "Delete"}
    jobs.create(tiny_job("web", checkpoint=checkpoint, **PENDING))
    st = jobs.wait(
        "web",
        lambda s: any(c.get("reason") == "NotMadeBySpotRL" for c in s.get("conditions") or []),
        30,
        "the job to say the account is not SpotRL's",
    )
    (cond,) = [c for c in st["conditions"] if c.get("reason") == "NotMadeBySpotRL"]
    assert (cond["type"], cond["status"]) == ("ReconcileError", "True")
    assert "ServiceAccount web-runtime" in cond["message"], cond
    assert "create the job under another name, or delete or rename the ServiceAccount" in cond["message"], cond
    # The Event follows the condition's write (Actuator.report): wait for it, do not race it.
    wait_until(lambda: "ReconcileFailed" in jobs.reasons("web"), 30, "the ReconcileFailed Event")
    failed = [e for e in jobs.events("web") if e["reason"] == "ReconcileFailed"]
    assert failed[0]["type"] == "Warning"
    assert "ServiceAccount web-runtime" in failed[0]["message"], failed[0]
    assert jobs.pods("web") == [], "no pod runs as an account SpotRL did not make"

    jobs.delete("web", timeout=60)
    after = admin.get(sa_url)
    assert after["metadata"]["uid"] == theirs["metadata"]["uid"], "deleted (and made again)"
    assert after["metadata"]["resourceVersion"] == theirs["metadata"]["resourceVersion"], after["metadata"]
    assert not after["metadata"].get("ownerReferences")
    events = admin.get(path("v1", "events", namespace), fieldSelector="involvedObject.name=web")["items"]
    (kept,) = [e for e in events if e["reason"] == "CutsNotDeleted"]
    assert "would run as ServiceAccount web-runtime, which SpotRL did not make" in kept["message"], kept
    pods = admin.get(path("v1", "pods", namespace), labelSelector="spotrl.dev/retention-of=web")["items"]
    assert pods == [], "no deletion pod ran as it"


def test_a_delete_by_name_with_the_uid_it_read_never_deletes_an_object_made_since(
    cluster: Cluster, namespace: str
) -> None:
    """The operator's client sends the uid it read as the delete's precondition: an object made
    under the same name in between (by anyone) is not deleted, and the delete reads as done."""
    admin, kube = cluster.admin(), Kube(cluster.api_client())
    accounts = path("v1", "serviceaccounts", namespace)
    sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "web-runtime"}}
    read = admin.create(accounts, sa)
    admin.delete(f"{accounts}/web-runtime")
    admin.wait_for(f"{accounts}/web-runtime", lambda o: o is None, 10, "the first account gone")
    theirs = admin.create(accounts, sa)
    assert kube.delete(f"{accounts}/web-runtime", uid=read["metadata"]["uid"]) is False
    assert admin.get(f"{accounts}/web-runtime")["metadata"]["uid"] == theirs["metadata"]["uid"], "deleted"
    assert kube.delete(f"{accounts}/web-runtime", uid=theirs["metadata"]["uid"]) is True
    assert admin.get_or_none(f"{accounts}/web-runtime") is None


def test_a_budget_then_a_pod_deleted_in_a_watch_gap_are_found_gone_and_made_again(
    cluster: Cluster, namespace: str, operator_identity: tuple[str, Path], jobs: Jobs, tmp_path: Path
) -> None:
    """The operator's pod and PodDisruptionBudget watches break and resume from an expired
    resourceVersion (410 Gone, from a proxy in front of the API server) while the job's budget is
    deleted, and in a second gap its controller pod: Kopf lists again, never hears of the
    deletions, and its indexes keep them. The live lists (one per kind every ``RELIST_INTERVALS``
    reconcile intervals: 3 s here) find them gone: the job makes its budget again instead of
    believing it has one (a drain would evict its controller with no barrier), and a new controller
    instead of waiting on one that no longer exists. The budget goes first, alone: a new controller
    makes the job's missing objects again on its way, whatever the budget's cache says."""
    pods, budgets = "/api/v1/pods", "/apis/policy/v1/poddisruptionbudgets"
    lease_ns, kubeconfig = operator_identity
    serving = cluster.controlplane.pki.issue("watch-gap-proxy", "watch-gap-proxy", ips=("127.0.0.1",), server=True)
    proxy = WatchGapProxy(cluster.server, cluster.ca, serving, collections=(pods, budgets))
    gapped = through(proxy, kubeconfig, tmp_path / "watch-gap.kubeconfig")
    operator = OperatorProcess(cluster, gapped, lease_ns, tmp_path, "watch-gap", ("--reconcile-interval", "0.3"))
    admin = cluster.admin()

    def deleted_in_a_gap(url: str) -> None:
        """Deletes ``url`` while the operator's watches are in a gap, until they have listed again after it."""
        gone = proxy.gone
        proxy.open_gap()
        wait_until(lambda: proxy.gone > gone, 10, "the operator's watches to resume into the gap")
        admin.delete(url, gracePeriodSeconds=0)
        admin.wait_for(url, lambda o: o is None, 10, f"{url} gone")
        # Kopf's watches now resume from LISTs sent after the deletion: the DELETED event is behind them.
        listed = dict(proxy.lists)
        wait_until(lambda: all(proxy.lists[c] > listed.get(c, 0) + 1 for c in (pods, budgets)), 10, "lists after it")
        proxy.close_gap()

    try:
        operator.start()
        jobs.create(tiny_job("a", checkpoint={"storage": "s3://bucket-x/a"}, **PENDING))
        # The budget is made before the pod: once the operator has seen its pod, it has seen the budget.
        jobs.wait("a", lambda s: bool(s.get("controllerPod")), 20, "the operator to see its controller pod")
        (pod,) = jobs.pods("a")
        meta = pod["metadata"]
        pdb_url = path("policy/v1", "poddisruptionbudgets", namespace, "a-controller")
        budget = admin.get(pdb_url)

        deleted_in_a_gap(pdb_url)
        assert proxy.cut >= 2, "the pod and budget watches in flight were cut"
        # Within one period of the live lists (3 s) and a pass; the rest is room for a busy machine.
        again = admin.wait_for(pdb_url, lambda o: o is not None, 15, "the job to make its budget again")
        assert again is not None
        assert again["metadata"]["uid"] != budget["metadata"]["uid"]
        assert again["spec"]["minAvailable"] == 1, "made again closed: a drain waits for the barrier"
        assert "the caches held 1 PodDisruptionBudget that" in operator.log(), operator.log()[-3000:]
        assert [p["metadata"]["uid"] for p in jobs.pods("a")] == [meta["uid"]], "no new controller made it"

        deleted_in_a_gap(path("v1", "pods", namespace, meta["name"]))
        jobs.wait("a", lambda s: s.get("attempt") == 2, 15, "the job to make a new controller")
        assert "the caches held 1 Pod that" in operator.log(), operator.log()[-3000:]
        jobs.wait("a", lambda s: s.get("controllerPod") not in (None, meta["name"]), 20, "the new controller seen")
        uids = [p["metadata"]["uid"] for p in jobs.pods("a")]
        assert uids, "the new controller pod exists"
        assert meta["uid"] not in uids, uids
    finally:
        proxy.close_gap()
        try:
            jobs.cleanup()  # the finalizer is this operator's: it must still run
        finally:
            operator.stop()
            proxy.close()


HOLD_WRITE = Path(__file__).parent / "hold_write"
"""A ``sitecustomize`` that holds an operator's next write once the test says so (see there)."""


def token_id(kubeconfig: Path) -> str:
    """The ``jti`` of the kubeconfig's ServiceAccount token: the API server names it in each
    request's audit event (``user.extra["authentication.kubernetes.io/credential-id"]``), so two
    replicas of one ServiceAccount, each with its own token, are told apart there."""
    token = yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"]
    claims = token.split(".")[1]
    return str(json.loads(base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4)))["jti"])


@dataclass(frozen=True)
class Write:
    """One write request as the API server's audit log has it, on the API server's clock."""

    received: datetime
    completed: datetime
    verb: str
    resource: str
    name: str
    client: str
    """The User-Agent's product: ``kopf`` (Kopf's own client), ``OpenAPI-Generator`` (SpotRL's)."""
    who: str

    def __str__(self) -> str:
        when = f"{self.received:%H:%M:%S.%f}-{self.completed:%H:%M:%S.%f}"
        return f"{when} {self.who} {self.client} {self.verb} {self.resource}/{self.name}"


def writes_by(cluster: Cluster, token: str, who: str) -> list[Write]:
    """Every write request sent with the token, in the order received; ``who`` names the sender."""
    credential = [f"JTI={token}"]
    out = []
    for event in cluster.controlplane.audit_events():
        if (event["user"].get("extra") or {}).get("authentication.kubernetes.io/credential-id") != credential:
            continue
        ref = event.get("objectRef") or {}
        resource = "/".join(filter(None, (ref.get("resource"), ref.get("subresource"))))
        out.append(
            Write(
                datetime.fromisoformat(event["requestReceivedTimestamp"]),
                datetime.fromisoformat(event["stageTimestamp"]),
                event["verb"],
                resource,
                ref.get("name") or "",
                (event.get("userAgent") or "").split("/")[0],
                who,
            )
        )
    return sorted(out, key=lambda w: w.received)


def test_a_rolling_update_mid_barrier_writes_from_one_operator_at_every_instant(
    cluster: Cluster,
    namespace: str,
    operator_identity: tuple[str, Path],
    start_operator: Callable[..., OperatorProcess],
    jobs: Jobs,
    tmp_path: Path,
) -> None:
    """The old replica is stopped (SIGTERM, as a rolling update does) while a barrier is requested
    and one of its writes is in flight (held 2.5 s by ``hold_write``, under a 4 s lease). The
    API server's audit log must show every write of the old replica, Kopf's own included, ended
    before the new one's first write (its take-over of the Lease) arrived; and the barrier commits
    under the new one. Each replica has its own token of the chart's ServiceAccount: one user
    name, told apart by the token's id in the audit log."""
    from test_operator import HeldCut, suspended_mid_barrier

    lease_ns = operator_identity[0]
    configs = {who: token_kubeconfig(cluster, lease_ns, RELEASE, tmp_path / f"{who}.kubeconfig") for who in "ab"}
    arm = tmp_path / "hold-write"
    hook = {
        "PYTHONPATH": os.pathsep.join(filter(None, (str(HOLD_WRITE), os.environ.get("PYTHONPATH")))),
        "SPOTRL_HOLD_WRITE": str(arm),
        "SPOTRL_HOLD_WRITE_SECONDS": "2.5",
    }
    old = start_operator(name="old", kubeconfig=configs["a"], env=hook)
    new = start_operator(name="new", wait="standby", kubeconfig=configs["b"])
    held = HeldCut()
    bridge, request = suspended_mid_barrier(cluster, namespace, jobs, tmp_path, held)
    try:
        # A second job: the old leader's next write (its children, or its status) is held in flight.
        arm.touch()
        jobs.create(tiny_job("other", checkpoint={"storage": "s3://bucket-x/other"}, **PENDING))
        wait_until(lambda: arm.with_name("hold-write.held").exists(), 15, "a write of the old leader in flight")
        stopped_at = datetime.now(UTC)
        old.kill(signal.SIGTERM)
        assert old.process.exit_code() == 0, old.log()[-3000:]
        assert "released the lease" in old.log()
        wait_until(lambda: "ready: running RLJobs" in new.log(), 20, "the new replica to lead")

        held.release.set()
        st = jobs.wait("tiny", lambda s: s.get("phase") == "Suspended", 30, "the new leader finishes the suspend")
        assert st["barrier"]["requestId"] == request["requestId"], "the same barrier, not a new one"
        assert st["barrier"]["state"] == "Committed"
        assert held.calls == ["suspend"], "the controller was asked once"
        jobs.delete("other")  # the new leader's Kopf lets it go: its finalizer
    finally:
        held.release.set()
        bridge.stop()

    by_old = writes_by(cluster, token_id(configs["a"]), "old")
    by_new = writes_by(cluster, token_id(configs["b"]), "new")
    said = "\n".join(map(str, sorted(by_old + by_new, key=lambda w: w.received)))
    # Both clients of each replica are in the log (Kopf's own: finalizers, its annotations), and
    # the old one's held write went out after it was told to stop: the window was there.
    assert {w.client for w in by_old} == {"kopf", "OpenAPI-Generator"}, f"the old leader's clients:\n{said}"
    assert {w.client for w in by_new} == {"kopf", "OpenAPI-Generator"}, f"the new leader's clients:\n{said}"
    assert [w for w in by_old if w.received > stopped_at and w.resource != "leases"], f"no write in flight:\n{said}"
    # One operator at every instant: each write of the old one (from its arrival to its answer)
    # ended before the new one's first arrived. That first is the take-over of the Lease (a
    # standby only reads it), and the old one's last is its release: every other write of the
    # old one, Kopf's included, came before the release.
    assert max(w.completed for w in by_old) < by_new[0].received, f"two operators wrote at once:\n{said}"
    assert (by_old[-1].verb, by_old[-1].resource) == ("update", "leases"), f"not last, the release:\n{said}"
    assert (by_new[0].verb, by_new[0].resource) == ("update", "leases"), f"not first, the take-over:\n{said}"
