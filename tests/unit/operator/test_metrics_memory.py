"""The operator's metrics state is bounded: driven through the handlers' own functions (no
cluster), 1,000 nodes created and deleted and 1,000 barriers of jobs that come and go leave it
as it started. Under spot churn a leader otherwise creeps toward its memory limit."""

from __future__ import annotations

import asyncio
from typing import Any

from kopf import Memo

from spotrl_operator import handlers
from spotrl_operator.metrics import MEMORY_SECONDS, Metrics
from spotrl_operator.settings import Settings
from spotrl_operator.world import Plan, RequestBarrier
from spotrl_runtime.api.rljob import BarrierStatus, LastRecovery, RLJobStatus
from spotrl_runtime.kube import Kube

NOTICE = {"key": "aws-node-termination-handler/spot-itn", "effect": "NoSchedule"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def context() -> tuple[handlers.Context, Memo, Clock]:
    clock = Clock()
    ctx = handlers.Context(settings=Settings(), kube=Kube(api_client=None), metrics=Metrics(clock=clock))
    return ctx, Memo(ctx=ctx), clock


def node(name: str, notice: bool) -> dict[str, Any]:
    status = {"conditions": [{"type": "Ready", "status": "True"}]}
    return {"metadata": {"name": name}, "spec": {"taints": [NOTICE] if notice else []}, "status": status}


async def node_event(memo: Memo, kind: str, body: dict[str, Any]) -> None:
    """What Kopf does with a Node event: the index first, then the event handler."""
    name = body["metadata"]["name"]
    if kind != "DELETED":
        await handlers.nodes_index(name=name, body=body, memo=memo)
    await handlers.node_changed(type=kind, name=name, memo=memo, pods_by_node={})


def test_a_thousand_nodes_created_with_a_notice_and_deleted_leave_nothing_behind() -> None:
    ctx, memo, clock = context()
    start = ctx.metrics.state_size()

    async def churn() -> None:
        for i in range(1000):
            await node_event(memo, "ADDED", node(f"spot-{i}", notice=True))
            await node_event(memo, "DELETED", node(f"spot-{i}", notice=True))
            clock.now += 1.0
        assert ctx.metrics.state_size() <= start + 1.1 * MEMORY_SECONDS + 1, "the last ~10 minutes of deletions"
        clock.now += MEMORY_SECONDS + 1
        await node_event(memo, "ADDED", node("last", notice=True))  # a sighting: the old ones age out
        await node_event(memo, "MODIFIED", node("last", notice=False))  # and its notice is gone

    asyncio.run(churn())
    assert ctx.metrics.state_size() == start
    view = ctx.fleet.view()
    assert (set(view.nodes), set(view.zone_of), dict(view.zones)) == ({"last"}, {"last"}, {"": view.zones[""]})
    assert ctx.changed_nodes == set()


def barrier(request_id: str, state: str) -> RLJobStatus:
    b = BarrierStatus(request_id=request_id, reason="taint: notice", node="spot-a", state=state)
    return RLJobStatus(barrier=b)


def test_a_thousand_barriers_are_counted_once_each_and_forgotten_with_their_jobs() -> None:
    ctx, _, _ = context()
    start = ctx.metrics.state_size()
    for i in range(1000):
        job = f"job-{i % 10}"
        requested = barrier(f"b{i}", "Requested")
        request = Plan(actions=[RequestBarrier(requested.barrier, "aws")], status=requested)  # type: ignore[arg-type]
        handlers._count(ctx, "ns", job, RLJobStatus(), request)
        committed = barrier(f"b{i}", "Committed")
        recovered = committed.model_copy(update={"last_recovery": LastRecovery(attempt=i + 1, total_seconds=5.0)})
        for _ in range(2):  # the next passes see the same answer: counted once
            handlers._count(ctx, "ns", job, committed, Plan(status=recovered))
    m = ctx.metrics
    sample = m.registry.get_sample_value
    assert sample("spotrl_operator_barriers_requested_total", {"provider": "aws"}) == 1000
    assert sample("spotrl_operator_barriers_committed_total") == 1000
    assert sample("spotrl_operator_recovery_seconds_count") == 1000
    assert m.state_size() <= start + 10 * (4 + 1 + 1 + 1), "per job: its last barriers, its phase, its recovery"
    for j in range(10):
        m.job_gone("ns", f"job-{j}")
    assert m.state_size() == start
