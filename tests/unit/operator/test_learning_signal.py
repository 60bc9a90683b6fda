"""NoLearningSignal: the operator turns the controller's count of steps without reward variance
(status.learningSignal) into a condition and an Event, through reconcile()."""

from __future__ import annotations

from datetime import UTC, datetime

from spotrl_operator.reconcile import reconcile
from spotrl_operator.world import Event, Plan, PodView, World
from spotrl_runtime.api.rljob import LearningSignalStatus, RLJobStatus, parse_spec

T0 = datetime(2026, 12, 4, 12, 0, 0, tzinfo=UTC)


def world(status: RLJobStatus) -> World:
    spec = parse_spec(
        {
            "policy": {"model": "builtin:tiny-arith"},
            "dataset": {"uri": "builtin:arithmetic"},
            "reward": {"name": "arithmetic_exact"},
            "training": {"totalSteps": 300},
        }
    )
    return World(
        now=T0,
        generation=1,
        spec=spec,
        status=status,
        pods=(PodView(name="j-controller-1", attempt=1, phase="Running", node="spot-a"),),
    )


def running(steps_without: int | None, step: int = 9) -> RLJobStatus:
    signal = None
    if steps_without is not None:
        signal = LearningSignalStatus(steps_without_signal=steps_without, threshold=5, step=step, reward_mean=0.0)
    return RLJobStatus(
        phase="Running", attempt=1, controller_pod="j-controller-1", controller_node="spot-a", learning_signal=signal
    )


def condition(plan: Plan) -> tuple[str, str, str] | None:
    assert plan.status is not None
    c = next((c for c in plan.status.conditions if c.type == "NoLearningSignal"), None)
    return None if c is None else (c.status, c.reason, c.message)


def events(plan: Plan) -> list[Event]:
    return [a for a in plan.actions if isinstance(a, Event) and "LearningSignal" in a.reason]


def test_no_condition_until_the_streak_reaches_the_threshold() -> None:
    for streak in (None, 0, 4):
        plan = reconcile(world(running(streak)))
        assert condition(plan) is None
        assert events(plan) == []


def test_five_steps_without_variance_say_so_once_and_a_step_with_variance_clears_it() -> None:
    plan = reconcile(world(running(5)))
    got = condition(plan)
    assert got is not None
    assert got[:2] == ("True", "ZeroRewardVariance")
    assert "steps 5..9" in got[2]
    assert "answerField" in got[2]
    (ev,) = events(plan)
    assert (ev.type, ev.reason) == ("Warning", "NoLearningSignal")
    assert plan.status is not None
    again = reconcile(world(plan.status.model_copy(update={"learning_signal": running(6, 10).learning_signal})))
    assert condition(again) is not None
    assert events(again) == [], "said once"
    assert again.status is not None
    cleared = reconcile(world(again.status.model_copy(update={"learning_signal": running(0, 11).learning_signal})))
    assert condition(cleared) == ("False", "RewardVariance", "step 11 had groups whose rewards differ")
    (ev,) = events(cleared)
    assert (ev.type, ev.reason) == ("Normal", "LearningSignal")
