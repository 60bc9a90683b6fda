"""Kueue's part of the lifecycle (the operator as Kueue's external controller), without a cluster:
queued before any pod, admitted with the flavors' placement, evicted through a barrier cut,
the quota given back only once the pods are gone, the Workload made again when the pod sets
change, and marked Finished at the end."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from spotrl_operator import queueing
from spotrl_operator.actuate import admitted
from spotrl_operator.observe import Snapshot, queue_view, trim_workload
from spotrl_operator.queueing import (
    CreateWorkload,
    DeleteWorkload,
    FinishWorkload,
    LetGoWorkload,
    QueueView,
    ReleaseQuota,
    WorkloadView,
)
from spotrl_operator.reconcile import reconcile
from spotrl_operator.resources import JobRef
from spotrl_operator.settings import Settings
from spotrl_operator.world import CreateControllerPod, DeletePod, Event, Plan, PodView, RequestBarrier, World
from spotrl_runtime.api.rljob import CutRef, RLJobStatus, parse_spec
from spotrl_runtime.api.times import rfc3339 as iso

T0 = datetime(2026, 12, 4, 12, 0, 0, tzinfo=UTC)
SPEC = parse_spec(
    {
        "policy": {"model": "builtin:tiny-arith"},
        "dataset": {"uri": "builtin:arithmetic"},
        "reward": {"name": "arithmetic_exact"},
        "training": {"totalSteps": 30},
        "checkpoint": {"barrierDeadlineSeconds": 20, "storage": "s3://bucket/j"},
    }
)
DIGEST = "d1"
ADMITTED = WorkloadView(
    name="rljob-j-abcde",
    pod_sets=DIGEST,
    reserved=True,
    admitted=True,
    cluster_queue="team-a",
    flavors={"controller": ("spot",)},
)
SPOT = {"controller": queueing.placement(ADMITTED, {"spot": {"nodeLabels": {"pool": "spot"}}})["controller"]}


def world(wl: WorkloadView | None, **kw: object) -> World:
    q = QueueView(name="lq", want_pod_sets=DIGEST, workload=wl, placement=SPOT if wl and wl.admitted else {})
    base = World(now=T0, generation=1, spec=SPEC, status=RLJobStatus(), job="j", queue=q)
    return replace(base, **kw)  # type: ignore[arg-type]


def of(plan: Plan, kind: type) -> list:
    return [a for a in plan.actions if isinstance(a, kind)]


def events(plan: Plan) -> list[str]:
    return [a.reason for a in of(plan, Event)]


def running(attempt: int = 1) -> PodView:
    return PodView(name=f"j-controller-{attempt}", attempt=attempt, phase="Running", node="spot-a")


def evicted(reason: str = "Preempted", since: str = "2026-12-04T12:00:05Z") -> WorkloadView:
    return replace(ADMITTED, admitted=False, evicted=(reason, "Preempted to accommodate a workload", since))


def test_a_queued_job_gets_a_workload_and_no_pod_until_admitted() -> None:
    p1 = reconcile(world(None))
    assert of(p1, CreateWorkload) == [CreateWorkload("lq")]
    assert of(p1, CreateControllerPod) == []
    assert p1.status is not None
    assert p1.status.phase == "Queued"

    pending = WorkloadView(
        name="rljob-j-abcde",
        pod_sets=DIGEST,
        pending=("Pending", "couldn't assign flavors to pod set controller: insufficient unused quota for cpu"),
    )
    p2 = reconcile(world(pending, status=p1.status))
    assert of(p2, CreateWorkload) == []
    assert of(p2, CreateControllerPod) == []
    assert p2.status is not None
    assert p2.status.phase == "Queued"
    queued = next(c for c in p2.status.conditions if c.type == "Queued")
    assert queued.status == "True"
    assert "insufficient unused quota for cpu" in queued.message, "Kueue's reason"
    assert p2.status.queue is not None
    assert p2.status.queue.workload == "rljob-j-abcde"


def test_admission_starts_the_controller_with_the_flavors_placement() -> None:
    st = RLJobStatus(phase="Queued")
    plan = reconcile(world(ADMITTED, status=st))
    assert of(plan, CreateControllerPod) == [CreateControllerPod(1, frozenset())]
    assert plan.status is not None
    assert plan.status.queue is not None
    assert plan.status.queue.admitted
    assert plan.status.queue.cluster_queue == "team-a"
    assert plan.status.queue.flavors == {"controller": ["spot"]}
    assert "Admitted" in events(plan)
    assert plan.status.preemptions == 0, "a start after the queue is not a preemption"

    pod = {"spec": {"nodeSelector": {"zone": "a"}, "tolerations": [{"key": "x", "operator": "Exists"}]}}
    admitted(pod, plan.status, "controller")
    assert pod["spec"]["nodeSelector"] == {"zone": "a", "pool": "spot"}
    other = {"spec": {}}
    admitted(other, plan.status, "workers")
    assert other == {"spec": {}}, "a pod set the admission did not place is left alone"


def test_an_eviction_takes_a_barrier_then_stops_then_gives_the_quota_back() -> None:
    st = RLJobStatus(phase="Running", attempt=1, step=5, step_attempt=1)
    st = reconcile(world(ADMITTED, status=st, pods=(running(),))).status
    assert st is not None
    assert st.queue is not None
    assert st.queue.admitted

    # Kueue evicts: a barrier, nothing deleted, the quota still held.
    p1 = reconcile(world(evicted(), status=st, pods=(running(),)))
    (req,) = of(p1, RequestBarrier)
    assert req.barrier.reason == queueing.BARRIER_REASON
    assert of(p1, DeletePod) == []
    assert of(p1, ReleaseQuota) == []
    assert p1.status is not None
    assert p1.status.phase == "Checkpointing"
    assert p1.status.queue is not None
    assert p1.status.queue.evictions == 1
    assert "Evicted" in events(p1)

    # The same eviction seen again is not counted again.
    p1b = reconcile(world(evicted(), status=p1.status, pods=(running(),)))
    assert p1b.status is not None
    assert p1b.status.queue is not None
    assert p1b.status.queue.evictions == 1

    # The cut commits: the controller is stopped, still no quota given back (its pod exists).
    committed = p1.status.model_copy(
        update={
            "barrier": req.barrier.model_copy(update={"state": "Committed", "cut_id": "c-6"}),
            "last_cut": CutRef(id="c-6", step=5, uri="s3://b/j/cuts/c-6", kind="barrier", time=iso(T0)),
        }
    )
    p2 = reconcile(world(evicted(), status=committed, pods=(running(),)))
    assert of(p2, DeletePod) == [DeletePod("j-controller-1")]
    assert of(p2, ReleaseQuota) == []

    # While the pod terminates, still nothing.
    going = replace(running(), deleting_since=T0)
    p3 = reconcile(world(evicted(), status=p2.status, pods=(going,)))
    assert of(p3, ReleaseQuota) == []

    # A worker pod still there holds it too (Kueue's IsActive is every pod of the job).
    worker = PodView(name="j-worker-1-0", attempt=1, phase="Running", node="spot-b", index=0)
    p3b = reconcile(world(evicted(), status=p3.status, workers=(worker,)))
    assert of(p3b, ReleaseQuota) == []

    # Gone: the quota goes back, the eviction record names the cut.
    p4 = reconcile(world(evicted(), now=T0 + timedelta(seconds=4), status=p3.status))
    assert of(p4, ReleaseQuota) == [ReleaseQuota("rljob-j-abcde", "Preempted", "Preempted to accommodate a workload")]
    assert p4.status is not None
    assert p4.status.phase == "Queued"
    assert p4.status.queue is not None
    assert p4.status.queue.last_eviction is not None
    assert p4.status.queue.last_eviction.cut_id == "c-6"
    assert "QuotaReleased" in events(p4)

    # Pending again (Evicted stays True while it waits), then admitted again: a resume, not a preemption.
    again = replace(evicted(), reserved=False, pending=("Pending", "Preempted to accommodate a workload"))
    p5 = reconcile(world(again, status=p4.status))
    assert of(p5, ReleaseQuota) == []
    assert of(p5, CreateControllerPod) == []
    p6 = reconcile(world(ADMITTED, status=p5.status))
    assert of(p6, CreateControllerPod) == [CreateControllerPod(2, frozenset())]
    assert p6.status is not None
    assert p6.status.preemptions == 0
    assert p6.status.barrier is None


def test_a_missed_barrier_still_gives_the_quota_back_once_the_pods_are_gone() -> None:
    st = RLJobStatus(phase="Running", attempt=1, step=5, step_attempt=1)
    p1 = reconcile(world(evicted(), status=st, pods=(running(),)))
    late = T0 + timedelta(seconds=21)
    p2 = reconcile(world(evicted(), now=late, status=p1.status, pods=(running(),)))
    assert of(p2, DeletePod) == [DeletePod("j-controller-1")]
    assert "BarrierMissed" in events(p2)
    p3 = reconcile(world(evicted(), now=late, status=p2.status))
    assert len(of(p3, ReleaseQuota)) == 1
    assert p3.status is not None
    assert p3.status.queue is not None
    assert p3.status.queue.last_eviction is not None
    assert p3.status.queue.last_eviction.cut_id is None


def test_a_job_the_operator_refuses_gets_no_workload() -> None:
    """A configuration the operator refuses (a refused namespace, a missing storage) fails the job
    before Kueue hears of it: no Workload to queue, in a namespace the operator may not write."""
    plan = reconcile(world(None, config_error="namespace kube-system is refused for jobs"))
    assert of(plan, CreateWorkload) == []
    assert plan.status is not None
    assert plan.status.phase == "Failed"


def test_changed_pod_sets_make_the_workload_again_once_no_pod_is_left() -> None:
    old = replace(ADMITTED, pod_sets="old")
    st = RLJobStatus(phase="Running", attempt=1)
    p1 = reconcile(world(old, status=st, pods=(running(),)))
    assert of(p1, DeleteWorkload) == [], "not while a pod runs"
    assert len(of(p1, RequestBarrier)) == 1
    p2 = reconcile(world(old, status=RLJobStatus(phase="Queued", attempt=1)))
    assert of(p2, DeleteWorkload) == [DeleteWorkload("rljob-j-abcde")]
    p3 = reconcile(world(None, status=p2.status))
    assert of(p3, CreateWorkload) == [CreateWorkload("lq")]


def test_the_end_of_the_job_finishes_the_workload() -> None:
    done = RLJobStatus(phase="Succeeded", attempt=1, step=30, message="trained 30 steps")
    plan = reconcile(world(ADMITTED, status=done))
    assert of(plan, FinishWorkload) == [FinishWorkload("rljob-j-abcde", True, "trained 30 steps")]
    finished = replace(ADMITTED, finished=True, in_use=True)
    plan = reconcile(world(finished, status=done))
    assert of(plan, FinishWorkload) == []
    assert of(plan, LetGoWorkload) == [LetGoWorkload("rljob-j-abcde")], "Finished: let go at once"
    assert of(reconcile(world(replace(finished, in_use=False), status=done)), LetGoWorkload) == []
    # A pod of the ended job still exiting keeps it.
    going = replace(running(), phase="Succeeded", deleting_since=T0)
    assert of(reconcile(world(finished, status=done, pods=(going,))), LetGoWorkload) == []


def test_a_deleted_workload_holds_the_job_and_is_let_go_only_once_its_pods_are_gone() -> None:
    """Kueue keeps a deleted Workload's quota in use while its finalizer is on: the job takes a
    barrier cut and stops, and only then is the finalizer taken off; then a new Workload."""
    deleting = replace(ADMITTED, deleting=True, in_use=True)
    st = RLJobStatus(phase="Running", attempt=1, step=5, step_attempt=1)
    p1 = reconcile(world(deleting, status=st, pods=(running(),)))
    (req,) = of(p1, RequestBarrier)
    assert req.barrier.reason == queueing.BARRIER_REASON
    assert of(p1, LetGoWorkload) == []
    assert of(p1, CreateWorkload) == [], "not while the old one exists"
    going = replace(running(), deleting_since=T0)
    assert of(reconcile(world(deleting, status=p1.status, pods=(going,))), LetGoWorkload) == []
    p2 = reconcile(world(deleting, status=p1.status))
    assert of(p2, LetGoWorkload) == [LetGoWorkload("rljob-j-abcde")]
    assert of(p2, CreateWorkload) == []
    assert p2.status is not None
    assert p2.status.phase == "Queued"
    p3 = reconcile(world(None, status=p2.status))
    assert of(p3, CreateWorkload) == [CreateWorkload("lq")]
    # One already let go (or never ours) is not patched again.
    assert of(reconcile(world(replace(deleting, in_use=False), status=p1.status)), LetGoWorkload) == []


def test_the_let_go_patch_takes_off_kueues_finalizer_alone_guarded_by_the_resource_version() -> None:
    meta = {"name": "w", "resourceVersion": "42", "finalizers": ["other.io/keep", queueing.IN_USE_FINALIZER]}
    assert queueing.let_go_patch({"metadata": meta}) == {
        "metadata": {"resourceVersion": "42", "finalizers": ["other.io/keep"]}
    }
    alone = {"metadata": {"resourceVersion": "7", "finalizers": [queueing.IN_USE_FINALIZER]}}
    assert queueing.let_go_patch(alone) == {"metadata": {"resourceVersion": "7", "finalizers": None}}
    assert queueing.let_go_patch({"metadata": {"resourceVersion": "7", "finalizers": ["other.io/keep"]}}) is None
    assert queueing.let_go_patch({"metadata": {}}) is None


def test_a_job_without_the_label_or_with_kueue_off_is_not_queued() -> None:
    plan = reconcile(replace(world(None), queue=None))
    assert of(plan, CreateControllerPod) == [CreateControllerPod(1, frozenset())]
    job = {"metadata": {"name": "j", "namespace": "ns", "uid": "u", "labels": {queueing.QUEUE_LABEL: "lq"}}}
    assert queue_view(Snapshot(job=job), SPEC, Settings(kueue=False)) is None
    view = queue_view(Snapshot(job=job), SPEC, Settings(kueue=True))
    assert view is not None
    assert view.name == "lq"
    assert view.workload is None


# ----------------------------------------------------------------------------- the Workload itself


def test_the_workload_has_one_pod_set_per_role_with_the_pods_requests() -> None:
    spec = parse_spec(
        {
            **SPEC.model_dump(by_alias=True, exclude_none=True, mode="json"),
            "standby": True,
            "generation": {"workerPods": True, "workers": 2, "resources": {"cpu": "3", "memory": "5Gi"}},
            "training": {"totalSteps": 30, "resources": {"cpu": "2", "memory": "6Gi"}},
        }
    )
    ref = JobRef("j", "ns", "uid-1")
    wl = queueing.workload(ref, spec, Settings(), "lq", queueing.Priority("WorkloadPriorityClass", "high", 1000))
    sets = {s["name"]: s for s in wl["spec"]["podSets"]}
    assert list(sets) == ["controller", "standby", "workers"]
    assert sets["workers"]["count"] == 2
    res = sets["workers"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert res == {"cpu": "3", "memory": "5Gi"}
    assert sets["controller"]["template"]["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "2"
    assert set(sets["controller"]["template"]) == {"metadata", "spec"}
    assert set(sets["controller"]["template"]["metadata"]) == {"labels"}, "Kueue allows labels and annotations only"
    assert wl["spec"]["queueName"] == "lq"
    assert wl["spec"]["priorityClassRef"] == {
        "group": "kueue.x-k8s.io",
        "kind": "WorkloadPriorityClass",
        "name": "high",
    }
    assert wl["spec"]["priority"] == 1000
    (owner,) = wl["metadata"]["ownerReferences"]
    assert owner["kind"] == "RLJob"
    assert owner["controller"] is True
    assert owner["uid"] == "uid-1"
    assert wl["metadata"]["finalizers"] == ["kueue.x-k8s.io/resource-in-use"], "Kueue's, as its job controllers set it"
    assert queueing.workload_view(trim_workload(wl)).in_use
    assert wl["metadata"]["name"] == queueing.workload_name("j", "uid-1")
    assert wl["metadata"]["name"] != queueing.workload_name("j", "uid-2"), "a job made again gets a new Workload"
    # A change of the pods is a change of the digest; one that leaves them alone is not.
    fewer = spec.model_copy(update={"generation": spec.generation.model_copy(update={"workers": 1})})
    assert (
        queueing.pod_sets_digest(queueing.pod_sets(ref, fewer, Settings()))
        != wl["metadata"]["annotations"][queueing.POD_SETS_ANNOTATION]
    )
    longer = spec.model_copy(update={"training": spec.training.model_copy(update={"total_steps": 99})})
    assert (
        queueing.pod_sets_digest(queueing.pod_sets(ref, longer, Settings()))
        == wl["metadata"]["annotations"][queueing.POD_SETS_ANNOTATION]
    )


WORKLOAD = {
    "metadata": {"name": "w", "generation": 1, "annotations": {queueing.POD_SETS_ANNOTATION: "d"}},
    "status": {
        "admission": {"clusterQueue": "cq", "podSetAssignments": [{"name": "controller", "flavors": {"cpu": "spot"}}]},
        "conditions": [
            {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "lastTransitionTime": "t0"},
            {"type": "Admitted", "status": "True", "reason": "Admitted", "lastTransitionTime": "t0"},
            {"type": "Evicted", "status": "True", "reason": "Preempted", "message": "m", "lastTransitionTime": "t1"},
            {"type": "Preempted", "status": "True", "reason": "InClusterQueue", "lastTransitionTime": "t1"},
        ],
    },
}


def test_a_workload_is_read_as_kueue_writes_it() -> None:
    view = queueing.workload_view(trim_workload(WORKLOAD))
    assert view.reserved
    assert view.admitted
    assert view.cluster_queue == "cq"
    assert view.evicted == ("Preempted", "m", "t1")
    assert dict(view.flavors) == {"controller": ("spot",)}
    flavors = {"spot": {"nodeLabels": {"pool": "spot"}, "tolerations": [{"key": "spot", "operator": "Exists"}]}}
    where = queueing.placement(view, flavors)["controller"]
    assert where.node_selector == {"pool": "spot"}
    assert where.tolerations[0].key == "spot"


@pytest.mark.parametrize(
    ("reason", "requeued"),
    [("Preempted", "True"), ("NodeFailures", "True"), ("PodsReadyTimeout", "False"), ("InactiveWorkload", "False")],
)
def test_the_release_patch_is_kueues_own_end_of_an_eviction(reason: str, requeued: str) -> None:
    now = T0
    patch = queueing.release_patch(WORKLOAD, reason, "m", now)
    assert patch["admission"] is None
    conds = {c["type"]: c for c in patch["conditions"]}
    assert conds["QuotaReserved"]["status"] == "False"
    assert conds["QuotaReserved"]["reason"] == "Pending"
    assert conds["QuotaReserved"]["lastTransitionTime"] == iso(now)
    assert conds["Admitted"]["status"] == "False"
    assert conds["Admitted"]["reason"] == "NoReservation"
    assert conds["Requeued"]["status"] == requeued
    assert conds["Requeued"]["reason"] == reason
    assert conds["Evicted"] == WORKLOAD["status"]["conditions"][2], "Kueue's own conditions are kept as they are"
    assert conds["QuotaReserved"]["observedGeneration"] == 1


def test_the_finish_patch_marks_succeeded_or_failed() -> None:
    ok = {c["type"]: c for c in queueing.finish_patch(WORKLOAD, True, "trained", T0)["conditions"]}
    assert ok["Finished"]["status"] == "True"
    assert ok["Finished"]["reason"] == "Succeeded"
    bad = {c["type"]: c for c in queueing.finish_patch(WORKLOAD, False, "crashed", T0)["conditions"]}
    assert bad["Finished"]["reason"] == "Failed"
    assert len(bad) == 5
