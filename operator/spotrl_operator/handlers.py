"""Kopf handlers: thin glue between watch events and the plain functions that decide and act.

- One **lifecycle daemon** per RLJob runs observe → reconcile → actuate, level-triggered,
  every ``--reconcile-interval`` seconds, and at once when something wakes it: a change of
  the RLJob, of one of its pods, or of a Node under them (so a notice becomes a barrier
  request within one pass, not one period).
- **Indexes** (Kopf's watch caches) hold the job's pods (controllers, generation workers
  and trainers), its PDB, every Node, trimmed, and every RLJob's effective storage; a pass
  reads them and sends no request unless it has something to write. A live list of each
  kind now and then finds what a watch gap left in them (:mod:`~spotrl_operator.relist`).
- **create/resume** make the job's ServiceAccount, Role, RoleBinding, Service and PDB
  (retried with :class:`kopf.TemporaryError`); **delete** (a finalizer) stops the pods and
  applies ``spec.checkpoint.retentionPolicy``.

Everything a decision needs lives on the RLJob and the pods, so a restarted operator (or a
newly elected replica) carries on where the last one stopped. In memory are only caches,
wake-ups and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

import kopf

from spotrl_operator import queueing, retention
from spotrl_operator.actuate import Actuator, ConflictError, failure_budget
from spotrl_operator.fleet import Fleet
from spotrl_operator.metrics import Metrics
from spotrl_operator.observe import (
    Snapshot,
    confirm_missing,
    fetch,
    job_storage,
    seconds_until_lost,
    trim_child,
    trim_node,
    trim_pdb,
    trim_pod,
    trim_workload,
    workload_owner,
    world_of,
)
from spotrl_operator.reconcile import reconcile
from spotrl_operator.relist import RELIST_INTERVALS, Kind, cached_uids, find, told, without
from spotrl_operator.resources import DEFAULT_SECRET_ANNOTATION, JOB_LABEL, ROLE_LABEL, default_secret_to_record
from spotrl_operator.settings import Settings
from spotrl_operator.signals import node_signals, pod_signals
from spotrl_operator.storage_overlap import JobStorage
from spotrl_operator.world import CreateControllerPod, Plan, RequestBarrier
from spotrl_runtime.api import rljob as api
from spotrl_runtime.api.rljob import SpecError
from spotrl_runtime.kube import Kube, KubeError

log = logging.getLogger("spotrl.operator")
Obj = dict[str, Any]
RLJOBS = (api.GROUP, api.VERSION, api.PLURAL)
FINALIZER = "spotrl.dev/finalizer"
CONFLICT_RETRIES = 5
TERMINAL = frozenset({"Succeeded", "Failed"})
"""Phases after which a job has nothing left to do: it is passed over only when something wakes it."""
BEAT_SECONDS = 5.0


@dataclass
class Context:
    """What every handler shares (handed to Kopf as ``memo.ctx``)."""

    settings: Settings
    kube: Kube
    metrics: Metrics
    actuator: Actuator = field(init=False)
    executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(16, "spotrl-io"))
    handler_executor: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(16, "spotrl-handlers"))
    """Kopf's, for the synchronous handlers (create, delete): ours, so that a stop can wait for them."""
    wakeups: dict[tuple[str, str], asyncio.Event] = field(default_factory=dict)
    woken_at: dict[tuple[str, str], float] = field(default_factory=dict)
    backing_off: dict[tuple[str, str], str] = field(default_factory=dict)
    """The resourceVersion a failed pass's own status write gave the job: its watch event is not
    a change to act on, and must not cut the pass's backoff short (:func:`_wait`)."""
    woken_by: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    """What woke each job since its last pass: the job's resourceVersion for a change of the job,
    "" for anything else (a pod, a node, a relist)."""
    fleet: Fleet = field(init=False)
    changed_nodes: set[str] = field(default_factory=set)
    """Nodes whose last event changed what passes read (set by the index, taken by the event handler)."""
    beat_task: asyncio.Task[None] | None = None
    relist_task: asyncio.Task[None] | None = None
    ghosts: frozenset[str] = frozenset()
    """The uids of the cache entries the last live lists found gone (:mod:`~spotrl_operator.relist`):
    every reader passes over them."""

    def __post_init__(self) -> None:
        self.actuator = Actuator(self.kube, self.settings, on_action=self._on_action)
        self.fleet = Fleet(self.settings.extra_taint_keys)

    def wakeup(self, namespace: str, name: str) -> asyncio.Event:
        return self.wakeups.setdefault((namespace, name), asyncio.Event())

    def wake_all(self) -> None:
        for event in self.wakeups.values():
            event.set()

    def wake(self, namespace: str | None, name: str, version: str = "") -> None:
        """Runs the job's next pass now instead of at its next period (``version``: the job's
        resourceVersion when a change of the job itself wakes it)."""
        key = (namespace or "", name)
        event = self.wakeups.get(key)
        if event is not None:
            self.woken_at.setdefault(key, time.monotonic())
            self.woken_by.setdefault(key, set()).add(version)
            event.set()

    def _on_action(self, job: Obj, action: object) -> None:
        if isinstance(action, CreateControllerPod):
            self.metrics.controllers_created.inc()

    def drain(self, seconds: float) -> bool:
        """Waits up to ``seconds`` for the calls still running in the worker threads (Kopf has
        stopped: a daemon cancelled while its pass runs leaves the pass running); True when none is left."""
        deadline = time.monotonic() + seconds
        for pool in (self.executor, self.handler_executor):
            waiter = threading.Thread(target=pool.shutdown, kwargs={"cancel_futures": True}, daemon=True)
            waiter.start()
            waiter.join(max(0.0, deadline - time.monotonic()))
            if waiter.is_alive():
                return False
        return True

    async def io(self, fn: Any, *args: Any) -> Any:
        """Runs a blocking call (the Kubernetes client, storage) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


def ctx_of(memo: Any) -> Context:
    ctx: Context = memo.ctx
    return ctx


# ----------------------------------------------------------------------------- start-up


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: Any, **kwargs: Any) -> None:
    """Kopf keeps its own bookkeeping in annotations (never in status, which is ours and the
    controller's), posts only warnings as Events (ours are the user's), watches only the
    pods and PDBs that carry the job label, and needs no CRD/namespace scanning. ``kwargs``
    holds Kopf's indexes (filled once the watches list), for the live lists that check them."""
    ctx = ctx_of(memo)
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="kopf.spotrl.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="kopf.spotrl.dev", key="last-handled-configuration"
    )
    # Kopf would post an Event per handler retry (one every 2 s while a deletion waits); ours
    # are counted up instead (Actuator.post_event), so Kopf posts none.
    settings.posting.enabled = False
    settings.peering.standalone = True  # one active replica: the Lease (leader.py) decides which
    settings.scanning.disabled = True
    settings.watching.label_selectors["v1", "pods"] = JOB_LABEL
    settings.watching.label_selectors["policy", "v1", "poddisruptionbudgets"] = JOB_LABEL
    for resource in CHILDREN.values():
        settings.watching.label_selectors[resource] = JOB_LABEL
    settings.execution.executor = ctx.handler_executor
    settings.execution.max_workers = 16
    settings.watching.chunk_size = 500  # the first LIST of 2,000 Nodes, in parts: memory stays bounded
    ctx.beat_task = asyncio.get_running_loop().create_task(_beat(ctx))
    ctx.relist_task = asyncio.get_running_loop().create_task(_relisting(ctx, kwargs))


