"""The periodic live list that repairs the caches after a watch gap (:mod:`spotrl_operator.relist`):
Kopf lists again after a 410 Gone but drops an index entry only on a DELETED event, so an object
deleted in the gap would stay cached. One live list per kind finds it gone, and what the job's
pass reads passes over it: a new controller for a pod that is gone, its budget made again, a
deleted peer's storage no longer held against it, a deleted node out of its zone's counts."""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

from spotrl_operator import handlers
from spotrl_operator.metrics import Metrics
from spotrl_operator.observe import Snapshot, job_storage, trim_child, trim_node, trim_pdb, trim_pod, world_of
from spotrl_operator.reconcile import reconcile
from spotrl_operator.relist import Kind, ghosts, told, without
from spotrl_operator.resources import child_kinds
from spotrl_operator.settings import Settings
from spotrl_operator.world import CreateControllerPod, EnsureChildren
from spotrl_runtime.kube import Kube

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
SETTINGS = Settings(default_storage="s3://bucket/root")
OWNER = [{"kind": "RLJob", "uid": "u1", "controller": True}]
Obj = dict[str, Any]


def job(name: str = "j", uid: str = "u1", storage: str | None = None, created: str = "2026-11-30T10:00:00Z") -> Obj:
    spec: Obj = {
        "policy": {"model": "builtin:tiny-arith"},
        "dataset": {"uri": "builtin:arithmetic"},
        "reward": {"name": "arithmetic_exact"},
        "training": {"totalSteps": 10},
    }
    if storage:
        spec["checkpoint"] = {"storage": storage}
    meta = {"name": name, "namespace": "ns", "uid": uid, "generation": 1, "creationTimestamp": created}
    return {"apiVersion": "spotrl.dev/v1alpha1", "kind": "RLJob", "metadata": meta, "spec": spec}


def running(**kw: Any) -> Obj:
    return {**job(**kw), "status": {"attempt": 1, "phase": "Running", "step": 3}}


def pod(name: str, uid: str, attempt: int = 1) -> Obj:
    labels = {"spotrl.dev/job": "j", "spotrl.dev/role": "controller", "spotrl.dev/attempt": str(attempt)}
    meta = {"name": name, "namespace": "ns", "uid": uid, "labels": labels, "ownerReferences": OWNER}
    return trim_pod({"metadata": meta, "spec": {"nodeName": "spot-a"}, "status": {"phase": "Running"}})


def pdb(uid: str) -> Obj:
    return trim_pdb({"metadata": {"uid": uid, "ownerReferences": OWNER}, "spec": {"minAvailable": 1}})


def node(name: str, uid: str, zone: str = "z1", ready: str = "True") -> Obj:
    labels = {"topology.kubernetes.io/zone": zone}
    cond = [{"type": "Ready", "status": ready, "lastTransitionTime": "2026-11-30T11:00:00Z"}]
    return trim_node({"metadata": {"name": name, "uid": uid, "labels": labels}, "status": {"conditions": cond}})


class ApiServer:
    """Plays the API server's lists for :class:`Kube` (the product's client, unchanged): each
    collection's items by its path, with or without a namespace."""

    def __init__(self, items: dict[str, list[Obj]]):
        self.items = items
        self.asked: list[tuple[str, dict[str, Any]]] = []

    def call_api(self, url: str, method: str, query_params: Any = None, **_: Any) -> Any:
        params = dict(query_params or [])
        self.asked.append((url, params))
        plural = urlsplit(url).path.rsplit("/", 1)[-1]
        body = json.dumps({"kind": "List", "items": self.items.get(plural, []), "metadata": {}}).encode()
        return SimpleNamespace(data=body, headers={})


def listed(*uids: str) -> list[Obj]:
    return [{"metadata": {"uid": uid}} for uid in uids]


# ----------------------------------------------------------------------------- the pure part


def test_only_entries_cached_before_the_list_and_missing_from_it_are_ghosts() -> None:
    assert ghosts(frozenset({"a", "b"}), frozenset({"b", "c"}), frozenset()) == {"a"}, "c: made after, no ghost"
    assert ghosts(frozenset({"a", "b"}), frozenset({"a", "b"}), frozenset({"x"})) == frozenset(), "found again"
    # A failed list: the ghosts found before, those the cache still holds.
    assert ghosts(frozenset({"a", "b"}), None, frozenset({"a", "x"})) == {"a"}


