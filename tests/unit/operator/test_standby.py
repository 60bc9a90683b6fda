"""The warm standby controller (spec.standby) in the operator's pure lifecycle: when one is
made, when it is let go, how it takes over, and what it never does (hold the budget, make a
second attempt, loop when it cannot start)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from spotrl_operator.observe import Snapshot, world_of
from spotrl_operator.reconcile import reconcile
from spotrl_operator.recovery import compose
from spotrl_operator.resources import JobRef, controller_pod, disruption_budget
from spotrl_operator.settings import Settings
from spotrl_operator.world import (
    CreateControllerPod,
    DeletePod,
    Event,
    Plan,
    PodView,
    PromoteStandby,
    World,
)
from spotrl_runtime.api.rljob import AttemptTimes, BarrierStatus, RecoveryMarks, RLJobStatus, parse_spec
from spotrl_runtime.api.times import rfc3339 as iso
from spotrl_runtime.api.times import rfc3339_micro

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
SPEC_DOC = {
    "policy": {"model": "builtin:tiny-arith"},
    "dataset": {"uri": "builtin:arithmetic"},
    "reward": {"name": "arithmetic_exact"},
    "training": {"totalSteps": 30},
    "checkpoint": {"barrierDeadlineSeconds": 20, "storage": "s3://bucket/j"},
    "standby": True,
}
SPEC = parse_spec(SPEC_DOC)
COMMITTED = BarrierStatus(
    request_id="r", reason="cordon", attempt=1, state="Committed", cut_id="9", deadline=iso(T0), handled=True
)
TRAINING = RLJobStatus(phase="Running", attempt=1, step=3, step_attempt=1, controller_pod="j-controller-1")


REF = JobRef(name="j", namespace="ns", uid="u")


def rljob_doc() -> dict:
    """RLJob j at attempt 1, as the API server returns it (for :func:`world_of`)."""
    return {
        "apiVersion": "spotrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "j", "namespace": "ns", "uid": "u", "generation": 1, "resourceVersion": "5"},
        "spec": SPEC_DOC,
        "status": {"attempt": 1},
    }


def world(**kw: object) -> World:
    base = World(now=T0, generation=1, spec=SPEC, status=TRAINING, job="j")
    return replace(base, **kw)  # type: ignore[arg-type]


def of(plan: Plan, kind: type) -> list:
    return [a for a in plan.actions if isinstance(a, kind)]


def events(plan: Plan) -> list[str]:
    return [a.reason for a in of(plan, Event)]


def controller(attempt: int = 1, node: str = "spot-a", **kw: object) -> PodView:
    fields: dict = {"phase": "Running", **kw}
    return PodView(name=f"j-controller-{attempt}", attempt=attempt, node=node, **fields)


def standby(attempt: int = 2, node: str = "spot-b", phase: str = "Running", **kw: object) -> PodView:
    return PodView(name=f"j-controller-{attempt}", attempt=attempt, phase=phase, node=node, standby=True, **kw)  # type: ignore[arg-type]


def test_a_standby_is_made_for_the_next_attempt_off_the_controllers_node_once_it_trains() -> None:
    plan = reconcile(world(pods=(controller(),), avoid_nodes=frozenset({"gone"})))
    assert of(plan, CreateControllerPod) == [CreateControllerPod(2, frozenset({"spot-a", "gone"}), standby=True)]
    assert "StandbyCreated" in events(plan)
    assert plan.status is not None
    assert plan.status.attempt == 1, "a standby changes no attempt"
    # Named on the status in the same pass: the Event goes out with that write, and only then.
    assert plan.status.standby_pod == "j-controller-2"

    # Not before the controller trained a step of its attempt (its start would share the cores),
    # not while a barrier is in flight, not when the job does not ask for one.
    starting = TRAINING.model_copy(update={"step_attempt": None})
    assert of(reconcile(world(status=starting, pods=(controller(),))), CreateControllerPod) == []
    barrier = BarrierStatus(request_id="r", reason="cordon", attempt=1, state="Requested", deadline=iso(T0))
    cutting = TRAINING.model_copy(update={"barrier": barrier})
    assert of(reconcile(world(status=cutting, pods=(controller(),))), CreateControllerPod) == []
    off = parse_spec({**SPEC_DOC, "standby": False})
    assert of(reconcile(world(spec=off, pods=(controller(),))), CreateControllerPod) == []
    # One is enough: none while it runs, and none while it is still going (the name is taken).
    for other in (standby(), standby(phase="Pending", node=None), standby(deleting_since=T0)):
        assert of(reconcile(world(pods=(controller(),), standbys=(other,))), CreateControllerPod) == []


def test_a_running_standby_is_kept_and_named_on_the_status() -> None:
    plan = reconcile(world(pods=(controller(),), standbys=(standby(),)))
    assert of(plan, DeletePod) == []
    assert plan.status is not None
    assert plan.status.standby_pod == "j-controller-2"
    pending = reconcile(world(pods=(controller(),), standbys=(standby(phase="Pending", node=None),)))
    assert pending.status is not None
    assert pending.status.standby_pod == "j-controller-2", "named from its creation on"
    gone = reconcile(world(status=plan.status, pods=(controller(),), spec=parse_spec({**SPEC_DOC, "standby": False})))
    assert gone.status is not None
    assert gone.status.standby_pod is None


def test_a_standby_is_let_go_when_its_node_goes_the_job_stops_wanting_it_or_it_shares_the_node() -> None:
    spot_b = frozenset({"spot-b"})
    cases = {
        "its node has a notice": world(pods=(controller(),), standbys=(standby(),), unusable_nodes=spot_b),
        "spec.standby turned off": world(
            spec=parse_spec({**SPEC_DOC, "standby": False}), pods=(controller(),), standbys=(standby(),)
        ),
        "the job is done": world(status=TRAINING.model_copy(update={"phase": "Succeeded"}), standbys=(standby(),)),
        "suspended": world(spec=parse_spec({**SPEC_DOC, "suspend": True}), pods=(controller(),), standbys=(standby(),)),
        "on the controller's node": world(pods=(controller(),), standbys=(standby(node="spot-a"),)),
        "made for an attempt that is not the next": world(pods=(controller(),), standbys=(standby(attempt=3),)),
    }
    for why, w in cases.items():
        plan = reconcile(w)
        assert DeletePod(w.standbys[0].name) in of(plan, DeletePod), why
        made = (
            []
            if why != "made for an attempt that is not the next"
            else [CreateControllerPod(2, frozenset({"spot-a"}), True)]
        )
        assert of(plan, CreateControllerPod) == made, why
        assert "StandbyFailed" not in events(plan), why
    # Being deleted already: not again.
    going = reconcile(world(pods=(controller(),), standbys=(standby(deleting_since=T0),), unusable_nodes=spot_b))
    assert of(going, DeletePod) == []


def test_a_failed_standby_is_said_once_and_not_replaced_until_the_next_attempt() -> None:
    failed = standby(phase="Failed", exit_code=1, exit_message="ModuleNotFoundError: no module named x")
    plan = reconcile(world(pods=(controller(),), standbys=(failed,)))
    assert of(plan, DeletePod) == [DeletePod("j-controller-2")]
    assert "StandbyFailed" in events(plan)
    assert plan.status is not None
    assert plan.status.standby_failed_attempt == 1
    (said,) = [a.message for a in of(plan, Event) if a.reason == "StandbyFailed"]
    assert "ModuleNotFoundError" in said
    # Gone: no other for this attempt (a standby that cannot start must not loop).
    after = reconcile(world(status=plan.status, pods=(controller(),)))
    assert of(after, CreateControllerPod) == []
    # The next attempt may have one again.
    later = plan.status.model_copy(update={"attempt": 2, "step_attempt": 2, "controller_pod": "j-controller-2"})
    nxt = reconcile(world(status=later, pods=(controller(2, "spot-b"),)))
    assert of(nxt, CreateControllerPod) == [CreateControllerPod(3, frozenset({"spot-b"}), standby=True)]
    # One evicted with its node is not a failure: another is made once it is gone.
    evicted = standby(phase="Failed", exit_code=143, disruption="EvictionByEvictionAPI")
    plan = reconcile(world(pods=(controller(),), standbys=(evicted,)))
    assert "StandbyFailed" not in events(plan)
    assert plan.status is not None
    assert plan.status.standby_failed_attempt is None


def test_after_a_committed_barrier_the_standby_takes_over_as_the_next_attempt() -> None:
    """The lifecycle writes attempt 2 as always; the create is a no-op (the standby has the
    name) and the label comes off. Nothing makes a third attempt or deletes the standby."""
    barrier = COMMITTED
    st = TRAINING.model_copy(update={"barrier": barrier})
    old = controller(deleting_since=T0)
    spot_a = frozenset({"spot-a"})
    plan = reconcile(
        world(status=st, pods=(old,), standbys=(standby(),), pdb_open=True, unusable_nodes=spot_a, avoid_nodes=spot_a)
    )
    assert plan.status is not None
    assert (plan.status.attempt, plan.status.preemptions) == (2, 1)
    assert of(plan, PromoteStandby) == [PromoteStandby("j-controller-2")]
    assert of(plan, CreateControllerPod) == [CreateControllerPod(2, spot_a)]
    assert of(plan, DeletePod) == [], "the standby that takes over is not let go"
    assert "StandbyPromoted" in events(plan)
    assert plan.status.standby_pod is None

    # The next pass sees it as attempt 2's controller (the status reached its attempt), still
    # labelled if the label's removal has not landed: it is taken off again, nothing else.
    promoted = standby(attempt=2)
    w = world(status=plan.status, pods=(promoted,), unusable_nodes=spot_a)
    again = reconcile(w)
    assert again.status is not None
    assert again.status.controller_pod == "j-controller-2"
    assert of(again, PromoteStandby) == [PromoteStandby("j-controller-2")]
    assert of(again, CreateControllerPod) == []
    assert of(again, DeletePod) == []


def test_a_standby_that_cannot_take_over_goes_first_then_a_fresh_controller_is_made() -> None:
    barrier = COMMITTED
    st = TRAINING.model_copy(update={"barrier": barrier})
    both = frozenset({"spot-a", "spot-b"})
    for unusable in (
        standby(),  # its node got a notice too (a wave)
        standby(phase="Pending", node=None),  # never scheduled: placed against the old node
    ):
        w = world(status=st, pods=(controller(deleting_since=T0),), standbys=(unusable,), unusable_nodes=both)
        plan = reconcile(w)
        assert plan.status is not None
        assert plan.status.attempt == 1, "no attempt while its name is taken"
        assert DeletePod("j-controller-2") in of(plan, DeletePod)
        assert of(plan, CreateControllerPod) == []
        assert of(plan, PromoteStandby) == []
    # Gone: the fresh controller of attempt 2 as without a standby.
    plan = reconcile(world(status=st, pods=(), unusable_nodes=both, avoid_nodes=both))
    assert of(plan, CreateControllerPod) == [CreateControllerPod(2, both)]
    assert of(plan, PromoteStandby) == []


def test_a_crash_restart_takes_the_standby_too() -> None:
    crashed = controller(phase="Failed", exit_code=1)
    p1 = reconcile(world(pods=(crashed,), standbys=(standby(),)))
    assert p1.status is not None
    assert p1.status.restarts == 1
    assert of(p1, DeletePod) == [DeletePod("j-controller-1")], "the standby stays for the restart"
    later = T0 + timedelta(seconds=60)
    p2 = reconcile(world(now=later, status=p1.status, standbys=(standby(),)))
    assert p2.status is not None
    assert p2.status.attempt == 2
    assert of(p2, PromoteStandby) == [PromoteStandby("j-controller-2")]


def test_observed_a_standby_is_no_controller_until_the_status_reaches_its_attempt() -> None:
    settings = Settings()
    ref_job = rljob_doc()
    fresh = controller_pod(REF, SPEC, settings, 1)
    warm = controller_pod(REF, SPEC, settings, 2, ("spot-a",), standby=True)
    assert "spotrl.dev/standby" not in fresh["metadata"]["labels"]
    assert warm["metadata"]["labels"]["spotrl.dev/standby"] == "true"
    assert warm["metadata"]["name"] == "j-controller-2", "the next attempt's own name"
    w = world_of(Snapshot(job=ref_job, pods=(fresh, warm)), settings, T0)
    assert [p.name for p in w.pods] == ["j-controller-1"]
    assert [p.name for p in w.standbys] == ["j-controller-2"]
    # The status reached attempt 2: it is the controller, even before its label comes off.
    ref_job["status"] = {"attempt": 2}
    w = world_of(Snapshot(job=ref_job, pods=(fresh, warm)), settings, T0)
    assert [p.name for p in w.pods] == ["j-controller-1", "j-controller-2"]
    assert w.standbys == ()
    assert w.pods[1].standby
    # A controller pod without the label is never a standby, whatever its attempt.
    ref_job["status"] = {"attempt": 0}
    w = world_of(Snapshot(job=ref_job, pods=(fresh,)), settings, T0)
    assert [p.name for p in w.pods] == ["j-controller-1"]
    assert w.standbys == ()
    # The budget holds no pod that carries the label.
    exprs = disruption_budget(REF, open_=False)["spec"]["selector"]["matchExpressions"]
    assert {"key": "spotrl.dev/standby", "operator": "DoesNotExist"} in exprs


def test_a_recovery_by_the_standby_has_no_scheduling_phase() -> None:
    """Marked when the standby is promoted, not guessed from times: a fresh pod's PodScheduled
    has whole seconds, and a recovery can take less than one."""
    marks = RecoveryMarks(
        attempt=1,
        notice_at=rfc3339_micro(T0 + timedelta(seconds=0.5)),
        requested_at=rfc3339_micro(T0 + timedelta(seconds=0.5)),
        committed_at=rfc3339_micro(T0 + timedelta(seconds=0.8)),
        pod_deleted_at=rfc3339_micro(T0 + timedelta(seconds=0.9)),
    )
    t = AttemptTimes(
        attempt=2,
        started_at=rfc3339_micro(T0 + timedelta(seconds=1.0)),
        restored_at=rfc3339_micro(T0 + timedelta(seconds=2)),
        ready_at=rfc3339_micro(T0 + timedelta(seconds=2.5)),
        first_step_at=rfc3339_micro(T0 + timedelta(seconds=3)),
    )
    fresh = compose(marks, t, 2, T0, T0 + timedelta(seconds=4))  # scheduled at T0.95, truncated to T0
    assert not fresh.standby
    assert fresh.scheduled_at == iso(T0)
    assert fresh.phases.scheduled_to_started == 1.0
    took_over = compose(marks.model_copy(update={"standby": True}), t, 2, T0 - timedelta(minutes=5), T0)
    assert took_over.standby
    assert took_over.scheduled_at is None
    assert took_over.phases.deleted_to_scheduled is None
    assert took_over.phases.scheduled_to_started is None
    assert took_over.total_seconds == 2.5


def test_the_promotion_marks_the_recovery() -> None:
    barrier = COMMITTED
    marks = RecoveryMarks(attempt=1, notice_at=rfc3339_micro(T0), requested_at=rfc3339_micro(T0))
    st = TRAINING.model_copy(update={"barrier": barrier, "recovering": marks})
    old = (controller(deleting_since=T0),)
    with_standby = reconcile(world(status=st, pods=old, standbys=(standby(),)))
    without = reconcile(world(status=st, pods=old))
    assert with_standby.status is not None
    assert without.status is not None
    assert with_standby.status.recovering is not None
    assert without.status.recovering is not None
    assert with_standby.status.recovering.standby
    assert not without.status.recovering.standby


def test_a_standby_on_a_node_that_stopped_answering_is_force_deleted_and_never_waited_for() -> None:
    """A graceful delete on a dead node never completes; the standby holds nothing and its name
    is the next attempt's, so it is force-deleted (again each pass) instead of blocking it."""
    lost = frozenset({"spot-b"})
    going = standby(deleting_since=T0)
    plan = reconcile(world(pods=(controller(),), standbys=(going,), lost_nodes=lost, unusable_nodes=lost))
    assert of(plan, DeletePod) == [DeletePod("j-controller-2", force=True)]
    # The controller's node goes too (a wave): the lifecycle force-deletes it rather than wait.
    both = frozenset({"spot-a", "spot-b"})
    st = TRAINING.model_copy(update={"barrier": COMMITTED})
    w = world(status=st, pods=(controller(deleting_since=T0),), standbys=(standby(),), lost_nodes=both)
    plan = reconcile(replace(w, unusable_nodes=both))
    assert DeletePod("j-controller-2", force=True) in of(plan, DeletePod)
    assert of(plan, PromoteStandby) == []


def test_a_standby_whose_node_object_is_gone_is_on_a_lost_node() -> None:
    settings = Settings()
    doc = rljob_doc()
    warm = controller_pod(REF, SPEC, settings, 2, standby=True)
    warm["spec"]["nodeName"] = "deleted-node"
    w = world_of(Snapshot(job=doc, pods=(warm,), nodes={}), settings, T0)
    assert "deleted-node" in w.lost_nodes
    assert "deleted-node" in w.unusable_nodes