@kopf.on.cleanup()
async def stop_beating(memo: Any, **_: Any) -> None:
    """Ends the beat and the live lists with Kopf: a task left running would hold the event
    loop's shutdown, and the process would be killed instead of releasing the Lease."""
    ctx = ctx_of(memo)
    for task in (ctx.beat_task, ctx.relist_task):
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def _beat(ctx: Context) -> None:
    """Shows the liveness probe that the event loop runs (a stuck loop stops beating)."""
    while True:
        ctx.metrics.beating()
        fleet = ctx.fleet.view()
        ctx.metrics.unhealthy_nodes.set(len(fleet.unhealthy_since))
        ctx.metrics.force_deletes_paused.set(int(fleet.braking(ctx.settings.unhealthy_node_share)))
        await asyncio.sleep(BEAT_SECONDS)


# ----------------------------------------------------------------------------- caches


@kopf.index("v1", "nodes")
async def nodes_index(name: str, body: kopf.Body, memo: Any, **_: Any) -> dict[Any, Any]:
    """Feeds the :class:`~spotrl_operator.fleet.Fleet` (an index, so that Kopf lists every Node
    before any job's first pass); the index itself keeps only the names."""
    ctx = ctx_of(memo)
    if ctx.fleet.update(name, trim_node(dict(body)), ctx.kube.server_clock.now()):
        ctx.changed_nodes.add(name)
    return {name: True}