def test_without_passes_over_ghosts_of_every_cached_shape() -> None:
    a, b = pod("j-controller-1", "a"), pod("j-controller-2", "b", 2)
    assert without([a, b], frozenset({"a"})) == (b,)
    assert without([pdb("p1")], frozenset({"p1"})) == ()
    assert without([trim_child("Service", {"metadata": {"uid": "s1"}})], frozenset({"s1"})) == ()
    peer = job_storage(job("old", uid="o1", storage="s3://bucket/shared"), SETTINGS)
    assert peer is not None
    assert without([peer], frozenset({"o1"})) == ()
    assert told({Kind("Pod", ("v1", "pods"), "job_pods"): frozenset({"a", "b"})}, frozenset({"a"})) == "1 Pod"
    assert told({Kind("Pod", ("v1", "pods"), "job_pods"): frozenset({"a"})}, frozenset({"a"})) is None


def test_what_the_pass_does_once_each_kinds_ghost_is_passed_over() -> None:
    """What a stale cache would cost, kind by kind, and what passing over the ghost changes."""
    gone = frozenset({"c1", "p1", "o1"})
    controller = (pod("j-controller-1", "c1"),)

    def plan(pods: tuple[Obj, ...], budget: Obj | None) -> list[object]:
        children = frozenset((k, "u1") for k in child_kinds(SETTINGS) if k != "PodDisruptionBudget")
        snap = Snapshot(job=running(), pods=pods, nodes={}, pdb=budget, children=children)
        return list(reconcile(world_of(snap, SETTINGS, NOW)).actions)

    stale = plan(controller, pdb("p1"))
    assert not any(isinstance(a, CreateControllerPod | EnsureChildren) for a in stale), "waits on a ghost"
    repaired = plan(without(controller, gone), None)
    assert any(isinstance(a, CreateControllerPod) for a in repaired), repaired
    assert [a.kinds for a in repaired if isinstance(a, EnsureChildren)] == [("PodDisruptionBudget",)]

    # A deleted older job on the same storage holds this one back until its ghost is passed over.
    mine = job(storage="s3://bucket/shared")
    peers = (job_storage(job("old", uid="o1", storage="s3://bucket/shared", created="2026-11-30T09:00:00Z"), SETTINGS),)
    held = world_of(Snapshot(job=mine, peers=peers), SETTINGS, NOW)  # type: ignore[arg-type]
    assert "ns/old" in (held.storage_conflict or "")
    assert world_of(Snapshot(job=mine, peers=without(peers, gone)), SETTINGS, NOW).storage_conflict is None  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- the live lists


def indexes(**entries: list[Any]) -> dict[str, Any]:
    """Kopf's indexes as the startup handler gets them: key -> entries."""
    return {name: {("ns", "j"): values} for name, values in entries.items()}


def test_one_list_per_kind_repairs_every_cache_and_wakes_the_jobs() -> None:
    """The controller pod, the budget, the Service, an older job on the same storage and a node,
    all deleted in a watch gap: one list of each kind (not one per job) finds each gone; the
    job's next pass (woken) passes over them, and the node no longer holds its zone's brake."""
    nodes = listed("n1", "n2", "n4")
    server = ApiServer(
        {"pods": listed("c2"), "poddisruptionbudgets": [], "services": [], "rljobs": listed("u1"), "nodes": nodes}
    )
    ctx = handlers.Context(settings=SETTINGS, kube=Kube(server), metrics=Metrics())
    for name, uid, ready in (
        ("a", "n1", "Unknown"),
        ("b", "n2", "Unknown"),
        ("c", "n3", "Unknown"),
        ("d", "n4", "True"),
    ):
        ctx.fleet.update(name, node(name, uid, ready=ready), NOW)
    assert ctx.fleet.view().held(0.55) == {"z1"}, "3 of the zone's 4 nodes not Ready: its force deletes paused"
    old = job_storage(job("old", uid="o1", storage="s3://bucket/x"), SETTINGS)
    caches = indexes(
        job_pods=[pod("j-controller-1", "c1")],
        job_pdbs=[pdb("p1")],
        children_services=[trim_child("Service", {"metadata": {"uid": "s1", "ownerReferences": OWNER}})],
    )
    caches["job_pods"][("ns", "k")] = [pod("k-controller-1", "c2")]  # another job's: one list serves both
    caches["job_storages"] = {None: [old, job_storage(job(storage="s3://bucket/y"), SETTINGS)]}
    woken = ctx.wakeup("ns", "j")

    asyncio.run(handlers.relist(ctx, caches))

    assert ctx.ghosts == {"c1", "p1", "s1", "o1", "n3"}
    assert woken.is_set(), "the job's next pass runs now, not at its period"
    assert set(ctx.fleet.view().nodes) == {"a", "b", "d"}
    assert ctx.fleet.view().held(0.55) == frozenset(), "2 of the 3 nodes left: below the brake's 3"
    assert handlers.job_children(caches, ("ns", "j"), ctx.ghosts) == frozenset()
    kinds = handlers.watched_kinds(SETTINGS)
    assert len(server.asked) == len(kinds), "one list per kind"
    asked = {url: params.get("labelSelector") for url, params in server.asked}
    assert asked["/api/v1/pods"] == "spotrl.dev/job,spotrl.dev/role"
    assert asked["/apis/policy/v1/poddisruptionbudgets"] == "spotrl.dev/job"
    assert asked["/api/v1/nodes"] is None
    assert {k.name for k in kinds} >= {"Pod", "PodDisruptionBudget", "Service", "RLJob", "Node"}

    # The next lists: the ghosts still cached are found again, and nothing new wakes the job.
    woken.clear()
    asyncio.run(handlers.relist(ctx, caches))
    assert ctx.ghosts == {"c1", "p1", "s1", "o1"}, "the node is no longer cached"
    assert not woken.is_set()


