"""A recovery phase by phase: the operator's marks, the fresh pod's scheduling and the
controller's times composed into status.lastRecovery, one Recovered Event."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from spotrl_operator import recovery
from spotrl_operator.reconcile import reconcile
from spotrl_operator.signals import Signal, node_signals
from spotrl_operator.world import Event, Plan, PodView, RequestBarrier, World
from spotrl_runtime.api.rljob import AttemptTimes, RecoveryMarks, RLJobStatus, parse_spec
from spotrl_runtime.api.times import rfc3339 as iso
from spotrl_runtime.api.times import rfc3339_micro as micro

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
SPEC = parse_spec(
    {
        "policy": {"model": "builtin:tiny-arith"},
        "dataset": {"uri": "builtin:arithmetic"},
        "reward": {"name": "arithmetic_exact"},
        "training": {"totalSteps": 30},
        "checkpoint": {"barrierDeadlineSeconds": 20},
    }
)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def world(**kw: object) -> World:
    return replace(World(now=T0, generation=1, spec=SPEC, status=RLJobStatus()), **kw)  # type: ignore[arg-type]


def pod(attempt: int, node: str, scheduled: datetime | None = None) -> PodView:
    return PodView(f"j-controller-{attempt}", attempt, "Running", node=node, scheduled_at=scheduled)


def events(plan: Plan, reason: str) -> list[Event]:
    return [a for a in plan.actions if isinstance(a, Event) and a.reason == reason]


def test_a_barrier_recovery_has_every_phase_in_order() -> None:
    notice = Signal("taint", "spot-a", "aws-node-termination-handler/spot-itn", since=at(-0.5))
    st = RLJobStatus(phase="Running", attempt=1, step=7, step_attempt=1)
    p1 = reconcile(world(status=st, pods=(pod(1, "spot-a"),), signals=(notice,)))
    (req,) = [a for a in p1.actions if isinstance(a, RequestBarrier)]
    assert p1.status is not None
    assert p1.status.recovering is not None
    assert p1.status.recovering.notice_at == micro(at(-0.5)), "the notice's own time, not the operator's"
    assert p1.status.recovering.requested_at == micro(T0)

    answered = p1.status.model_copy(
        update={"barrier": req.barrier.model_copy(update={"state": "Committed", "committed_at": micro(at(1.25))})}
    )
    p2 = reconcile(world(now=at(2), status=answered, pods=(pod(1, "spot-a"),), signals=(notice,)))
    assert p2.status is not None
    assert p2.status.recovering is not None
    assert p2.status.recovering.committed_at == micro(at(1.25))

    p3 = reconcile(world(now=at(5), status=p2.status))  # the old pod is gone: attempt 2
    assert p3.status is not None
    assert p3.status.attempt == 2
    assert p3.status.barrier is None
    assert p3.status.recovering is not None, "the marks outlive the cleared barrier"
    assert p3.status.recovering.pod_deleted_at == micro(at(5))

    controller = AttemptTimes(
        attempt=2,
        started_at=micro(at(9)),
        restored_at=micro(at(20)),
        ready_at=micro(at(26)),
        first_step_at=micro(at(27.5)),
    )
    back = p3.status.model_copy(update={"step": 8, "step_attempt": 2, "attempt_times": controller})
    p4 = reconcile(world(now=at(28), status=back, pods=(pod(2, "spot-b", scheduled=at(6)),)))
    assert p4.status is not None
    rec = p4.status.last_recovery
    assert rec is not None
    assert rec.attempt == 2
    assert rec.kind == "barrier"
    assert [s for _, s in recovery.phase_seconds(rec)] == [0.5, 1.25, 3.75, 1.0, 3.0, 11.0, 6.0, 1.5]
    assert rec.total_seconds == 28.0
    assert rec.seconds_lost == 26.0, "secondsLost's share: from when training stopped (no cut on the status)"
    assert p4.status.recovering is None
    (said,) = events(p4, "Recovered")
    assert "requested->committed 1.2s" in said.message or "requested->committed 1.3s" in said.message
    assert "total 28.0s" in said.message

    # Said once: the next pass composes nothing again.
    p5 = reconcile(world(now=at(40), status=p4.status, pods=(pod(2, "spot-b", scheduled=at(6)),)))
    assert events(p5, "Recovered") == []
    assert p5.status is not None
    assert p5.status.last_recovery == rec


def test_an_abrupt_loss_measures_from_the_interruption() -> None:
    st = RLJobStatus(phase="Running", attempt=1, step=4, step_attempt=1)
    lost = Signal("node-not-ready", "spot-a", "NodeStatusUnknown")
    p1 = reconcile(world(status=st, pods=(pod(1, "spot-a"),), signals=(lost,), lost_nodes=frozenset({"spot-a"})))
    assert p1.status is not None
    assert p1.status.recovering is not None
    assert p1.status.recovering.notice_at is None
    assert p1.status.recovering.interrupted_at == micro(T0)
    p2 = reconcile(world(now=at(3), status=p1.status))
    assert p2.status is not None
    assert p2.status.attempt == 2
    back = p2.status.model_copy(
        update={"step": 2, "step_attempt": 2, "attempt_times": AttemptTimes(attempt=2, first_step_at=micro(at(30)))}
    )
    p3 = reconcile(world(now=at(31), status=back, pods=(pod(2, "spot-b", scheduled=at(4)),)))
    assert p3.status is not None
    rec = p3.status.last_recovery
    assert rec is not None
    assert rec.kind == "abrupt"
    assert rec.phases.notice_to_requested is None
    assert rec.phases.requested_to_committed is None
    assert rec.phases.committed_to_deleted == 3.0
    assert rec.phases.deleted_to_scheduled == 1.0
    assert rec.total_seconds == 30.0
    assert len(events(p3, "Recovered")) == 1


def test_a_crash_restart_is_no_recovery() -> None:
    st = RLJobStatus(phase="Running", attempt=1, step=4, step_attempt=1)
    crashed = replace(pod(1, "spot-a"), phase="Failed", exit_code=1)
    p1 = reconcile(world(status=st, pods=(crashed,)))
    assert p1.status is not None
    p2 = reconcile(world(now=at(60), status=p1.status))
    assert p2.status is not None
    assert p2.status.attempt == 2
    assert p2.status.recovering is None
    back = p2.status.model_copy(update={"step": 5, "step_attempt": 2})
    p3 = reconcile(world(now=at(70), status=back, pods=(pod(2, "spot-b"),)))
    assert p3.status is not None
    assert p3.status.last_recovery is None
    assert events(p3, "Recovered") == []


def test_compose_ignores_another_attempts_times() -> None:
    marks = RecoveryMarks(attempt=1, requested_at=micro(T0), committed_at=micro(at(2)), pod_deleted_at=micro(at(3)))
    stale = AttemptTimes(attempt=1, started_at=micro(at(-100)), first_step_at=micro(at(-50)))
    rec = recovery.compose(marks, stale, 2, None, at(10))
    assert rec.started_at is None, "attempt 1's start is not attempt 2's"
    assert rec.first_step_at == micro(at(10)), "without the controller's time: when the operator saw the step"
    assert rec.phases.requested_to_committed == 2.0
    assert rec.phases.scheduled_to_started is None
    assert rec.total_seconds == 10.0
    # Marks of the attempt that recovered (not of an earlier one) are not its recovery's.
    assert recovery.compose(marks.model_copy(update={"attempt": 2}), None, 2, None, at(10)).requested_at is None


def test_clock_skew_never_gives_a_negative_phase() -> None:
    marks = RecoveryMarks(attempt=1, pod_deleted_at=micro(at(5)))
    times = AttemptTimes(attempt=2, started_at=micro(at(4)), restored_at=micro(at(6)), first_step_at=micro(at(7)))
    rec = recovery.compose(marks, times, 2, at(5.5), at(8))
    assert rec.phases.scheduled_to_started == 0.0
    assert all(s >= 0 for _, s in recovery.phase_seconds(rec))


def test_signals_carry_the_time_the_notice_began() -> None:
    node = {
        "metadata": {"name": "spot-a"},
        "spec": {"taints": [{"key": "karpenter.sh/disrupted", "effect": "NoExecute", "timeAdded": iso(T0)}]},
        "status": {"conditions": [{"type": "Ready", "status": "Unknown", "lastTransitionTime": iso(at(3))}]},
    }
    taint, not_ready = node_signals(node)
    assert taint.since == T0
    assert not_ready.since == at(3)
    assert taint == Signal("taint", "spot-a", "karpenter.sh/disrupted"), "the time is measured, never compared"


def test_a_recovery_from_a_delta_cut_says_how_many_steps_were_redone() -> None:
    marks = RecoveryMarks(
        attempt=1, requested_at=micro(at(0)), committed_at=micro(at(0.4)), pod_deleted_at=micro(at(2))
    )
    times = AttemptTimes(
        attempt=2,
        started_at=micro(at(3)),
        restored_at=micro(at(9)),
        ready_at=micro(at(10)),
        cut_form="delta",
        steps_redone=2,
    )
    rec = recovery.compose(marks, times, 2, at(2.5), at(11))
    assert (rec.kind, rec.cut_form, rec.steps_redone) == ("barrier", "delta", 2)
    assert "barrier, from a delta cut: 2 step(s) redone" in recovery.describe(rec)
    full = recovery.compose(marks, times.model_copy(update={"cut_form": "full", "steps_redone": 0}), 2, at(2.5), at(11))
    assert full.cut_form == "full"
    assert "delta" not in recovery.describe(full)
    other = recovery.compose(marks, times.model_copy(update={"attempt": 3}), 2, at(2.5), at(11))
    assert (other.cut_form, other.steps_redone) == (None, 0), "another attempt's times say nothing of this one"
