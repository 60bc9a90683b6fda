"""BarrierAtRisk: the operator compares the controller's barrier cut estimate with the
shortest window the job may get, through reconcile(), and says so once per change."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from spotrl_operator.cut_risk import shortest_window
from spotrl_operator.reconcile import reconcile
from spotrl_operator.world import Event, Plan, PodView, World
from spotrl_runtime.api.rljob import CutEstimateStatus, RLJobStatus, parse_spec

T0 = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
MB = 1_000_000


def spec(deadline: int = 100, every_steps: int = 50, barrier: str = "full", delta_every_steps: int = 0) -> object:
    return parse_spec(
        {
            "policy": {"model": "builtin:tiny-arith"},
            "dataset": {"uri": "builtin:arithmetic"},
            "reward": {"name": "arithmetic_exact"},
            "training": {"totalSteps": 300},
            "checkpoint": {
                "barrierDeadlineSeconds": deadline,
                "everySteps": every_steps,
                "barrier": barrier,
                "deltaEverySteps": delta_every_steps,
            },
        }
    )


def estimate(seconds: float) -> CutEstimateStatus:
    return CutEstimateStatus(
        seconds=seconds,
        bytes=200 * MB,
        bytes_per_second=200 * MB / (seconds - 1.0),
        overhead_seconds=1.0,
        based_on_cuts=4,
        step_seconds=3.0,
        attempt=1,
    )


def world(status: RLJobStatus, *, caps: dict[str, int] | None = None, **kw: object) -> World:
    return World(
        now=T0,
        generation=1,
        spec=spec(**kw),  # type: ignore[arg-type]
        status=status,
        pods=(PodView(name="j-controller-1", attempt=1, phase="Running", node="spot-a"),),
        deadline_caps={"gke": 20, "aks": 25} if caps is None else caps,
    )


def running(est: CutEstimateStatus | None) -> RLJobStatus:
    return RLJobStatus(
        phase="Running", attempt=1, controller_pod="j-controller-1", controller_node="spot-a", cut_estimate=est
    )


def events(plan: Plan) -> list[Event]:
    return [a for a in plan.actions if isinstance(a, Event) and a.reason.startswith("Barrier")]


def risk(plan: Plan) -> tuple[str, str, str] | None:
    assert plan.status is not None
    c = next((c for c in plan.status.conditions if c.type == "BarrierAtRisk"), None)
    return None if c is None else (c.status, c.reason, c.message)


def test_the_shortest_window_is_the_smallest_cap_or_the_jobs_deadline() -> None:
    assert shortest_window(100, {"gke": 20, "aks": 25}) == (20, "signals.deadlineCaps gke=20")
    assert shortest_window(15, {"gke": 20}) == (15, "spec.checkpoint.barrierDeadlineSeconds")
    assert shortest_window(100, {}) == (100, "spec.checkpoint.barrierDeadlineSeconds")


def test_a_clouds_own_cap_counts_only_in_a_cluster_with_nodes_of_that_cloud() -> None:
    caps = {"gke": 20, "aks": 25, "karpenter": 60}
    assert shortest_window(100, caps, frozenset({"aws"})) == (60, "signals.deadlineCaps karpenter=60")
    assert shortest_window(100, caps, frozenset({"azure"})) == (25, "signals.deadlineCaps aks=25")
    assert shortest_window(100, caps, frozenset({"aws", "gce"})) == (20, "signals.deadlineCaps gke=20")
    assert shortest_window(100, caps, frozenset()) == (60, "signals.deadlineCaps karpenter=60")
    assert shortest_window(100, caps, None) == (20, "signals.deadlineCaps gke=20"), "clouds not known: every cap"


def test_an_eks_job_is_not_judged_by_gkes_notice() -> None:
    """A 30 s cut fits EKS's 100 s deadline; only in a cluster with GCE nodes is GKE's 20 s its window."""
    on_eks = risk(reconcile(replace(world(running(estimate(30.0))), clouds=frozenset({"aws"}))))
    on_gke = risk(reconcile(replace(world(running(estimate(30.0))), clouds=frozenset({"gce"}))))
    assert on_eks is not None
    assert on_eks[0] == "False"
    assert on_gke is not None
    assert on_gke[0] == "True"
    assert "signals.deadlineCaps gke=20" in on_gke[2]


def test_no_estimate_no_condition() -> None:
    plan = reconcile(world(running(None)))
    assert risk(plan) is None
    assert events(plan) == []


def test_an_estimate_that_fits_sets_the_condition_false_without_an_event() -> None:
    plan = reconcile(world(running(estimate(10.0))))
    got = risk(plan)
    assert got is not None
    assert got[:2] == ("False", "BarrierFits")
    assert "10.0 s" in got[2]
    assert "20 s (signals.deadlineCaps gke=20)" in got[2]
    assert events(plan) == []


def test_an_estimate_over_the_gke_cap_is_at_risk_once_with_the_window_and_what_would_fit() -> None:
    plan = reconcile(world(running(estimate(30.0))))
    got = risk(plan)
    assert got is not None
    status, reason, message = got
    assert (status, reason) == ("True", "CutTooSlow")
    assert "30.0 s" in message
    assert "20 s (signals.deadlineCaps gke=20)" in message
    assert "everySteps=50 steps (~150 s)" in message
    assert "set checkpoint.everySteps to 10 to lose at most 10 step(s) (~30 s)" in message
    (ev,) = events(plan)
    assert (ev.type, ev.reason) == ("Warning", "BarrierAtRisk")
    assert ev.message == message
    # The next pass with the same estimate says nothing new; the bar to clear is now 70 %.
    again = reconcile(world(plan.status))  # type: ignore[arg-type]
    still = risk(again)
    assert still is not None
    assert still[:2] == got[:2]
    assert "over 14.0 s (70%) of the shortest barrier window" in still[2]
    assert events(again) == []


def test_with_a_delta_after_every_step_an_abrupt_loss_costs_one_step() -> None:
    plan = reconcile(world(running(estimate(30.0)), delta_every_steps=1))
    got = risk(plan)
    assert got is not None
    assert got[:2] == ("True", "CutTooSlow")
    assert "an abrupt loss then costs up to checkpoint.deltaEverySteps=1 steps (~3 s) of training" in got[2]
    assert "set checkpoint.everySteps" not in got[2], "fewer full cuts would not bound the loss better"


def test_the_same_estimate_fits_a_job_whose_window_is_long_enough() -> None:
    plan = reconcile(world(running(estimate(30.0)), caps={}, deadline=100))
    got = risk(plan)
    assert got is not None
    assert got[0] == "False"
    assert "100 s (spec.checkpoint.barrierDeadlineSeconds)" in got[2]


def test_a_tiny_barrier_deadline_alone_puts_it_at_risk() -> None:
    plan = reconcile(world(running(estimate(6.0)), caps={}, deadline=5))
    got = risk(plan)
    assert got is not None
    assert got[0] == "True"
    assert "5 s (spec.checkpoint.barrierDeadlineSeconds)" in got[2]


def test_when_it_fits_again_the_condition_turns_false_with_one_event() -> None:
    at_risk = reconcile(world(running(estimate(30.0)))).status
    assert at_risk is not None
    faster = at_risk.model_copy(update={"cut_estimate": estimate(8.0)})
    plan = reconcile(replace(world(faster), now=T0 + timedelta(seconds=60)))
    got = risk(plan)
    assert got is not None
    assert got[:2] == ("False", "BarrierFits")
    (ev,) = events(plan)
    assert (ev.type, ev.reason) == ("Normal", "BarrierFits")
    assert plan.status is not None
    cond = next(c for c in plan.status.conditions if c.type == "BarrierAtRisk")
    assert cond.last_transition_time == "2026-11-30T12:01:00Z"


def test_a_finished_job_is_left_alone() -> None:
    done = running(estimate(30.0)).model_copy(update={"phase": "Succeeded"})
    plan = reconcile(world(done))
    assert risk(plan) is None
    assert events(plan) == []


def test_an_estimate_hovering_at_the_edge_says_barrier_at_risk_once_and_fits_again_only_with_room() -> None:
    """The window is 20 s: a fresh job fits up to 16 s (80 %); one at risk fits again only
    under 14 s (70 %). Estimates around 16 s then flip nothing, and send one Event. (Periodic cuts are
    rare here: the writer is never busy enough for a barrier to wait behind one.)"""
    assert risk(reconcile(world(running(estimate(15.0)), every_steps=200)))[:2] == ("False", "BarrierFits")  # type: ignore[index]
    status, said = running(estimate(17.0)), []
    for i, seconds in enumerate((17.0, 15.0, 16.5, 15.0, 14.5, 17.0)):
        plan = reconcile(
            replace(
                world(status.model_copy(update={"cut_estimate": estimate(seconds)}), every_steps=200),
                now=T0 + timedelta(seconds=i),
            )
        )
        got = risk(plan)
        assert got is not None
        assert got[:2] == ("True", "CutTooSlow"), (seconds, got)
        said += events(plan)
        assert plan.status is not None
        status = plan.status
    assert [(e.type, e.reason) for e in said] == [("Warning", "BarrierAtRisk")]
    assert "14.0 s (70%) of the shortest barrier window, 20 s" in got[2]
    plan = reconcile(world(status.model_copy(update={"cut_estimate": estimate(13.5)}), every_steps=200))
    got = risk(plan)
    assert got is not None
    assert got[:2] == ("False", "BarrierFits")
    assert [(e.type, e.reason) for e in events(plan)] == [("Normal", "BarrierFits")]


def test_with_barrier_auto_a_full_cut_too_slow_is_no_risk_while_a_delta_fits() -> None:
    plan = reconcile(world(running(estimate(30.0)), barrier="auto"))
    got = risk(plan)
    assert got is not None
    assert got[:2] == ("False", "BarrierFits"), got
    assert "a full barrier cut (30.0 s) would not fit, so checkpoint.barrier auto cuts a delta" in got[2]
    assert "a delta cut is estimated at 1.0 s" in got[2]
    assert events(plan) == []
    fits = risk(reconcile(world(running(estimate(10.0)), barrier="auto")))
    assert fits is not None
    assert "delta" not in fits[2], "a full cut that fits is what auto takes"


def test_at_risk_with_deltas_means_even_a_delta_does_not_fit() -> None:
    slow_fixed = estimate(30.0).model_copy(update={"overhead_seconds": 18.0})
    for barrier in ("auto", "delta"):
        got = risk(reconcile(world(running(slow_fixed), barrier=barrier)))
        assert got is not None
        assert got[:2] == ("True", "CutTooSlow"), (barrier, got)
        assert "a delta cut is estimated at 18.0 s" in got[2]
    delta = risk(reconcile(world(running(estimate(30.0)), barrier="delta")))
    assert delta is not None
    assert delta[0] == "False"
    assert delta[2].startswith("checkpoint.barrier is delta: ")