@kopf.index("v1", "pods", labels={JOB_LABEL: kopf.PRESENT, ROLE_LABEL: kopf.PRESENT})
async def job_pods(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, labels[JOB_LABEL]): trim_pod(dict(body))}


@kopf.index("v1", "pods", labels={JOB_LABEL: kopf.PRESENT, ROLE_LABEL: kopf.PRESENT})
async def pods_by_node(namespace: str | None, labels: kopf.Labels, spec: kopf.Spec, **_: Any) -> dict[Any, Any] | None:
    node = spec.get("nodeName")
    return {node: (namespace, labels[JOB_LABEL])} if node else None


@kopf.index(*RLJOBS)
async def job_storages(body: kopf.Body, memo: Any, **_: Any) -> dict[Any, Any] | None:
    """Every RLJob's effective storage, to find two jobs on one store (:mod:`~spotrl_operator.storage_overlap`).
    A job being deleted holds no other back: it writes no more once its pods are gone."""
    if body.get("metadata", {}).get("deletionTimestamp"):
        return None
    found = job_storage(dict(body), ctx_of(memo).settings)
    return {None: found} if found is not None else None


@kopf.index("policy", "v1", "poddisruptionbudgets", labels={JOB_LABEL: kopf.PRESENT})
async def job_pdbs(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
    return {(namespace, labels[JOB_LABEL]): trim_pdb(dict(body))}


def _own_workload(
    index: Mapping[Any, Iterable[Obj]] | None, namespace: str, name: str, meta: kopf.Meta, ghosts: frozenset[str]
) -> Obj | None:
    """The Workload the operator made for this RLJob (by its deterministic name: an older one
    of a job deleted and made again under the same name is not it), the ``ghosts`` passed over."""
    want = queueing.workload_name(name, str(meta.get("uid", "")))
    found = [w for w in without((index or {}).get((namespace, name), ()), ghosts) if w["metadata"].get("name") == want]
    return found[0] if found else None


def _first(store: Iterable[Any] | None) -> Any:
    return next(iter(store), None) if store is not None else None


def cached_flavors(index: Mapping[str, Iterable[Obj]]) -> dict[str, Obj]:
    return {name: spec for name, store in index.items() if (spec := _first(store)) is not None}


# ----------------------------------------------------------------------------- wake-ups


@kopf.on.event("v1", "nodes")
async def node_changed(type: str, name: str, memo: Any, **kwargs: Any) -> None:
    """A Node changed: wake the jobs whose controller, workers or trainers run there (only if what the
    signals read changed, not on every heartbeat)."""
    ctx = ctx_of(memo)
    pods_by_node: kopf.Index[str, tuple[str, str]] = kwargs["pods_by_node"]
    if type == "DELETED":
        changed = ctx.fleet.update(name, None, ctx.kube.server_clock.now())
    else:
        changed = name in ctx.changed_nodes
        ctx.changed_nodes.discard(name)
    if not changed:
        return
    node = ctx.fleet.view().nodes.get(name)
    if node is None:
        _node_gone(ctx, name)
    else:
        signals = node_signals(node, ctx.settings.extra_taint_keys)
        for sig in signals:
            ctx.metrics.signal_seen(name, sig.reason)
        if not signals:
            ctx.metrics.signal_gone(name)
    for namespace, job in set(pods_by_node.get(name, [])):
        ctx.wake(namespace, job)


def _node_gone(ctx: Context, name: str) -> None:
    ctx.metrics.signal_gone(name)  # its other sightings go with it; this one ages out (metrics.MEMORY_SECONDS)
    ctx.metrics.signal_seen(name, "node-deleted: the Node object is gone")


@kopf.on.event("v1", "pods", labels={JOB_LABEL: kopf.PRESENT})
async def pod_changed(namespace: str | None, labels: kopf.Labels, body: kopf.Body, memo: Any, **_: Any) -> None:
    ctx = ctx_of(memo)
    for sig in pod_signals(body):
        ctx.metrics.signal_seen(sig.node, sig.reason)
    ctx.wake(namespace, labels[JOB_LABEL])


@kopf.on.event(*RLJOBS)
async def rljob_changed(type: str, namespace: str | None, name: str, meta: kopf.Meta, memo: Any, **_: Any) -> None:
    ctx = ctx_of(memo)
    ctx.wake(namespace, name, str(meta.get("resourceVersion") or ""))
    if type == "DELETED":  # a job held by this one's storage (StorageConflict) may start now
        ctx.wake_all()


# ----------------------------------------------------------------------------- Kueue


async def job_workloads(namespace: str | None, body: kopf.Body, **_: Any) -> dict[Any, Any] | None:
    owner = workload_owner(dict(body))
    return {(namespace, owner): trim_workload(dict(body))} if owner else None


async def flavors_index(name: str, spec: kopf.Spec, **_: Any) -> dict[Any, Any]:
    return {name: dict(spec)}


async def workload_changed(namespace: str | None, body: kopf.Body, memo: Any, **_: Any) -> None:
    owner = workload_owner(dict(body))
    if owner:
        ctx_of(memo).wake(namespace, owner)


def register_kueue() -> None:
    """With the operator setting ``kueue``: watch Kueue's Workloads (those an RLJob owns wake it)
    and ResourceFlavors. Only then: Kopf waits for every index's first list, and a cluster
    without Kueue's CRDs has none to give."""
    kopf.index(queueing.GROUP, queueing.VERSION, "workloads")(job_workloads)
    kopf.index(queueing.GROUP, queueing.VERSION, "resourceflavors")(flavors_index)
    kopf.on.event(queueing.GROUP, queueing.VERSION, "workloads")(workload_changed)


# ----------------------------------------------------------------------------- children

CHILDREN: dict[str, tuple[str, str] | tuple[str, str, str]] = {
    "ServiceAccount": ("v1", "serviceaccounts"),
    "Role": ("rbac.authorization.k8s.io", "v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io", "v1", "rolebindings"),
    "Service": ("v1", "services"),
    "NetworkPolicy": ("networking.k8s.io", "v1", "networkpolicies"),
}
"""The job's objects besides its pods and PDB, watched so that one deleted is made again."""


def _child_index(kind: str) -> Any:
    async def index(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_: Any) -> dict[Any, Any]:
        return {(namespace, labels[JOB_LABEL]): trim_child(kind, dict(body))}

    return index


def watched_children(settings: Settings) -> dict[str, tuple[str, ...]]:
    """The kinds of :data:`CHILDREN` the settings make (a NetworkPolicy only with ``network_policy``)."""
    return {k: r for k, r in CHILDREN.items() if k != "NetworkPolicy" or settings.network_policy}


def register_children(settings: Settings) -> None:
    """Watches the job's objects (by the job label) into one index per kind."""
    for kind, resource in watched_children(settings).items():
        kopf.index(*resource, labels={JOB_LABEL: kopf.PRESENT}, id=f"children_{resource[-1]}")(_child_index(kind))


def job_children(
    indexes: Mapping[str, Any], key: tuple[str, str], ghosts: frozenset[str] = frozenset()
) -> frozenset[tuple[str, str]]:
    """The job's objects as (kind, owner uid), the ``ghosts`` passed over."""
    return frozenset(
        (entry["kind"], entry["metadata"]["owner"] or "")
        for resource in CHILDREN.values()
        for entry in without((indexes.get(f"children_{resource[-1]}") or {}).get(key, ()), ghosts)
    )


@kopf.on.create(*RLJOBS)
@kopf.on.resume(*RLJOBS)
def ensure_children(body: kopf.Body, memo: Any, logger: kopf.Logger, **_: Any) -> None:
    """The runtime's ServiceAccount/Role/RoleBinding, the Service and the (closed) PDB."""
    ctx = ctx_of(memo)
    try:
        created = ctx.actuator.ensure_children(copy.deepcopy(dict(body)))
    except KubeError as err:
        raise kopf.TemporaryError(f"creating the job's objects: {err}", delay=5) from err
    if created:
        log.info("%s/%s: created %s", body["metadata"]["namespace"], body["metadata"]["name"], ", ".join(created))


@kopf.on.create(*RLJOBS)
@kopf.on.resume(*RLJOBS)
@kopf.on.update(*RLJOBS)
def record_default_secret(body: kopf.Body, patch: kopf.Patch, memo: Any, **_: Any) -> None:
    """Records the settings' default credentials Secret on a job that has none recorded (new, or
    its author took the record off), so that a later default (a helm upgrade) does not reach its
    pods unchecked (:data:`~spotrl_operator.resources.DEFAULT_SECRET_ANNOTATION`)."""
    value = default_secret_to_record(body, ctx_of(memo).settings)
    if value is not None:
        patch.metadata.annotations[DEFAULT_SECRET_ANNOTATION] = value


@kopf.on.update(*RLJOBS, field="spec")
async def spec_changed(namespace: str | None, name: str, memo: Any, **_: Any) -> None:
    """spec.suspend and friends: the daemon decides; wake it now."""
    ctx_of(memo).wake(namespace, name)


# ----------------------------------------------------------------------------- live lists


def watched_kinds(settings: Settings) -> tuple[Kind, ...]:
    """Every kind a pass reads from a cache, with the index that caches it and its watch's labels."""
    kinds = [
        Kind("Pod", ("v1", "pods"), "job_pods", f"{JOB_LABEL},{ROLE_LABEL}"),
        Kind("PodDisruptionBudget", ("policy", "v1", "poddisruptionbudgets"), "job_pdbs", JOB_LABEL),
        *(Kind(kind, res, f"children_{res[-1]}", JOB_LABEL) for kind, res in watched_children(settings).items()),
        Kind(api.KIND, RLJOBS, "job_storages"),
        Kind("Node", ("v1", "nodes"), "", namespaced=False),
    ]
    if settings.kueue:
        kinds.append(Kind("Workload", (queueing.GROUP, queueing.VERSION, "workloads"), "job_workloads"))
    return tuple(kinds)


def _cached(ctx: Context, kind: Kind, indexes: Mapping[str, Any]) -> frozenset[str]:
    """The uids a kind's cache holds now."""
    if not kind.index:
        return cached_uids(ctx.fleet.view().nodes.values())
    index = indexes.get(kind.index) or {}
    return cached_uids(entry for entries in index.values() for entry in entries)


async def _relisting(ctx: Context, indexes: Mapping[str, Any]) -> None:
    """Every ``RELIST_INTERVALS`` reconcile intervals, :func:`relist` (one live list per kind)."""
    while True:
        await asyncio.sleep(ctx.settings.reconcile_interval * RELIST_INTERVALS)
        try:
            await relist(ctx, indexes)
        except Exception:  # a bug here must not end the checks for good
            log.exception("checking the caches against the API server")


async def relist(ctx: Context, indexes: Mapping[str, Any]) -> None:
    """Lists each cached kind from the API server; the entries the caches hold that it lacks
    (a watch gap's) are passed over from now on (:attr:`Context.ghosts`), the Fleet forgets
    its gone nodes, and, if any is new, every job's next pass runs now."""
    cached = {kind: _cached(ctx, kind, indexes) for kind in watched_kinds(ctx.settings)}  # before any list
    found = await ctx.io(find, ctx.kube, cached, ctx.settings.namespaces, ctx.ghosts)
    new, ctx.ghosts = told(found, ctx.ghosts), frozenset().union(*found.values())
    for name in ctx.fleet.forget(ctx.ghosts, ctx.kube.server_clock.now()):
        _node_gone(ctx, name)
    if new:
        log.warning("the caches held %s that the API server no longer has (a missed watch event)", new)
        ctx.wake_all()


# ----------------------------------------------------------------------------- lifecycle


@kopf.daemon(*RLJOBS, cancellation_timeout=5.0)
async def lifecycle(
    namespace: str | None,
    name: str,
    body: kopf.Body,
    meta: kopf.Meta,
    stopped: kopf.DaemonStopped,
    memo: Any,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    """Observe → reconcile → actuate, until the job is deleted or the operator stops."""
    ctx = ctx_of(memo)
    job_pods: kopf.Index[tuple[str, str], Obj] = kwargs["job_pods"]
    job_pdbs: kopf.Index[tuple[str, str], Obj] = kwargs["job_pdbs"]
    storages: kopf.Index[None, JobStorage] = kwargs["job_storages"]
    namespace = namespace or ""
    key = (namespace, name)
    wake = ctx.wakeup(namespace, name)
    pending: tuple[str, Obj] | None = None  # (resourceVersion before our write, the job it returned)
    try:
        while not stopped and not meta.get("deletionTimestamp"):
            wake.clear()
            ctx.woken_by.pop(key, None)
            woken = ctx.woken_at.pop(key, None)
            if woken is not None:
                ctx.metrics.pass_lag.observe(time.monotonic() - woken)
            job = copy.deepcopy(dict(body))
            if pending is not None and job["metadata"].get("resourceVersion") == pending[0]:
                job = pending[1]  # our own status write has not come back through the watch yet
            fleet = ctx.fleet.view()
            ghosts = ctx.ghosts  # what a watch gap left in the caches (relist): passed over
            pods = without(job_pods.get(key, ()), ghosts)
            snap = Snapshot(
                job=job,
                pods=pods,
                nodes=fleet.nodes,
                fleet=fleet,
                children=job_children(kwargs, key, ghosts),
                pdb=_first(without(job_pdbs.get(key, ()), ghosts)),
                peers=without(storages.get(None, ()), ghosts),
                workload=_own_workload(kwargs.get("job_workloads"), namespace, name, meta, ghosts),
                flavors=cached_flavors(kwargs.get("flavors_index") or {}),
                server_offset=timedelta(seconds=ctx.kube.server_clock.offset()),
            )
            started = time.monotonic()
            delay, written = await ctx.io(pass_once, ctx, snap, logger)
            ctx.metrics.pass_seconds.observe(time.monotonic() - started)
            pending = (job["metadata"].get("resourceVersion", ""), written) if written is not None else None
            if _finished(written or job) and not pods:
                delay = None  # nothing left to do: only a change of the job (or a pod of it) wakes it
            await _wait(ctx, key, wake, delay)
    finally:
        ctx.wakeups.pop(key, None)
        ctx.woken_at.pop(key, None)
        ctx.backing_off.pop(key, None)
        ctx.woken_by.pop(key, None)
        ctx.actuator.backoffs.forget(str(meta.get("uid", "")))
        ctx.metrics.job_gone(namespace, name)


async def _wait(ctx: Context, key: tuple[str, str], wake: asyncio.Event, delay: float | None) -> None:
    """Until the job's next pass is due (``delay`` seconds; None: until woken) or something wakes
    it, but for the condition its own failed pass wrote coming back through the watch: that
    would run the next failing pass at once, each writing the next, with no backoff at all."""
    deadline = None if delay is None else time.monotonic() + delay
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            await asyncio.wait_for(wake.wait(), timeout=timeout)
        except TimeoutError:
            return
        own = ctx.backing_off.get(key)
        if own is None or ctx.woken_by.get(key, set()) - {own}:
            return
        wake.clear()
        ctx.woken_by.pop(key, None)
        ctx.woken_at.pop(key, None)


def _finished(job: Obj) -> bool:
    return (job.get("status") or {}).get("phase") in TERMINAL


def pass_once(ctx: Context, snap: Snapshot, logger: kopf.Logger) -> tuple[float, Obj | None]:
    """One level-triggered pass (in a worker thread). Returns (seconds to the next pass, the
    job as our status write returned it, if we wrote). On a write conflict it observes
    fresh from the API server and tries again, a few times; a pass that fails as a whole (the
    API server refuses the status, or is unreachable) waits out a backoff like a failed action."""
    try:
        return _pass(ctx, snap, logger)
    except Exception as err:  # a bug, or a shape this version cannot read: report it and back off, never stop
        logger.exception("the pass failed: %s", err)
        problem = KubeError("", "", 0, type(err).__name__, f"the operator's pass failed: {err}")
        return _pass_failed(ctx, snap.job, problem, logger), None


def _pass(ctx: Context, snap: Snapshot, logger: kopf.Logger) -> tuple[float, Obj | None]:
    interval = ctx.settings.reconcile_interval
    meta = snap.job["metadata"]
    ns, name, uid = meta["namespace"], meta["name"], str(meta.get("uid", ""))
    for _ in range(CONFLICT_RETRIES):
        try:
            if snap.gone is None:
                snap = confirm_missing(ctx.kube, snap)
            world = world_of(snap, ctx.settings)
            plan = reconcile(world)
            applied = ctx.actuator.apply(snap, plan)
        except ConflictError:
            ctx.metrics.reconciles.labels("conflict").inc()
            try:
                fresh = fetch(ctx.kube, ns, name, snap.nodes, snap.peers, kueue=ctx.settings.kueue)
            except KubeError as err:
                return _pass_failed(ctx, snap.job, err, logger), None
            if fresh is None:
                return interval, None
            snap = replace(fresh, fleet=snap.fleet, server_offset=snap.server_offset)  # the nodes: the cache's
            continue
        except SpecError as err:  # a value this version cannot read: said on the job, and retried
            logger.error("the RLJob's spec does not parse (a CRD newer or older than the operator?): %s", err)
            unreadable = KubeError("", "", 0, "SpecNotUnderstood", f"this operator cannot read the spec: {err}")
            return _pass_failed(ctx, snap.job, unreadable, logger), None
        except (KubeError, OSError) as err:
            return _pass_failed(ctx, snap.job, err, logger), None
        ctx.actuator.backoffs.succeeded(uid, PASS_KEY)
        ctx.backing_off.pop((ns, name), None)
        ctx.metrics.reconciles.labels("error" if applied.failed else "ok").inc()
        for part in sorted({p.split(".", 1)[0] for p in world.skipped_fields}):
            ctx.metrics.skipped_fields.labels(part).inc()
        _count(ctx, ns, name, world.status, plan)
        requeue = plan.requeue_after if plan.requeue_after is not None else interval
        lost_in = seconds_until_lost(snap, ctx.settings, world.now)
        return max(0.05, min(requeue, interval, lost_in if lost_in is not None else interval)), applied.job
    conflicts = KubeError("PATCH", f"{ns}/{name}/status", 409, "Conflict", f"{CONFLICT_RETRIES} conflicts in a row")
    return _pass_failed(ctx, snap.job, conflicts, logger), None


PASS_KEY = "pass"
"""The backoff key of a whole pass (observe, decide, write the status)."""


def _pass_failed(ctx: Context, job: Obj, err: Exception, logger: kopf.Logger) -> float:
    """Records a failed pass; returns the seconds to wait before the next (a watch event that
    wakes the job still runs it sooner)."""
    ctx.metrics.reconciles.labels("error").inc()
    kerr = err if isinstance(err, KubeError) else KubeError("", "", 0, "Unreachable", str(err))
    now = ctx.actuator.clock()
    uid = str(job["metadata"].get("uid", ""))
    failure = ctx.actuator.backoffs.failed(uid, PASS_KEY, "reconciling", kerr, failure_budget(job), now)
    logger.warning("reconcile (try %d): %s", failure.tries, err)
    try:
        written = ctx.actuator.report(job)
    except KubeError as report_err:
        logger.warning("reporting the failure: %s", report_err)
    else:
        if written is not None:
            meta = job["metadata"]
            ctx.backing_off[(meta.get("namespace") or "", meta["name"])] = written["metadata"]["resourceVersion"]
    return max(0.05, (failure.not_before - now).total_seconds())


def _count(ctx: Context, namespace: str, name: str, before: api.RLJobStatus, plan: Plan) -> None:
    """Metrics of what this pass saw and did."""
    m = ctx.metrics
    for action in plan.actions:
        if isinstance(action, RequestBarrier):
            b = action.barrier
            m.barrier_requested((namespace, name), b.request_id, b.node, b.reason, action.provider)
    after = plan.status or before
    for st in (before, after):
        if st.barrier is not None and st.barrier.state != "Requested":
            m.barrier_answered((namespace, name), st.barrier.request_id, st.barrier.state)
    m.job_phase(namespace, name, after.phase or "Pending")
    if after.last_recovery is not None and after.last_recovery != before.last_recovery:
        m.recovered(namespace, name, after.last_recovery)


# ----------------------------------------------------------------------------- deletion


FINALIZER_BOUND_SECONDS = 3600.0
"""Kopf's own bound on the finalizer (``on.delete``'s timeout, from its first try): a backstop
behind ``--finalizer-seconds``, which the settings keep below it, for a finalizer that fails
in a way its own deadline does not see."""


@kopf.on.delete(*RLJOBS, timeout=FINALIZER_BOUND_SECONDS)
def finalize(
    body: kopf.Body,
    namespace: str | None,
    name: str,
    memo: Any,
    retry: int,
    logger: kopf.Logger,
    **kwargs: Any,
) -> None:
    """Stops the job's pods, waits until they are gone (a controller's SIGTERM cut lands
    first), lets its Kueue Workloads go (with ``--kueue``), then applies the retention policy
    to its cuts and reports it as an Event. Ends within ``--finalizer-seconds`` of the
    deletion, whatever it waits for: past that, the cuts stay (a ``CutsNotDeleted`` Event
    says where) and the RLJob goes, so that a namespace being deleted never hangs on it."""
    ctx = ctx_of(memo)
    job = copy.deepcopy(dict(body))
    late = retention.past_deadline(job, ctx.settings.finalizer_seconds, datetime.now(UTC))
    try:
        outcome = _finalize_step(ctx, job, late)
    except Exception as err:  # the API server, a spec this version cannot read, a bug: never a stuck namespace
        what = (
            f"HTTP {err.status} {err.reason}: {err.message}"
            if isinstance(err, KubeError)
            else f"{type(err).__name__}: {err}"
        )
        if not late:
            raise kopf.TemporaryError(f"finalizing: {what}", delay=2) from err
        outcome = retention.gave_up(job, ctx.settings, f"finalizing failed: {what}")
    if isinstance(outcome, str):
        raise kopf.TemporaryError(f"finalizing: {outcome}", delay=2)
    log.info("%s/%s deleted: %s: %s", namespace or "", name, outcome.reason, outcome.message)
    try:
        ctx.actuator.finished(job, outcome)
    except Exception as err:  # its Event and condition are best effort: the RLJob goes next
        log.warning("%s/%s: the finalizer's outcome not reported: %s", namespace or "", name, err)


def _finalize_step(ctx: Context, job: Obj, late: bool) -> retention.Outcome | str:
    """The finalizer's next step: its outcome once it is done, what it waits for meanwhile."""
    left = ctx.actuator.stop_pods(job, ctx.fleet.view())
    if left:
        if late:
            return retention.gave_up(job, ctx.settings, f"{left} pod(s) of the job had not exited")
        return f"waiting for {left} pod(s) of the job to exit (a controller's SIGTERM cut lands first)"
    if ctx.settings.kueue:
        ctx.actuator.let_go_workloads(job)
    decision = retention.decide(job, ctx.settings)
    if not isinstance(decision, retention.DeleteCuts):
        return decision
    outcome = ctx.actuator.delete_cuts(job, decision.uri, late)
    if outcome is None:
        if late:
            return retention.gave_up(job, ctx.settings, "the deletion pod had not finished")
        return f"waiting for the pod that deletes the cuts at {decision.uri}"
    return outcome
