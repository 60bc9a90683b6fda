"""A barrier sized to the notice, on a store made slow on purpose: the real controller
(`spotrl run`) writes its cuts to a real S3 server through the fault proxy and publishes its
barrier cut estimate (/status, as the bridge writes status.cutEstimate). On the fast store
the estimate fits the job's 5 s window; once every cut file PUT stalls, it grows past it
within a few cuts, and the operator's decision (reconcile) says BarrierAtRisk with an Event.
An actual barrier cut on that store then takes about what was estimated."""

from __future__ import annotations

import http.client
import json
import re
import signal
import time
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml
from controller_runs import Runs, stop, wait_for

from spotrl_e2e.faultproxy import FaultProxy
from spotrl_operator.reconcile import reconcile
from spotrl_operator.world import Event, PodView, World
from spotrl_runtime.api.rljob import CutEstimateStatus, RLJobStatus, parse_spec
from spotrl_runtime.core.cut_estimate import HEADROOM, CutEstimate, assess

pytestmark = [pytest.mark.slow, pytest.mark.s3]

WINDOW = 5  # spec.checkpoint.barrierDeadlineSeconds at its minimum
STALL = 0.5  # seconds every cut file PUT is held by the proxy


def _request(port: int, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _estimate(port: int) -> dict[str, Any] | None:
    status, doc = _request(port, "GET", "/status")
    return doc.get("cut_estimate") if status == 200 else None


def _decide(spec: Any, est: dict[str, Any]) -> tuple[str, list[Event]]:
    """The operator's pass over a running job whose controller published ``est``."""
    status = RLJobStatus(
        phase="Running",
        attempt=1,
        controller_pod="tiny-controller-1",
        controller_node="n1",
        cut_estimate=CutEstimateStatus(**est, attempt=1),
    )
    world = World(
        now=datetime.now(UTC),
        generation=1,
        spec=spec,
        status=status,
        pods=(PodView(name="tiny-controller-1", attempt=1, phase="Running", node="n1"),),
        deadline_caps={},
    )
    plan = reconcile(world)
    assert plan.status is not None
    cond = next(c for c in plan.status.conditions if c.type == "BarrierAtRisk")
    return cond.status, [a for a in plan.actions if isinstance(a, Event) and a.reason == "BarrierAtRisk"]


def test_a_slowed_store_puts_the_barrier_at_risk_and_the_estimate_matches_a_real_barrier(
    runs: Runs, s3_bucket: Any, fault_proxy: FaultProxy, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = {
        "training.totalSteps": 400,
        "checkpoint.everySteps": 1,
        "checkpoint.barrierDeadlineSeconds": WINDOW,
        "checkpoint.barrier": "full",  # auto would cut a delta, which fits: the risk is the full cut's
    }
    job = runs.job(overrides)
    spec = parse_spec(yaml.safe_load(job.read_text())["spec"])
    env = {**s3_bucket.env(), "AWS_ENDPOINT_URL_S3": fault_proxy.endpoint}
    proc = runs.start(job, f"s3://{s3_bucket.bucket}/job", "--http-port", "0", **env)
    try:
        wait_for(lambda: "controller endpoint: http://" in runs.log_of(proc), 120, "the endpoint", proc)
        found = re.search(r"controller endpoint: http://127\.0\.0\.1:(\d+) ", runs.log_of(proc))
        assert found, runs.log_of(proc)
        port = int(found.group(1))

        wait_for(lambda: (_estimate(port) or {}).get("based_on_cuts", 0) >= 3, 120, "three cuts", proc)
        fast = _estimate(port)
        assert fast is not None
        assert fast["seconds"] < WINDOW * HEADROOM, fast
        assert _decide(spec, fast) == ("False", [])

        fault_proxy.add("stall", method="PUT", key="/cuts/", seconds=STALL)
        t0 = time.monotonic()
        wait_for(lambda: (_estimate(port) or {}).get("seconds", 0) > WINDOW * HEADROOM, 60, "an estimate over", proc)
        noticed = time.monotonic() - t0
        slow = _estimate(port)
        assert slow is not None
        risk, events = _decide(spec, slow)
        assert risk == "True"
        (event,) = events
        assert event.type == "Warning"
        assert f"{WINDOW} s (spec.checkpoint.barrierDeadlineSeconds)" in event.message

        # A barrier now, on the same slow store (with room to finish): about the estimate.
        before = _estimate(port)
        assert before is not None
        asked = time.monotonic()
        status, cut = _request(port, "POST", "/barrier", {"reason": "test", "deadlineSeconds": 120})
        answered = time.monotonic() - asked  # with the wait for a periodic cut still being written
        assert status == 200, cut
        assert cut["kind"] == "barrier"
        actual = cut["seconds"]
        with capsys.disabled():
            print(
                f"\ncut estimate: fast store {fast['seconds']:.2f} s, stalled PUTs ({STALL} s) "
                f"{before['seconds']:.2f} s (noticed in {noticed:.1f} s); actual barrier {actual:.2f} s "
                f"(request to answer {answered:.2f} s, behind a periodic cut; "
                f"worst case estimated {2 * before['seconds']:.2f} s)"
            )
        assert actual > WINDOW * HEADROOM, "the barrier really would not have fitted"
        assert 0.5 * before["seconds"] <= actual <= 2.0 * before["seconds"], (before, actual)
        # From the request: the cut writer may first finish a periodic cut (every step here).
        worst = assess(CutEstimate(**before), WINDOW, every_steps=1, every_seconds=0).worst_seconds
        assert answered <= 1.5 * worst, (answered, worst)
    finally:
        if proc.poll() is None:
            stop(proc, signal.SIGTERM, timeout=120)