def test_with_watched_namespaces_each_is_listed_and_a_failed_list_keeps_what_it_found() -> None:
    settings = Settings(default_storage="s3://bucket/root", namespaces=("a", "b"))
    server = ApiServer({"pods": []})
    ctx = handlers.Context(settings=settings, kube=Kube(server), metrics=Metrics())
    caches = indexes(job_pods=[pod("j-controller-1", "c1")])
    asyncio.run(handlers.relist(ctx, caches))
    urls = [url for url, _ in server.asked]
    assert {"/api/v1/namespaces/a/pods", "/api/v1/namespaces/b/pods", "/api/v1/nodes"} <= set(urls)
    assert "/api/v1/pods" not in urls
    assert ctx.ghosts == {"c1"}

    class Down(ApiServer):
        def call_api(self, *args: Any, **kwargs: Any) -> Any:
            raise OSError("connection refused")

    ctx.kube = Kube(Down({}))
    asyncio.run(handlers.relist(ctx, caches))
    assert ctx.ghosts == {"c1"}, "kept: the list failed"


def test_the_jobs_daemon_passes_over_the_ghosts(monkeypatch: Any) -> None:
    """The daemon itself (its passes recorded instead of run): its pass reads the caches less the
    ghosts the live lists found."""
    seen: list[Snapshot] = []

    def recorded_pass(ctx: Any, snap: Snapshot, logger: Any) -> tuple[float, None]:
        seen.append(snap)
        return 0.005, None

    class Stopped:
        def __bool__(self) -> bool:
            return bool(seen)

    monkeypatch.setattr(handlers, "pass_once", recorded_pass)
    ctx = handlers.Context(settings=SETTINGS, kube=Kube(ApiServer({})), metrics=Metrics())
    ctx.ghosts = frozenset({"c1", "p1"})
    body = running()
    caches = indexes(job_pods=[pod("j-controller-1", "c1"), pod("j-controller-2", "c2", 2)], job_pdbs=[pdb("p1")])
    daemon = handlers.lifecycle(
        namespace="ns",
        name="j",
        body=body,  # type: ignore[arg-type]
        meta=body["metadata"],  # type: ignore[arg-type]
        stopped=Stopped(),  # type: ignore[arg-type]
        memo=SimpleNamespace(ctx=ctx),
        logger=logging.getLogger("test"),  # type: ignore[arg-type]
        job_storages={},
        **caches,
    )
    asyncio.run(asyncio.wait_for(daemon, 10))
    (snap,) = seen
    assert [p["metadata"]["uid"] for p in snap.pods] == ["c2"]
    assert snap.pdb is None


def test_a_deleted_node_is_forgotten_only_by_its_uid() -> None:
    """A node made again under the same name since the list (another uid) stays."""
    ctx = handlers.Context(settings=SETTINGS, kube=Kube(ApiServer({})), metrics=Metrics())
    ctx.fleet.update("spot-a", node("spot-a", "n-new"), NOW)
    assert ctx.fleet.forget(frozenset({"n-old"}), NOW) == []
    assert set(ctx.fleet.view().nodes) == {"spot-a"}
