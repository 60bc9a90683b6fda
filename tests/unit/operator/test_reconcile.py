"""The RLJob lifecycle state machine, driven through whole scenarios without a cluster."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from spotrl_operator.reconcile import barrier_id, reconcile
from spotrl_operator.signals import Signal
from spotrl_operator.workers import worker_backoff
from spotrl_operator.world import (
    CloseDisruptionBudget,
    CreateControllerPod,
    CreateWorkerPod,
    DeletePod,
    Event,
    OpenDisruptionBudget,
    Plan,
    PodView,
    RequestBarrier,
    World,
)
from spotrl_runtime.api.rljob import CutRef, FailureBudget, RayHead, RLJobStatus, parse_spec
from spotrl_runtime.api.times import rfc3339 as iso

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
SPEC = parse_spec(
    {
        "policy": {"model": "builtin:tiny-arith"},
        "dataset": {"uri": "builtin:arithmetic"},
        "reward": {"name": "arithmetic_exact"},
        "training": {"totalSteps": 30},
        "checkpoint": {"barrierDeadlineSeconds": 20},
        "failureBudget": {"maxCrashes": 2, "backoffSeconds": 10},
    }
)


def world(**kw: object) -> World:
    base = World(now=T0, generation=1, spec=SPEC, status=RLJobStatus())
    return replace(base, **kw)  # type: ignore[arg-type]


def of(plan: Plan, kind: type) -> list:
    return [a for a in plan.actions if isinstance(a, kind)]


def events(plan: Plan) -> list[str]:
    return [a.reason for a in of(plan, Event)]


def running(attempt: int = 1, node: str = "spot-a") -> PodView:
    return PodView(name=f"j-controller-{attempt}", attempt=attempt, phase="Running", node=node)


def test_a_new_job_gets_its_first_controller() -> None:
    plan = reconcile(world())
    assert of(plan, CreateControllerPod) == [CreateControllerPod(1, frozenset())]
    assert plan.status is not None
    assert plan.status.phase == "Pending"
    assert plan.status.attempt == 1
    assert plan.status.preemptions == 0
    assert plan.status.total_steps == 30
    assert "ControllerCreated" in events(plan)


def test_a_running_controller_is_reported_with_a_condition() -> None:
    plan = reconcile(world(status=RLJobStatus(phase="Pending", attempt=1), pods=(running(),)))
    assert plan.status is not None
    assert plan.status.phase == "Running"
    assert [c.type for c in plan.status.conditions] == ["Running"]
    assert plan.status.conditions[0].last_transition_time == iso(T0)
    assert of(plan, CreateControllerPod) == []


def test_a_graceful_preemption_end_to_end() -> None:
    """Notice → barrier (PDB stays closed) → commit → PDB opens, pod moves → fresh controller."""
    st = RLJobStatus(phase="Running", attempt=1, step=7, step_attempt=1)
    notice = Signal("taint", "spot-a", "aws-node-termination-handler/spot-itn")

    p1 = reconcile(world(status=st, pods=(running(),), signals=(notice,), unusable_nodes=frozenset({"spot-a"})))
    (req,) = of(p1, RequestBarrier)
    assert req.provider == "aws-node-termination-handler", "the metrics count barriers by who sent the notice"
    assert req.barrier.request_id == barrier_id(notice.reason, "j-controller-1")
    assert req.barrier.deadline == iso(T0 + timedelta(seconds=20))
    assert of(p1, OpenDisruptionBudget) == []
    assert of(p1, DeletePod) == []
    assert p1.status is not None
    assert p1.status.phase == "Checkpointing"
    assert "PreemptionNotice" in events(p1)

    # While the controller cuts, nothing else happens: no second request, the PDB holds.
    t1 = T0 + timedelta(seconds=3)
    p2 = reconcile(world(now=t1, status=p1.status, pods=(running(),), signals=(notice,)))
    assert of(p2, RequestBarrier) == []
    assert of(p2, OpenDisruptionBudget) == []

    # The controller commits: the PDB opens and the controller leaves the node.
    t0c = t1 - timedelta(seconds=1)
    committed = p1.status.model_copy(
        update={
            "barrier": req.barrier.model_copy(update={"state": "Committed", "cut_id": "c-8"}),
            "last_cut": CutRef(id="c-8", step=7, uri="s3://b/j/cuts/c-8", kind="barrier", time=iso(t0c)),
        }
    )
    p3 = reconcile(world(now=t1, status=committed, pods=(running(),), signals=(notice,)))
    assert of(p3, OpenDisruptionBudget) == [OpenDisruptionBudget()]
    assert of(p3, DeletePod) == [DeletePod("j-controller-1")]
    assert p3.status is not None
    assert p3.status.interrupted_at == iso(t0c), "training stopped at the barrier cut's commit"
    assert "BarrierCommitted" in events(p3)
    assert p3.status.barrier is not None
    assert p3.status.barrier.handled, "the answer is marked as acted on"
    # A pass from a stale cache (the pod not yet seen deleting) acts again but says nothing new.
    again = reconcile(world(now=t1, status=p3.status, pods=(running(),), signals=(notice,)))
    assert of(again, DeletePod) == [DeletePod("j-controller-1")]
    assert "BarrierCommitted" not in events(again)

    # The old pod is terminating after its commit: a fresh controller at once, without waiting
    # for it to exit (test_after_a_committed_barrier_only_the_fresh_controller_does_not_wait),
    # away from the draining node, and the PDB closes.
    t2 = t1 + timedelta(seconds=1)
    terminating = replace(running(), deleting_since=t1)
    spot_a = frozenset({"spot-a"})
    p5 = reconcile(
        world(now=t2, status=p3.status, pods=(terminating,), pdb_open=True, unusable_nodes=spot_a, avoid_nodes=spot_a)
    )
    assert of(p5, CreateControllerPod) == [CreateControllerPod(2, frozenset({"spot-a"}))]
    assert of(p5, CloseDisruptionBudget) == [CloseDisruptionBudget()]
    assert p5.status is not None
    assert p5.status.preemptions == 1
    assert p5.status.restarts == 0
    assert p5.status.barrier is None

    # The fresh controller trains its first step: the time lost is accounted once.
    t3 = t2 + timedelta(seconds=12)
    back = p5.status.model_copy(update={"step": 8, "step_attempt": 2})
    p6 = reconcile(world(now=t3, status=back, pods=(running(2, "spot-b"),)))
    assert p6.status is not None
    assert p6.status.seconds_lost == (t3 - t0c).total_seconds()
    assert p6.status.interrupted_at is None
    assert p6.status.phase == "Running"
    p7 = reconcile(world(now=t3 + timedelta(seconds=9), status=p6.status, pods=(running(2, "spot-b"),)))
    assert p7.status is not None
    assert p7.status.seconds_lost == p6.status.seconds_lost


def test_the_same_world_gives_the_same_barrier_after_an_operator_restart() -> None:
    st = RLJobStatus(phase="Running", attempt=1)
    notice = Signal("cordon", "spot-a", "spec.unschedulable")
    a = reconcile(world(status=st, pods=(running(),), signals=(notice,)))
    b = reconcile(world(now=T0 + timedelta(seconds=1), status=st, pods=(running(),), signals=(notice,)))
    assert of(a, RequestBarrier)[0].barrier.request_id == of(b, RequestBarrier)[0].barrier.request_id


def test_a_missed_deadline_is_reported_and_falls_back() -> None:
    notice = Signal("taint", "spot-a", "karpenter.sh/disrupted")
    p1 = reconcile(world(status=RLJobStatus(phase="Running", attempt=1), pods=(running(),), signals=(notice,)))
    assert p1.status is not None
    late = T0 + timedelta(seconds=21)
    p2 = reconcile(world(now=late, status=p1.status, pods=(running(),), signals=(notice,)))
    assert p2.status is not None
    assert p2.status.barrier is not None
    assert p2.status.barrier.state == "Missed"
    assert "BarrierMissed" in events(p2)
    assert any(c.type == "BarrierMissed" and c.status == "True" for c in p2.status.conditions)
    assert of(p2, OpenDisruptionBudget) == [OpenDisruptionBudget()]
    assert of(p2, DeletePod) == [DeletePod("j-controller-1")]


def test_after_a_committed_barrier_only_the_fresh_controller_does_not_wait() -> None:
    """A controller being deleted may still write its SIGTERM cut, which the next attempt must
    resume from: the fresh controller waits for it to exit. Not once its barrier committed (it
    makes no more moves): then the next attempt starts while the old pod terminates."""
    notice = Signal("taint", "spot-a", "karpenter.sh/disrupted")
    p1 = reconcile(world(status=RLJobStatus(phase="Running", attempt=1), pods=(running(),), signals=(notice,)))
    assert p1.status is not None
    assert p1.status.barrier is not None
    terminating = replace(running(), deleting_since=T0)

    def starts(barrier_update: dict[str, object] | None) -> list[CreateControllerPod]:
        barrier = None if barrier_update is None else p1.status.barrier.model_copy(update=barrier_update)
        st = p1.status.model_copy(update={"barrier": barrier})
        return of(reconcile(world(now=T0 + timedelta(seconds=1), status=st, pods=(terminating,))), CreateControllerPod)

    assert starts({"state": "Committed", "cut_id": "c-8"}) == [CreateControllerPod(2, frozenset())]
    assert starts({"state": "Requested"}) == [], "still cutting"
    assert starts({"state": "Missed"}) == [], "its SIGTERM may still cut"
    assert starts({"state": "Failed"}) == [], "its SIGTERM may still cut"
    assert starts(None) == [], "no barrier (evicted, drained without notice): its SIGTERM cuts"
    assert starts({"state": "Committed", "attempt": 0}) == [], "a commit of another attempt says nothing of this pod"

    # Attempt 2 is on the status; its pod not yet seen while attempt 1's still terminates: the
    # pass creates attempt 2 again (same name: a no-op), never a third, and does not wait.
    committed = p1.status.model_copy(update={"barrier": p1.status.barrier.model_copy(update={"state": "Committed"})})
    p2 = reconcile(world(now=T0 + timedelta(seconds=1), status=committed, pods=(terminating,)))
    assert p2.status is not None
    assert p2.status.attempt == 2
    assert p2.status.barrier is None
    p3 = reconcile(world(now=T0 + timedelta(seconds=2), status=p2.status, pods=(terminating,)))
    assert of(p3, CreateControllerPod) == [CreateControllerPod(2, frozenset())]
    assert p3.status is not None
    assert p3.status.attempt == 2
    assert p3.status.preemptions == 1


def test_an_older_attempts_pod_in_a_lagging_view_is_let_go_not_taken_for_the_controller() -> None:
    """After attempt 2 was created (its pod seen or not), a pod cache behind a fresh read may
    still show attempt 1's pod as not deleting: it is deleted again and nothing else happens
    (no barrier for it, no crash counted, attempt 2's pod not thought lost)."""
    notice = Signal("taint", "spot-a", "karpenter.sh/disrupted")
    for seen in (None, "j-controller-2"):
        st = RLJobStatus(phase="Rescheduling", attempt=2, restarts=0, preemptions=1, controller_pod=seen)
        for old in (running(), replace(running(), phase="Failed", exit_code=1)):
            plan = reconcile(world(status=st, pods=(old,), signals=(notice,)))
            assert plan.actions == [DeletePod("j-controller-1")], plan.actions
            after = plan.status or st  # None: the status is left as it was
            assert (after.attempt, after.restarts, after.barrier, after.controller_pod) == (2, 0, None, seen)
    # Once the view catches up, attempt 2's unseen pod is created again (same name), not counted lost.
    fresh = reconcile(world(status=RLJobStatus(phase="Rescheduling", attempt=2, preemptions=1)))
    assert of(fresh, CreateControllerPod) == [CreateControllerPod(2, frozenset())]
    assert fresh.status is not None
    assert (fresh.status.attempt, fresh.status.preemptions) == (2, 1)


def test_an_abrupt_node_loss_gets_no_barrier_and_a_forced_delete() -> None:
    st = RLJobStatus(phase="Running", attempt=1)
    lost = Signal("node-not-ready", "spot-a", "NodeStatusUnknown")
    plan = reconcile(world(status=st, pods=(running(),), signals=(lost,), lost_nodes=frozenset({"spot-a"})))
    assert of(plan, RequestBarrier) == []
    assert of(plan, DeletePod) == [DeletePod("j-controller-1", force=True)]
    assert "NodeLost" in events(plan)

    # Evicted by the taint manager, stuck terminating on the dead node: force it after a grace.
    stuck = replace(running(), deleting_since=T0)
    early = reconcile(
        world(now=T0 + timedelta(seconds=1), status=plan.status, pods=(stuck,), lost_nodes=frozenset({"spot-a"}))
    )
    assert of(early, DeletePod) == []
    assert of(early, CreateControllerPod), "a pod on a lost node does not block the fresh controller"
    later = reconcile(
        world(now=T0 + timedelta(seconds=6), status=plan.status, pods=(stuck,), lost_nodes=frozenset({"spot-a"}))
    )
    assert DeletePod("j-controller-1", force=True) in of(later, DeletePod)


def test_a_controller_evicted_before_its_node_counts_as_lost_is_reported_lost() -> None:
    """The taint manager evicts the controller while its zone pauses force deletes; when the
    node counts as lost, the next attempt starts and the Event says why, as for a force delete."""
    st = RLJobStatus(phase="Running", attempt=1, controller_pod="j-controller-1", controller_node="spot-a")
    evicted = replace(running(), deleting_since=T0)
    paused = reconcile(world(now=T0 + timedelta(seconds=6), status=st, pods=(evicted,)))
    assert "NodeLost" not in events(paused)
    lost = reconcile(world(now=T0 + timedelta(seconds=6), status=st, pods=(evicted,), lost_nodes=frozenset({"spot-a"})))
    assert of(lost, CreateControllerPod) == [CreateControllerPod(2, frozenset())]
    assert DeletePod("j-controller-1", force=True) in of(lost, DeletePod)
    assert "NodeLost" in events(lost)


def test_time_lost_counts_from_the_newest_safe_progress_and_never_twice() -> None:
    """An abrupt loss loses the steps after the newest periodic cut: secondsLost counts from that
    cut's commit, or from when the controller resumed if it has cut nothing since."""
    p0 = reconcile(world(status=RLJobStatus()))
    assert p0.status is not None
    assert p0.status.training_since == iso(T0), "attempt 1 trains from its creation"
    cut = CutRef(id="c-4", step=4, uri="s3://b/j/cuts/c-4", time=iso(T0 + timedelta(seconds=100)))
    st = p0.status.model_copy(update={"phase": "Running", "step": 6, "step_attempt": 1, "last_cut": cut})
    gone = frozenset({"spot-a"})

    # The node is lost at +160 s: the work since the cut at +100 s is lost with it.
    t1 = T0 + timedelta(seconds=160)
    p1 = reconcile(world(now=t1, status=st, pods=(running(),), lost_nodes=gone))
    assert p1.status is not None
    assert p1.status.interrupted_at == iso(T0 + timedelta(seconds=100))
    p2 = reconcile(world(now=t1, status=p1.status, unusable_nodes=gone, avoid_nodes=gone))
    assert of(p2, CreateControllerPod) == [CreateControllerPod(2, gone)]
    assert p2.status is not None
    t2 = T0 + timedelta(seconds=220)  # attempt 2 trains step 5 again, from the cut
    p3 = reconcile(
        world(now=t2, status=p2.status.model_copy(update={"step": 5, "step_attempt": 2}), pods=(running(2),))
    )
    assert p3.status is not None
    assert p3.status.seconds_lost == 120.0
    assert p3.status.training_since == iso(t2)

    # Lost again at +250 s before attempt 2 cut anything: from its resume, not from the old cut.
    t3 = T0 + timedelta(seconds=250)
    p4 = reconcile(world(now=t3, status=p3.status, pods=(running(2),), lost_nodes=gone))
    assert p4.status is not None
    assert p4.status.interrupted_at == iso(t2)

    # A cut stamped ahead of the operator's clock (skew) counts from now, never from the future.
    ahead = st.model_copy(update={"last_cut": cut.model_copy(update={"time": iso(t1 + timedelta(seconds=30))})})
    p5 = reconcile(world(now=t1, status=ahead, pods=(running(),), lost_nodes=gone))
    assert p5.status is not None
    assert p5.status.interrupted_at == iso(t1)


def test_crashes_back_off_count_against_the_budget_and_finally_fail() -> None:
    st = RLJobStatus(phase="Running", attempt=1, step=3)
    crashed = replace(running(), phase="Failed", exit_code=1)
    p1 = reconcile(world(status=st, pods=(crashed,)))
    assert p1.status is not None
    assert p1.status.restarts == 1
    assert p1.status.preemptions == 0
    assert p1.status.retry_after == iso(T0 + timedelta(seconds=10))
    assert "ControllerCrashed" in events(p1)

    # A pass whose pod cache has not seen the deletion yet (or a restarted operator) finds the
    # same failed pod again: the crash is not counted twice, and its backoff does not move.
    again = reconcile(world(now=T0 + timedelta(seconds=1), status=p1.status, pods=(crashed,)))
    assert again.status is not None
    assert (again.status.restarts, again.status.retry_after) == (1, p1.status.retry_after)
    assert of(again, DeletePod) == [DeletePod("j-controller-1")]
    assert "ControllerCrashed" not in events(again)

    # Before the backoff ends nothing starts; after it, attempt 2 starts and is no preemption.
    wait = reconcile(world(now=T0 + timedelta(seconds=5), status=p1.status))
    assert of(wait, CreateControllerPod) == []
    assert wait.requeue_after == 5.0
    p2 = reconcile(world(now=T0 + timedelta(seconds=10), status=p1.status))
    assert of(p2, CreateControllerPod) == [CreateControllerPod(2, frozenset())]
    assert p2.status is not None
    assert p2.status.preemptions == 0
    # A cache behind a fresh read still shows attempt 1's failed pod after attempt 2 was created.
    stale = reconcile(world(now=T0 + timedelta(seconds=11), status=p2.status, pods=(crashed,)))
    assert stale.status is not None
    assert (stale.status.restarts, stale.status.attempt) == (1, 2)
    assert stale.status.controller_pod is None, "attempt 2's pod is not seen yet: it is created again, not lost"
    assert of(reconcile(world(now=T0 + timedelta(seconds=12), status=stale.status)), CreateControllerPod) == [
        CreateControllerPod(2, frozenset())
    ]
    assert of(stale, DeletePod) == [DeletePod("j-controller-1")]
    assert "ControllerCrashed" not in events(stale)

    # Second crash doubles the wait; the third exceeds maxCrashes=2.
    p3 = reconcile(
        world(
            now=T0 + timedelta(seconds=30), status=p2.status, pods=(replace(crashed, attempt=2, name="j-controller-2"),)
        )
    )
    assert p3.status is not None
    assert p3.status.retry_after == iso(T0 + timedelta(seconds=50))
    st3 = p3.status.model_copy(update={"attempt": 3, "retry_after": None})
    p4 = reconcile(
        world(now=T0 + timedelta(seconds=60), status=st3, pods=(replace(crashed, attempt=3, name="j-controller-3"),))
    )
    assert p4.status is not None
    assert p4.status.phase == "Failed"
    assert "maxCrashes is 2" in (p4.status.message or "")
    assert reconcile(world(status=p4.status)).actions == []


def test_a_crash_says_why_in_the_users_words() -> None:
    """The runtime prints a user error as one line; it reaches the status and the Event."""
    st = RLJobStatus(phase="Running", attempt=1, step=3)
    why = "spotrl: s3://no-such-bkt/x: NoSuchBucket: The specified bucket does not exist"
    crashed = replace(running(), phase="Failed", exit_code=1, exit_message=why)
    plan = reconcile(world(status=st, pods=(crashed,)))
    assert plan.status is not None
    assert why in (plan.status.message or "")
    assert any(why in e.message for e in of(plan, Event) if e.reason == "ControllerCrashed")


def test_the_termination_message_is_its_last_line_and_bounded() -> None:
    from spotrl_operator.observe import pod_view

    pod = {
        "metadata": {"name": "j-controller-1", "labels": {"spotrl.dev/attempt": "1"}},
        "status": {
            "phase": "Failed",
            "containerStatuses": [
                {"state": {"terminated": {"exitCode": 1, "message": "INFO starting\n\nspotrl: " + "x" * 500 + "\n"}}}
            ],
        },
    }
    view = pod_view(pod)
    assert view.exit_code == 1
    assert view.exit_message == ("spotrl: " + "x" * 500)[:300]


def test_a_preempted_pod_that_failed_is_not_a_crash() -> None:
    st = RLJobStatus(phase="Running", attempt=1)
    shutdown = replace(running(), phase="Failed", exit_code=143, disruption="TerminationByKubelet")
    plan = reconcile(world(status=st, pods=(shutdown,)))
    assert plan.status is not None
    assert plan.status.restarts == 0
    assert plan.status.interrupted_at == iso(T0)
    nxt = reconcile(world(now=T0 + timedelta(seconds=2), status=plan.status))
    assert of(nxt, CreateControllerPod) == [CreateControllerPod(2, frozenset())]
    assert nxt.status is not None
    assert nxt.status.preemptions == 1


def test_a_pod_the_kubelet_failed_before_it_ran_is_started_again_neither_a_crash_nor_a_preemption() -> None:
    """A kubelet just back (a node given back) may reject a pod at admission: the program never
    ran, nothing was trained or lost."""
    st = RLJobStatus(phase="Running", attempt=1)
    rejected = replace(running(), phase="Failed", rejected="UnexpectedAdmissionError: Allocate failed")
    plan = reconcile(world(status=st, pods=(rejected,)))
    assert plan.status is not None
    assert (plan.status.restarts, plan.status.preemptions) == (0, 0)
    assert "ControllerRejected" in events(plan)
    assert "ControllerCrashed" not in events(plan)
    nxt = reconcile(world(now=T0 + timedelta(seconds=1), status=plan.status))
    assert of(nxt, CreateControllerPod) == [CreateControllerPod(2, frozenset())]
    assert nxt.status is not None
    assert (nxt.status.restarts, nxt.status.preemptions) == (0, 0)
    # A program that ran and failed is still a crash.
    crashed = reconcile(world(status=st, pods=(replace(running(), phase="Failed", exit_code=1),)))
    assert crashed.status is not None
    assert crashed.status.restarts == 1


def test_success_needs_every_step_trained() -> None:
    done = replace(running(), phase="Succeeded", exit_code=0)
    ok = reconcile(world(status=RLJobStatus(phase="Running", attempt=1, step=30), pods=(done,)))
    assert ok.status is not None
    assert ok.status.phase == "Succeeded"
    early = reconcile(world(status=RLJobStatus(phase="Running", attempt=1, step=12), pods=(done,)))
    assert early.status is not None
    assert early.status.phase == "Rescheduling"
    assert early.status.restarts == 1


def test_suspend_cuts_stops_and_resume_is_not_a_preemption() -> None:
    suspended_spec = SPEC.model_copy(update={"suspend": True})
    st = RLJobStatus(phase="Running", attempt=1)
    p1 = reconcile(world(spec=suspended_spec, status=st, pods=(running(),)))
    (req,) = of(p1, RequestBarrier)
    assert req.barrier.reason == "suspend"
    assert of(p1, DeletePod) == []
    assert p1.status is not None
    committed = p1.status.model_copy(update={"barrier": req.barrier.model_copy(update={"state": "Committed"})})
    p2 = reconcile(world(spec=suspended_spec, status=committed, pods=(running(),)))
    assert of(p2, DeletePod) == [DeletePod("j-controller-1")]
    assert p2.status is not None
    p3 = reconcile(world(spec=suspended_spec, status=p2.status))
    assert p3.status is not None
    assert p3.status.phase == "Suspended"
    p4 = reconcile(world(status=p3.status))
    assert of(p4, CreateControllerPod) == [CreateControllerPod(2, frozenset())]
    assert p4.status is not None
    assert p4.status.preemptions == 0


def test_only_the_newest_controller_survives() -> None:
    plan = reconcile(world(status=RLJobStatus(phase="Running", attempt=2), pods=(running(1), running(2, "spot-b"))))
    assert of(plan, DeletePod) == [DeletePod("j-controller-1")]


def test_an_open_budget_closes_once_the_controller_runs_again() -> None:
    plan = reconcile(world(status=RLJobStatus(phase="Rescheduling", attempt=2), pods=(running(2),), pdb_open=True))
    assert of(plan, CloseDisruptionBudget) == [CloseDisruptionBudget()]


# ----------------------------------------------------------------------------- restarts, attempts, caps


def test_an_attempt_whose_pod_was_never_seen_is_created_again_not_counted() -> None:
    """The operator wrote attempt 2 to the status and stopped before creating the pod (or its
    cache has not seen the pod yet): the next pass creates attempt 2, not 3."""
    after_write = RLJobStatus(phase="Rescheduling", attempt=2, preemptions=1, controller_pod=None)
    plan = reconcile(world(status=after_write, unusable_nodes=frozenset({"spot-a"}), avoid_nodes=frozenset({"spot-a"})))
    assert of(plan, CreateControllerPod) == [CreateControllerPod(2, frozenset({"spot-a"}))]
    assert plan.status is not None
    assert plan.status.attempt == 2
    assert plan.status.preemptions == 1
    assert events(plan) == []


def test_a_seen_pod_is_remembered_so_its_disappearance_is_a_new_attempt() -> None:
    seen = reconcile(world(status=RLJobStatus(phase="Pending", attempt=1), pods=(running(),)))
    assert seen.status is not None
    assert seen.status.controller_pod == "j-controller-1"
    assert seen.status.controller_node == "spot-a"
    gone = reconcile(world(now=T0 + timedelta(seconds=3), status=seen.status))
    assert of(gone, CreateControllerPod) == [CreateControllerPod(2, frozenset())]
    assert gone.status is not None
    assert gone.status.preemptions == 1
    assert gone.status.controller_pod is None


def test_the_barrier_names_its_attempt_and_the_deadline_is_capped_by_provider() -> None:
    st = RLJobStatus(phase="Running", attempt=3)
    gke = Signal("taint", "spot-a", "cloud.google.com/impending-node-termination")
    plan = reconcile(world(status=st, pods=(running(3),), signals=(gke,), deadline_caps={"gke": 12}))
    (req,) = of(plan, RequestBarrier)
    assert req.barrier.attempt == 3
    assert req.barrier.deadline == iso(T0 + timedelta(seconds=12))
    # A cap above the job's own deadline (20 s here) does not lengthen it.
    plan = reconcile(world(status=st, pods=(running(3),), signals=(gke,), deadline_caps={"gke": 50}))
    assert of(plan, RequestBarrier)[0].barrier.deadline == iso(T0 + timedelta(seconds=20))


def test_with_several_notices_on_the_node_the_barrier_gets_the_tightest_deadline() -> None:
    """A cordon (no cap) seen before AKS's own taint (capped) must not give the barrier the
    job's whole deadline: the platform's notice is the one that ends the node."""
    st = RLJobStatus(phase="Running", attempt=3)
    cordon = Signal("cordon", "spot-a", "spec.unschedulable")
    aks = Signal("taint", "spot-a", "remediator.kubernetes.azure.com/unschedulable")
    assert (cordon.provider, aks.provider) == ("cordon", "aks")
    for signals in ((cordon, aks), (aks, cordon)):
        plan = reconcile(world(status=st, pods=(running(3),), signals=signals, deadline_caps={"aks": 7}))
        (req,) = of(plan, RequestBarrier)
        assert req.barrier.deadline == iso(T0 + timedelta(seconds=7)), [s.provider for s in signals]
    plan = reconcile(world(status=st, pods=(running(3),), signals=(cordon, aks), deadline_caps={}))
    assert of(plan, RequestBarrier)[0].barrier.deadline == iso(T0 + timedelta(seconds=20)), "no cap: the job's"


def test_the_interrupted_controller_still_reporting_steps_is_not_a_resume() -> None:
    """After a commit the old controller (same attempt) may report a step: no Resumed event,
    the interruption lasts until a later attempt trains."""
    notice = Signal("cordon", "spot-a", "spec.unschedulable")
    st = RLJobStatus(phase="Running", attempt=1, step=5, step_attempt=1)
    p1 = reconcile(world(status=st, pods=(running(),), signals=(notice,)))
    assert p1.status is not None
    assert p1.status.barrier is not None
    committed = p1.status.model_copy(
        update={"barrier": p1.status.barrier.model_copy(update={"state": "Committed", "cut_id": "c"})}
    )
    p2 = reconcile(world(status=committed, pods=(running(),), signals=(notice,)))
    assert p2.status is not None
    assert p2.status.interrupted_attempt == 1
    old_step = p2.status.model_copy(update={"step": 6, "step_attempt": 1})
    p3 = reconcile(world(now=T0 + timedelta(seconds=1), status=old_step, pods=(running(),), signals=(notice,)))
    assert "Resumed" not in events(p3)
    assert p3.status is not None
    assert p3.status.interrupted_at is not None
    assert p3.status.seconds_lost == 0


def test_a_failed_barrier_is_reported_once_and_the_controller_still_moves() -> None:
    notice = Signal("taint", "spot-a", "karpenter.sh/disrupted")
    p1 = reconcile(world(status=RLJobStatus(phase="Running", attempt=1), pods=(running(),), signals=(notice,)))
    assert p1.status is not None
    assert p1.status.barrier is not None
    failed = p1.status.model_copy(
        update={"barrier": p1.status.barrier.model_copy(update={"state": "Failed", "message": "disk full"})}
    )
    p2 = reconcile(world(status=failed, pods=(running(),), signals=(notice,)))
    assert "BarrierFailed" in events(p2)
    assert of(p2, OpenDisruptionBudget) == [OpenDisruptionBudget()]
    assert of(p2, DeletePod) == [DeletePod("j-controller-1")]
    assert p2.status is not None
    assert any(c.type == "BarrierFailed" and "disk full" in c.message for c in p2.status.conditions)
    p3 = reconcile(world(status=p2.status, pods=(running(),), signals=(notice,), pdb_open=True))
    assert "BarrierFailed" not in events(p3)


def test_suspend_reuses_a_barrier_already_in_flight_and_a_failed_one_still_stops() -> None:
    notice = Signal("cordon", "spot-a", "spec.unschedulable")
    p1 = reconcile(world(status=RLJobStatus(phase="Running", attempt=1), pods=(running(),), signals=(notice,)))
    assert p1.status is not None
    suspended_spec = SPEC.model_copy(update={"suspend": True})
    p2 = reconcile(world(spec=suspended_spec, status=p1.status, pods=(running(),)))
    assert of(p2, RequestBarrier) == [], "the notice's barrier serves the suspend too"
    assert p2.status is not None
    assert p2.status.barrier is not None
    failed = p2.status.model_copy(update={"barrier": p2.status.barrier.model_copy(update={"state": "Failed"})})
    p3 = reconcile(world(spec=suspended_spec, status=failed, pods=(running(),)))
    assert of(p3, RequestBarrier) == [], "never ask the same controller again for the same id"
    assert of(p3, DeletePod) == [DeletePod("j-controller-1")]


def test_the_running_condition_follows_the_phase() -> None:
    p1 = reconcile(world(status=RLJobStatus(phase="Pending", attempt=1), pods=(running(),)))
    assert p1.status is not None
    crashed = replace(running(), phase="Failed", exit_code=1)
    p2 = reconcile(world(status=p1.status, pods=(crashed,)))
    assert p2.status is not None
    (cond,) = [c for c in p2.status.conditions if c.type == "Running"]
    assert (cond.status, cond.reason) == ("False", "Rescheduling")


def test_a_job_without_storage_fails_with_the_field_named() -> None:
    plan = reconcile(world(config_error="spec.checkpoint.storage is not set and the operator has no default"))
    assert plan.status is not None
    assert plan.status.phase == "Failed"
    assert of(plan, CreateControllerPod) == []
    assert any(c.type == "Failed" and "spec.checkpoint.storage" in c.message for c in plan.status.conditions)


def test_a_missed_suspend_barrier_seen_again_stays_missed() -> None:
    """A pass from a stale cache still sees the pod after the miss: no 'committed' then."""
    suspended_spec = SPEC.model_copy(update={"suspend": True})
    p1 = reconcile(world(spec=suspended_spec, status=RLJobStatus(phase="Running", attempt=1), pods=(running(),)))
    assert p1.status is not None
    late = T0 + timedelta(seconds=21)
    p2 = reconcile(world(now=late, spec=suspended_spec, status=p1.status, pods=(running(),)))
    assert p2.status is not None
    p3 = reconcile(world(now=late, spec=suspended_spec, status=p2.status, pods=(running(),)))
    assert p3.status is not None
    assert "BarrierCommitted" not in events(p3)
    assert {c.type: c.status for c in p3.status.conditions}["BarrierMissed"] == "True"


# ----------------------------------------------------------------------------- worker pods

WORKER_SPEC = SPEC.model_copy(
    update={"generation": SPEC.generation.model_copy(update={"worker_pods": True, "workers": 2})}
)
HEAD = RayHead(address="127.0.1.2:40001", attempt=1, workers=2)


def worker(index: int, attempt: int = 1, node: str = "spot-b", phase: str = "Running", **kw: object) -> PodView:
    return replace(
        PodView(name=f"j-worker-{attempt}-{index}", attempt=attempt, phase=phase, node=node, index=index),
        **kw,  # type: ignore[arg-type]
    )


def serving(**kw: object) -> World:
    """The controller of attempt 1 runs and has published its Ray head."""
    base = world(
        spec=WORKER_SPEC,
        status=RLJobStatus(phase="Running", attempt=1, step=3, step_attempt=1, ray_head=HEAD),
        pods=(running(),),
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def test_worker_pods_wait_for_the_controller_to_publish_its_ray_head() -> None:
    plan = reconcile(world(spec=WORKER_SPEC, status=RLJobStatus(phase="Pending", attempt=1), pods=(running(),)))
    assert of(plan, CreateWorkerPod) == []
    assert plan.status is not None
    assert plan.status.workers_ready == 0
    # A head of an older attempt is no head for this controller.
    old = RLJobStatus(phase="Running", attempt=2, ray_head=HEAD)
    plan = reconcile(world(spec=WORKER_SPEC, status=old, pods=(running(2),)))
    assert of(plan, CreateWorkerPod) == []


def test_a_published_head_gets_one_worker_pod_per_index_and_nothing_else_changes() -> None:
    plan = reconcile(serving(unusable_nodes=frozenset({"spot-c"}), avoid_nodes=frozenset({"spot-c"})))
    assert of(plan, CreateWorkerPod) == [
        CreateWorkerPod(1, 0, "127.0.1.2:40001", frozenset({"spot-c"})),
        CreateWorkerPod(1, 1, "127.0.1.2:40001", frozenset({"spot-c"})),
    ]
    assert of(plan, CreateControllerPod) == []
    assert of(plan, DeletePod) == []
    assert plan.requeue_after == 1.0
    # Both run: nothing to do, and the status says so.
    plan = reconcile(serving(workers=(worker(0), worker(1, node="ondemand-a"))))
    assert [a for a in plan.actions if not isinstance(a, Event)] == []
    assert plan.status is not None
    assert plan.status.workers_ready == 2
    # The controller's head asks for the count; the spec changing meanwhile does not add pods.
    three = WORKER_SPEC.model_copy(update={"generation": WORKER_SPEC.generation.model_copy(update={"workers": 3})})
    plan = reconcile(serving(spec=three, workers=(worker(0), worker(1))))
    assert of(plan, CreateWorkerPod) == []


def test_a_failed_worker_is_replaced_without_a_preemption() -> None:
    before = serving(workers=(worker(0), worker(1)))
    st = reconcile(before).status
    assert st is not None
    failed = worker(1, phase="Failed", exit_code=1)
    p1 = reconcile(serving(status=st, workers=(worker(0), failed)))
    assert of(p1, DeletePod) == [DeletePod("j-worker-1-1")]
    assert of(p1, CreateWorkerPod) == [], "the name is still taken: create once the old pod is gone"
    assert of(p1, RequestBarrier) == []
    assert of(p1, CreateControllerPod) == []
    assert "WorkerLost" in events(p1)
    assert p1.status is not None
    assert p1.status.workers_ready == 1
    assert (p1.status.attempt, p1.status.preemptions, p1.status.restarts) == (1, 0, 0)
    assert p1.status.phase == "Running"
    assert p1.status.interrupted_at is None

    # Seen again (a stale cache, or the delete still under way): no second event.
    p2 = reconcile(serving(status=p1.status, workers=(worker(0), failed)))
    assert "WorkerLost" not in events(p2)
    # Gone: the replacement, same index and attempt, once the first backoff (10 s) is over.
    assert (p1.status.worker_restarts, p1.status.worker_retry_after) == (1, "2026-11-30T12:00:10Z")
    p3 = reconcile(serving(status=p1.status, workers=(worker(0),)))
    assert of(p3, CreateWorkerPod) == []
    assert p3.requeue_after == 10.0
    p4 = reconcile(serving(status=p1.status, workers=(worker(0),), now=T0 + timedelta(seconds=10)))
    assert of(p4, CreateWorkerPod) == [CreateWorkerPod(1, 1, HEAD.address, frozenset())]
    assert p4.status is not None
    assert (p4.status.attempt, p4.status.worker_restarts) == (1, 1)


def test_a_worker_stopped_by_its_nodes_shutdown_is_replaced_at_once_and_not_counted() -> None:
    """A spot node's graceful shutdown fails the worker's pod with DisruptionTarget
    (TerminationByKubelet): no fault of the worker, so no backoff and no restart, unlike a crash."""
    st = reconcile(serving(workers=(worker(0), worker(1)))).status
    shut = worker(1, phase="Failed", exit_code=143, disruption="TerminationByKubelet")
    going = frozenset({"spot-b"})
    p1 = reconcile(serving(status=st, workers=(worker(0, node="ondemand-a"), shut), unusable_nodes=going))
    assert of(p1, DeletePod) == [DeletePod("j-worker-1-1")]
    assert of(p1, RequestBarrier) == [], "a worker holds nothing to cut"
    (lost,) = [a for a in p1.actions if isinstance(a, Event) and a.reason == "WorkerLost"]
    assert "stopped by its node's disruption (TerminationByKubelet)" in lost.message
    assert "created now" in lost.message
    assert p1.status is not None
    assert (p1.status.worker_restarts, p1.status.worker_retry_after) == (0, None)
    p2 = reconcile(serving(status=p1.status, workers=(worker(0, node="ondemand-a"),), avoid_nodes=going))
    assert of(p2, CreateWorkerPod) == [CreateWorkerPod(1, 1, HEAD.address, going)], "at once, elsewhere"
    # The same pod failing by itself (no DisruptionTarget) backs off and counts.
    crashed = reconcile(serving(status=st, workers=(worker(0), replace(shut, disruption=None)))).status
    assert crashed is not None
    assert crashed.worker_restarts == 1


def test_a_worker_that_keeps_failing_backs_off_doubling_and_the_next_attempt_starts_afresh() -> None:
    """A worker pod that fails as soon as it starts (a bad image, say) is no hot loop."""
    st = reconcile(serving(workers=(worker(0), worker(1)))).status
    now, waits = T0, []
    for _ in range(4):
        failed = worker(1, phase="Failed", exit_code=1)
        p = reconcile(serving(status=st, workers=(worker(0), failed), now=now))
        assert p.status is not None
        assert "WorkerLost" in events(p), "each failure after a backoff is reported"
        retry = datetime.fromisoformat(p.status.worker_retry_after or "")
        waits.append((retry - now).total_seconds())
        # Within the backoff the slot stays empty; a second worker ending then adds no wait.
        also = worker(0, phase="Failed", exit_code=1)
        q = reconcile(serving(status=p.status, workers=(also,), now=now + timedelta(seconds=1)))
        assert q.status is not None
        assert of(q, CreateWorkerPod) == []
        assert (q.status.worker_restarts, q.status.worker_retry_after) == (
            p.status.worker_restarts,
            p.status.worker_retry_after,
        )
        now = retry
        created = reconcile(serving(status=q.status, workers=(), now=now))
        assert [a.index for a in of(created, CreateWorkerPod)] == [0, 1]
        st = created.status
    assert waits == [10.0, 20.0, 40.0, 80.0]
    assert st is not None
    assert st.worker_restarts == 4
    assert (st.attempt, st.restarts, st.preemptions) == (1, 0, 0), "not the controller's failure budget"
    # A new controller attempt starts counting again.
    gone = reconcile(world(spec=WORKER_SPEC, status=st, pods=(), now=now))
    assert gone.status is not None
    assert (gone.status.attempt, gone.status.worker_restarts, gone.status.worker_retry_after) == (2, 0, None)


def test_the_worker_backoff_starts_over_once_the_workers_ran_calmly_for_twice_the_cap() -> None:
    """A worker that fails now and then on a long run is not held at the cap for ever; the
    count of restarts in the status keeps counting."""

    def fail_at(st: RLJobStatus | None, now: datetime) -> tuple[RLJobStatus, float]:
        p = reconcile(serving(status=st, workers=(worker(0), worker(1, phase="Failed", exit_code=1)), now=now))
        assert p.status is not None
        retry = datetime.fromisoformat(p.status.worker_retry_after or "")
        assert p.status.worker_backoff_seconds == (retry - now).total_seconds()
        return p.status, (retry - now).total_seconds()

    st = reconcile(serving(workers=(worker(0), worker(1)))).status
    st, first = fail_at(st, T0)
    st, second = fail_at(st, T0 + timedelta(seconds=15))  # 5 s after the first wait ended
    assert (first, second) == (10.0, 20.0)
    # The cap is 300 s: a failure 599 s after the last wait ended still doubles ...
    ended = T0 + timedelta(seconds=35)
    doubled, third = fail_at(st, ended + timedelta(seconds=599))
    assert third == 40.0
    # ... one 600 s after it starts again from backoffSeconds.
    st, again = fail_at(st, ended + timedelta(seconds=600))
    assert again == 10.0
    assert (st.worker_restarts, doubled.worker_restarts) == (3, 3)
    # Doubling never passes the cap, nor falls below backoffSeconds if the spec raised it.
    spec = WORKER_SPEC.model_copy(update={"failure_budget": FailureBudget(backoff_seconds=50, max_backoff_seconds=120)})
    assert [worker_backoff(spec, last, T0, T0 + timedelta(seconds=1)) for last in (None, 10, 50, 100)] == [
        50,
        50,
        100,
        120,
    ]


def test_a_deleted_worker_is_waited_for_then_recreated() -> None:
    st = reconcile(serving(workers=(worker(0), worker(1)))).status
    terminating = worker(0, deleting_since=T0)
    p1 = reconcile(serving(status=st, workers=(terminating, worker(1))))
    assert of(p1, CreateWorkerPod) == []
    assert of(p1, DeletePod) == []
    assert "WorkerLost" in events(p1)
    p2 = reconcile(serving(status=p1.status, workers=(worker(1),)))
    assert of(p2, CreateWorkerPod) == [CreateWorkerPod(1, 0, HEAD.address, frozenset())]


def test_a_worker_on_a_lost_node_is_force_deleted_at_once_and_replaced_elsewhere() -> None:
    st = reconcile(serving(workers=(worker(0, node="spot-a"), worker(1)))).status
    lost = frozenset({"spot-b"})
    p1 = reconcile(serving(status=st, workers=(worker(0, node="spot-a"), worker(1)), lost_nodes=lost))
    assert of(p1, DeletePod) == [DeletePod("j-worker-1-1", force=True)]
    assert of(p1, RequestBarrier) == []
    assert "NodeLost" not in events(p1)
    assert "WorkerLost" in events(p1)
    assert p1.status is not None
    assert p1.status.workers_ready == 1
    # Evicted by the taint manager meanwhile: still forced, no grace to wait out.
    evicted = worker(1, deleting_since=T0)
    p2 = reconcile(serving(status=p1.status, workers=(worker(0, node="spot-a"), evicted), lost_nodes=lost))
    assert of(p2, DeletePod) == [DeletePod("j-worker-1-1", force=True)]
    p3 = reconcile(
        serving(
            status=p1.status,
            workers=(worker(0, node="spot-a"),),
            lost_nodes=lost,
            unusable_nodes=lost,
            avoid_nodes=lost,
        )
    )
    assert of(p3, CreateWorkerPod) == [CreateWorkerPod(1, 1, HEAD.address, lost)]
    assert p3.status is not None
    assert (p3.status.worker_restarts, p3.status.worker_retry_after) == (0, None), "a lost node is no worker fault"


def test_workers_of_an_older_attempt_or_out_of_range_are_deleted() -> None:
    head2 = RayHead(address="127.0.2.5:40100", attempt=2, workers=1)
    st = RLJobStatus(phase="Running", attempt=2, ray_head=head2)
    plan = reconcile(
        world(
            spec=WORKER_SPEC,
            status=st,
            pods=(running(2),),
            workers=(worker(0, attempt=1), worker(1, attempt=2), worker(0, attempt=2)),
        )
    )
    assert sorted(a.name for a in of(plan, DeletePod)) == ["j-worker-1-0", "j-worker-2-1"]
    assert of(plan, CreateWorkerPod) == []
    assert plan.status is not None
    assert plan.status.workers_ready == 1


def test_workers_go_when_the_controller_goes() -> None:
    both = (worker(0), worker(1))
    # Preempted: the barrier committed, the controller moves, its workers with it.
    notice = Signal("cordon", "spot-a", "spec.unschedulable")
    p1 = reconcile(serving(workers=both, signals=(notice,)))
    assert of(p1, RequestBarrier)
    assert of(p1, DeletePod) == [], "the workers keep generating while the controller cuts"
    assert p1.status is not None
    assert p1.status.barrier is not None
    committed = p1.status.model_copy(
        update={"barrier": p1.status.barrier.model_copy(update={"state": "Committed", "cut_id": "c"})}
    )
    p2 = reconcile(serving(status=committed, workers=both, signals=(notice,)))
    assert sorted(a.name for a in of(p2, DeletePod)) == ["j-controller-1", "j-worker-1-0", "j-worker-1-1"]

    # The controller's node is lost.
    p3 = reconcile(serving(workers=both, lost_nodes=frozenset({"spot-a"})))
    assert DeletePod("j-worker-1-0") in of(p3, DeletePod)
    assert of(p3, CreateWorkerPod) == []

    # Suspended, finished, crashed.
    suspend = WORKER_SPEC.model_copy(update={"suspend": True})
    p4 = reconcile(serving(spec=suspend, workers=both))
    assert {DeletePod("j-worker-1-0"), DeletePod("j-worker-1-1")} <= set(of(p4, DeletePod))
    assert of(p4, CreateWorkerPod) == []
    done = replace(running(), phase="Succeeded", exit_code=0)
    p5 = reconcile(
        serving(status=RLJobStatus(phase="Running", attempt=1, step=30, ray_head=HEAD), pods=(done,), workers=both)
    )
    assert p5.status is not None
    assert p5.status.phase == "Succeeded"
    assert {DeletePod("j-worker-1-0"), DeletePod("j-worker-1-1")} <= set(of(p5, DeletePod))
    crashed = replace(running(), phase="Failed", exit_code=1)
    p6 = reconcile(serving(pods=(crashed,), workers=both))
    assert {DeletePod("j-worker-1-0"), DeletePod("j-worker-1-1")} <= set(of(p6, DeletePod))
    # Leftovers of a finished job are cleaned up on any later pass.
    p7 = reconcile(serving(status=p5.status, pods=(done,), workers=(worker(1),)))
    assert of(p7, DeletePod) == [DeletePod("j-worker-1-1")]


def test_a_new_attempt_forgets_the_old_head() -> None:
    st = RLJobStatus(phase="Rescheduling", attempt=1, controller_pod="j-controller-1", ray_head=HEAD)
    plan = reconcile(world(spec=WORKER_SPEC, status=st, workers=(worker(0),)))
    assert of(plan, CreateControllerPod) == [CreateControllerPod(2, frozenset())]
    assert plan.status is not None
    assert plan.status.ray_head is None
    assert of(plan, DeletePod) == [DeletePod("j-worker-1-0")]
    assert of(plan, CreateWorkerPod) == []


def test_a_job_without_worker_pods_reports_none() -> None:
    plan = reconcile(world(status=RLJobStatus(phase="Running", attempt=1), pods=(running(),)))
    assert plan.status is not None
    assert plan.status.workers_ready is None
    assert of(plan, CreateWorkerPod) == []


def test_a_resume_that_skipped_damaged_cuts_is_said_once_and_cleared_by_a_clean_one() -> None:
    from spotrl_runtime.api.rljob import ResumeStatus, SkippedCut

    skipped = [SkippedCut(id="0000000007", check="file_digest", message="trainer/weights.pt: sha256 is 1a2b…")]
    status = RLJobStatus(
        phase="Running", attempt=3, resume=ResumeStatus(attempt=3, cut_id="0000000006", skipped=skipped)
    )
    plan = reconcile(world(status=status, pods=(running(3),)))
    assert "CutSkipped" in events(plan)
    assert plan.status is not None
    (cond,) = [c for c in plan.status.conditions if c.type == "CutSkipped"]
    assert cond.status == "True"
    assert "0000000007 (file_digest" in cond.message
    assert "resumed from cut 0000000006" in cond.message

    again = reconcile(world(status=plan.status, pods=(running(3),)))
    assert "CutSkipped" not in events(again), "said once"

    # The next attempt resumes from its newest cut: the condition goes False, no new event.
    assert again.status is not None
    clean = again.status.model_copy(update={"attempt": 4, "resume": ResumeStatus(attempt=4, cut_id="0000000008")})
    after = reconcile(world(status=clean, pods=(running(4),)))
    assert "CutSkipped" not in events(after)
    assert after.status is not None
    assert [c.status for c in after.status.conditions if c.type == "CutSkipped"] == ["False"]

    # A stale report (an older attempt's) says nothing.
    stale = RLJobStatus(phase="Running", attempt=5, resume=ResumeStatus(attempt=4, skipped=skipped))
    assert "CutSkipped" not in events(reconcile(world(status=stale, pods=(running(5),))))
