"""The periodic live list that repairs the pod cache after a watch gap: Kopf lists again after
a 410 Gone but drops an index entry only on a DELETED event, so a pod deleted in the gap would
stay in the job's index. The live list finds it gone, and the job's next pass makes a new
controller instead of waiting on one that no longer exists."""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

from spotrl_operator import handlers
from spotrl_operator.metrics import Metrics
from spotrl_operator.observe import Snapshot, ghosts, trim_pod, without, world_of
from spotrl_operator.reconcile import reconcile
from spotrl_operator.settings import Settings
from spotrl_operator.world import CreateControllerPod
from spotrl_runtime.kube import Kube

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
SETTINGS = Settings(default_storage="s3://bucket/root")
Obj = dict[str, Any]


def job() -> Obj:
    return {
        "apiVersion": "spotrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "j", "namespace": "ns", "uid": "u1", "generation": 1, "resourceVersion": "7"},
        "spec": {
            "policy": {"model": "builtin:tiny-arith"},
            "dataset": {"uri": "builtin:arithmetic"},
            "reward": {"name": "arithmetic_exact"},
            "training": {"totalSteps": 10},
        },
        "status": {"attempt": 1, "phase": "Running", "step": 3},
    }


def pod(name: str, uid: str, attempt: int = 1) -> Obj:
    labels = {"spotrl.dev/job": "j", "spotrl.dev/role": "controller", "spotrl.dev/attempt": str(attempt)}
    meta = {"name": name, "namespace": "ns", "uid": uid, "labels": labels}
    return trim_pod({"metadata": meta, "spec": {"nodeName": "spot-a"}, "status": {"phase": "Running"}})


class ApiServer:
    """Plays the API server's pod list for :class:`Kube` (the product's client, unchanged)."""

    def __init__(self, pods: list[Obj]):
        self.pods = pods
        self.asked: list[Any] = []

    def call_api(self, url: str, method: str, query_params: Any = None, **_: Any) -> Any:
        self.asked.append((method, url, dict(query_params or [])))
        body = json.dumps({"kind": "PodList", "items": self.pods}).encode()
        return SimpleNamespace(data=body, headers={})


def test_a_pod_deleted_in_a_watch_gap_is_found_gone_and_the_job_makes_a_new_controller() -> None:
    cached = (pod("j-controller-1", "c1"),)  # the index still holds it: its DELETED event was lost
    server = ApiServer(pods=[])
    ctx = handlers.Context(settings=SETTINGS, kube=Kube(server), metrics=Metrics())
    log = logging.getLogger("test")
    gone = asyncio.run(handlers._relist(ctx, "ns", "j", cached, log, frozenset()))  # type: ignore[arg-type]
    assert gone == {"c1"}
    (asked,) = server.asked
    assert asked[:2] == ("GET", "/api/v1/namespaces/ns/pods")
    assert asked[2]["labelSelector"].startswith("spotrl.dev/job=j,")

    stale = reconcile(world_of(Snapshot(job=job(), pods=cached, nodes={}), SETTINGS, NOW))
    assert not any(isinstance(a, CreateControllerPod) for a in stale.actions), "waits on the cached controller"
    repaired = reconcile(world_of(Snapshot(job=job(), pods=without(cached, gone), nodes={}), SETTINGS, NOW))
    assert any(isinstance(a, CreateControllerPod) for a in repaired.actions), repaired.actions


def test_only_pods_cached_before_the_list_and_missing_from_it_are_ghosts() -> None:
    a, b, c = pod("j-controller-1", "a"), pod("j-controller-2", "b", 2), pod("j-controller-3", "c", 3)
    assert ghosts([a, b], [b, c]) == {"a"}, "c, made after the list was cached, is no ghost"
    assert ghosts([a, b], [a, b]) == frozenset()
    assert without([a, b, c], frozenset({"a"})) == (b, c)


def test_a_failed_list_keeps_the_last_answer() -> None:
    class Down(ApiServer):
        def call_api(self, *args: Any, **kwargs: Any) -> Any:
            raise OSError("connection refused")

    ctx = handlers.Context(settings=SETTINGS, kube=Kube(Down([])), metrics=Metrics())
    kept = asyncio.run(handlers._relist(ctx, "ns", "j", (), logging.getLogger("t"), frozenset({"x"})))  # type: ignore[arg-type]
    assert kept == {"x"}


def test_the_jobs_daemon_lists_live_now_and_then_and_passes_over_the_ghosts(monkeypatch: Any) -> None:
    """The daemon itself (its passes recorded instead of run): the first passes see the cached
    controller; after RELIST_INTERVALS reconcile intervals it lists live, and from then on the
    pass does not see the pod the API server no longer has."""
    seen: list[tuple[str, ...]] = []

    def recorded_pass(ctx: Any, snap: Snapshot, logger: Any) -> tuple[float, None]:
        seen.append(tuple(p["metadata"]["uid"] for p in snap.pods))
        return 0.005, None

    class Stopped:
        def __bool__(self) -> bool:
            return bool(seen) and seen[-1] == ()

    monkeypatch.setattr(handlers, "pass_once", recorded_pass)
    server = ApiServer(pods=[])
    settings = Settings(default_storage="s3://bucket/root", reconcile_interval=0.02)
    ctx = handlers.Context(settings=settings, kube=Kube(server), metrics=Metrics())
    body = job()
    daemon = handlers.lifecycle(
        namespace="ns",
        name="j",
        body=body,  # type: ignore[arg-type]
        meta=body["metadata"],  # type: ignore[arg-type]
        stopped=Stopped(),  # type: ignore[arg-type]
        memo=SimpleNamespace(ctx=ctx),
        logger=logging.getLogger("test"),  # type: ignore[arg-type]
        job_pods={("ns", "j"): [pod("j-controller-1", "c1")]},
        job_pdbs={},
        job_storages={},
    )
    asyncio.run(asyncio.wait_for(daemon, 10))
    assert seen[0] == ("c1",), "no list at the start: the index was just filled"
    assert seen[-1] == ()
    assert len(server.asked) == 1, "one live list, once the period was up"
