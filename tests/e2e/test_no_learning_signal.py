"""NoLearningSignal on the test control plane: the real KubeBridge (with the job's runtime
ServiceAccount) writes each step's count of steps without reward variance as
status.learningSignal, and the real operator turns 5 in a row into the condition and a
Warning Event, and clears it when a step has signal. No training controller runs: the
controller pod stays Pending and the test reports the steps through the bridge."""

from __future__ import annotations

from pathlib import Path

import pytest
from operator_harness import (
    NOWHERE,
    Jobs,
    OperatorProcess,
    condition_of,
    events_of_reason,
    runtime_bridge,
    tiny_job,
    wait_until,
)

from spotrl_e2e.cluster import Cluster

pytestmark = pytest.mark.cluster


def _condition(jobs: Jobs) -> dict | None:
    return condition_of(jobs, "tiny", "NoLearningSignal")


def test_five_steps_without_reward_variance_set_no_learning_signal_and_a_step_with_it_clears_it(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs, tmp_path: Path
) -> None:
    jobs.create(tiny_job("tiny", checkpoint={"storage": "s3://bucket-x/tiny"}, scheduling={"nodeSelector": NOWHERE}))
    jobs.wait("tiny", lambda s: s.get("attempt") == 1, 20, "started")
    bridge = runtime_bridge(cluster, namespace, "tiny", tmp_path)
    try:
        for step in range(1, 5):
            bridge.on_step(step, {"reward": 0.0, "steps_without_signal": float(step)})
        assert bridge.flush(10)
        assert jobs.status("tiny")["learningSignal"] == {
            "stepsWithoutSignal": 4,
            "threshold": 5,
            "step": 4,
            "rewardMean": 0.0,
        }
        assert _condition(jobs) is None, "4 steps are not yet 5"
        bridge.on_step(5, {"reward": 0.0, "steps_without_signal": 5.0})
        assert bridge.flush(10)
        wait_until(lambda: (_condition(jobs) or {}).get("status") == "True", 15, "NoLearningSignal True")
        cond = _condition(jobs)
        assert cond is not None
        assert cond["reason"] == "ZeroRewardVariance"
        assert "steps 1..5" in cond["message"]
        wait_until(lambda: bool(events_of_reason(jobs, "tiny", "NoLearningSignal")), 10, "the Warning Event")
        (event,) = events_of_reason(jobs, "tiny", "NoLearningSignal")
        assert event["type"] == "Warning"

        bridge.on_step(6, {"reward": 0.4, "steps_without_signal": 0.0})
        assert bridge.flush(10)
        wait_until(lambda: (_condition(jobs) or {}).get("status") == "False", 15, "NoLearningSignal False")
        assert _condition(jobs)["reason"] == "RewardVariance"  # type: ignore[index]
        wait_until(lambda: bool(events_of_reason(jobs, "tiny", "LearningSignal")), 10, "the LearningSignal Event")
        assert len(events_of_reason(jobs, "tiny", "NoLearningSignal")) == 1, "said once"
    finally:
        bridge.stop()
