"""BarrierAtRisk on the test control plane: the real KubeBridge (with the job's runtime
ServiceAccount) writes the controller's barrier cut estimate as status.cutEstimate, the
real operator compares it with the job's 5 s window and says so: the condition and a
Warning Event, then BarrierFits when a faster estimate comes. No training controller runs:
the controller pod stays Pending and the test reports the cuts through the bridge."""

from __future__ import annotations

import time
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
from spotrl_runtime.controller.control import CutInfo
from spotrl_runtime.core.cut_estimate import CutEstimate

pytestmark = pytest.mark.cluster


def _cut(n: int, seconds: float) -> CutInfo:
    est = CutEstimate(
        seconds=seconds,
        bytes=400_000_000,
        bytes_per_second=400_000_000 / (seconds - 0.5),
        overhead_seconds=0.5,
        based_on_cuts=n,
        step_seconds=2.0,
    )
    return CutInfo(
        f"{n:010d}", 10 * n, f"s3://bucket-x/tiny/cuts/{n:010d}", "periodic", time.time(), seconds, estimate=est
    )


def _risk(jobs: Jobs) -> dict | None:
    return condition_of(jobs, "tiny", "BarrierAtRisk")


def test_a_slow_estimate_sets_barrier_at_risk_with_an_event_and_a_fast_one_clears_it(
    cluster: Cluster, namespace: str, operator: OperatorProcess, jobs: Jobs, tmp_path: Path
) -> None:
    jobs.create(
        tiny_job(
            "tiny",
            checkpoint={
                "storage": "s3://bucket-x/tiny",
                "barrierDeadlineSeconds": 5,
                "everySteps": 20,
                "deltaEverySteps": 0,  # full cuts alone: their cadence bounds the loss, and is the advice
                "barrier": "full",
            },
            scheduling={"nodeSelector": NOWHERE},
        )
    )
    jobs.wait("tiny", lambda s: s.get("attempt") == 1, 20, "started")
    bridge = runtime_bridge(cluster, namespace, "tiny", tmp_path)
    try:
        bridge.on_cut(_cut(1, 12.0))
        assert bridge.flush(10)
        est = jobs.status("tiny")["cutEstimate"]
        assert est["seconds"] == 12.0
        assert est["basedOnCuts"] == 1
        assert est["stepSeconds"] == 2.0
        assert est["attempt"] == 1
        wait_until(lambda: (_risk(jobs) or {}).get("status") == "True", 15, "BarrierAtRisk True")
        cond = _risk(jobs)
        assert cond is not None
        assert cond["reason"] == "CutTooSlow"
        assert "12.0 s" in cond["message"]
        assert "5 s (spec.checkpoint.barrierDeadlineSeconds)" in cond["message"]
        assert "set checkpoint.everySteps to 6" in cond["message"]
        wait_until(lambda: bool(events_of_reason(jobs, "tiny", "BarrierAtRisk")), 10, "the BarrierAtRisk Event")
        (event,) = events_of_reason(jobs, "tiny", "BarrierAtRisk")
        assert event["type"] == "Warning"

        bridge.on_cut(_cut(2, 1.5))
        assert bridge.flush(10)
        wait_until(lambda: (_risk(jobs) or {}).get("status") == "False", 15, "BarrierAtRisk False")
        assert _risk(jobs)["reason"] == "BarrierFits"  # type: ignore[index]
        wait_until(lambda: bool(events_of_reason(jobs, "tiny", "BarrierFits")), 10, "the BarrierFits Event")
        assert len(events_of_reason(jobs, "tiny", "BarrierAtRisk")) == 1, "said once"
    finally:
        bridge.stop()
