"""What the operator sees of one job: a :class:`Snapshot` of API objects, then a :class:`World`.

Two ways to fill a snapshot: from the operator's watch caches (Kopf indexes, no requests:
the normal path, cheap for many jobs) and from the API server (:func:`fetch`: after a write
conflict proved the cache stale). :func:`world_of` turns either into the
:class:`~spotrl_operator.world.World` that :func:`~spotrl_operator.reconcile.reconcile`
decides on. Only this module knows the shape of Pods, Nodes and PDBs.

Which nodes are which:

- *unusable*: cordoned, with a notice taint, NotReady, being deleted, or gone. A fresh
  controller avoids them: those of them the scheduler could still choose for the job's
  pods are named in each new pod (:func:`~spotrl_operator.placement.avoid_list`).
- *lost*: out of service, Ready Unknown (or tainted unreachable) for a grace period, or the
  Node object confirmed gone; never while so many nodes are unhealthy that the control plane
  is the likelier culprit (:mod:`~spotrl_operator.fleet`). A pod there is never confirmed
  terminated, so the operator may force-delete it. Ready False is *not* lost: a node in a
  graceful shutdown says False while its kubelet still runs the pods' SIGTERM handlers (and
  their last cut); forcing them then would cost that cut.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from spotrl_operator import placement, queueing, storage_overlap
from spotrl_operator.fleet import FleetView, all_down, view_of
from spotrl_operator.resources import (
    ATTEMPT_LABEL,
    DEFAULT_SECRET_ANNOTATION,
    INDEX_LABELS,
    JOB_LABEL,
    ROLE_LABEL,
    STANDBY_LABEL,
    JobRef,
    budget_trainers,
    check_job,
    child_kinds,
    disruption_budget,
    names,
    storage_uri,
)
from spotrl_operator.settings import Settings
from spotrl_operator.signals import Signal, node_signals, pod_signals
from spotrl_operator.storage_overlap import JobStorage
from spotrl_operator.world import PodView, World
from spotrl_runtime.api import rljob as api
from spotrl_runtime.api import times
from spotrl_runtime.api.lenient import read_leniently
from spotrl_runtime.kube import Kube, KubeError, path

log = logging.getLogger("spotrl.operator")

Obj = dict[str, Any]


@dataclass(frozen=True)
class Snapshot:
    """The API objects one reconcile of one job looks at."""

    job: Obj
    """The RLJob (its metadata.resourceVersion guards the status write)."""
    pods: tuple[Obj, ...] = ()
    """The job's pods: controllers, generation workers and trainers (told apart by their role label)."""
    nodes: Mapping[str, Obj] = field(default_factory=dict)
    """Every Node the operator knows, by name (trimmed by :func:`trim_node`)."""
    pdb: Obj | None = None
    """The job's PodDisruptionBudget: its ``spec`` as :func:`trim_pdb` keeps it."""
    peers: tuple[JobStorage, ...] = ()
    """Every RLJob's effective storage (:func:`job_storage`), this one's included."""
    workload: Obj | None = None
    """The job's Kueue Workload (operator setting ``kueue``), as :func:`trim_workload` keeps it."""
    flavors: Mapping[str, Obj] = field(default_factory=dict)
    """Kueue's ResourceFlavors by name: their ``spec`` (node labels, tolerations)."""
    fleet: FleetView | None = None
    """The nodes as the operator's :class:`~spotrl_operator.fleet.Fleet` keeps them (None: made
    from :attr:`nodes`, which is then the whole list)."""
    children: frozenset[tuple[str, str]] | None = None
    """The job's objects besides its pods, as (kind, owner uid) (None: not watched, not checked)."""
    gone: frozenset[str] | None = None
    """Of the nodes the job's pods name and :attr:`nodes` lacks, those a live GET found gone
    (:func:`confirm_missing`); None: :attr:`nodes` is a fresh LIST, what it lacks is gone."""
    server_offset: timedelta = timedelta(0)
    """The API server's clock minus the operator's (:class:`~spotrl_runtime.kube.ServerClock`):
    a node's grace period is measured on the API server's clock, as its times are."""


def job_ref(job: Obj) -> JobRef:
    meta = job["metadata"]
    recorded = (meta.get("annotations") or {}).get(DEFAULT_SECRET_ANNOTATION)
    return JobRef(name=meta["name"], namespace=meta["namespace"], uid=meta.get("uid", ""), default_secret=recorded)


def job_spec(job: Obj) -> api.RLJobSpec:
    """The job's spec as the API server stores it; fields this version does not know are skipped
    (:func:`~spotrl_runtime.api.rljob.read_stored_spec`; :func:`world_of` reports them). Raises
    :class:`~spotrl_runtime.api.rljob.SpecError` for a value it cannot read."""
    return api.read_stored_spec(job.get("spec") or {})[0]


def job_storage(job: Obj, settings: Settings) -> JobStorage | None:
    """An RLJob's effective storage (None: its spec does not parse, or it has none: both are
    said on the job itself)."""
    try:
        spec = job_spec(job)
        uri = storage_uri(job_ref(job), spec, settings)
    except (ValueError, KeyError):
        return None
    meta = job["metadata"]
    endpoint = spec.checkpoint.s3_endpoint or settings.default_s3_endpoint or ""
    finished = (job.get("status") or {}).get("phase") in ("Succeeded", "Failed")  # writes no more
    created = str(meta.get("creationTimestamp") or "")
    uid = str(meta.get("uid") or "")
    return JobStorage(meta["namespace"], meta["name"], created, uri, endpoint, finished=finished, uid=uid)


# --------------------------------------------------------------------- trimming (for caches)


def trim_node(node: Obj) -> Obj:
    """The parts of a Node the signals and the placement read; what the node cache keeps."""
    meta, spec = node.get("metadata") or {}, node.get("spec") or {}
    ready = [c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"]
    return {
        "metadata": {
            "name": meta.get("name"),
            "uid": meta.get("uid"),
            "labels": dict(meta.get("labels") or {}),
            "deletionTimestamp": meta.get("deletionTimestamp"),
        },
        "spec": {
            "unschedulable": bool(spec.get("unschedulable")),
            "taints": list(spec.get("taints") or []),
            "providerID": spec.get("providerID"),
        },
        "status": {
            "conditions": [
                {
                    "type": "Ready",
                    "status": c.get("status"),
                    "reason": c.get("reason"),
                    "lastTransitionTime": c.get("lastTransitionTime"),
                }
                for c in ready
            ]
        },
    }


def trim_workload(wl: Obj) -> Obj:
    """The parts of a Kueue Workload :func:`~spotrl_operator.queueing.workload_view` reads."""
    meta, st = wl.get("metadata") or {}, wl.get("status") or {}
    return {
        "metadata": {
            k: meta.get(k)
            for k in (
                "name",
                "namespace",
                "uid",
                "annotations",
                "ownerReferences",
                "finalizers",
                "deletionTimestamp",
                "resourceVersion",
            )
        },
        "status": {"conditions": list(st.get("conditions") or []), "admission": st.get("admission")},
    }


def workload_owner(wl: Obj) -> str | None:
    """The RLJob that owns a Workload (None: not one of ours)."""
    for ref in (wl.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == api.KIND and str(ref.get("apiVersion", "")).startswith(api.GROUP + "/"):
            return str(ref.get("name"))
    return None


def queue_view(snap: Snapshot, spec: api.RLJobSpec, settings: Settings) -> queueing.QueueView | None:
    """The job's place in Kueue, when the operator queues through Kueue and the job has the label."""
    queue = ((snap.job.get("metadata") or {}).get("labels") or {}).get(queueing.QUEUE_LABEL)
    if not settings.kueue or not queue:
        return None
    want = queueing.pod_sets_digest(queueing.pod_sets(job_ref(snap.job), spec, settings))
    view = queueing.workload_view(snap.workload) if snap.workload is not None else None
    where = queueing.placement(view, snap.flavors) if view is not None and view.admitted else {}
    return queueing.QueueView(name=str(queue), want_pod_sets=want, workload=view, placement=where)


def trim_pod(pod: Obj) -> Obj:
    """The parts of a job's Pod the lifecycle reads; what the pod cache keeps."""
    meta, spec, st = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    return {
        "metadata": {
            k: meta.get(k)
            for k in (
                "name",
                "namespace",
                "uid",
                "labels",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
                "ownerReferences",
            )
        },
        "spec": {"nodeName": spec.get("nodeName")},
        "status": {
            "phase": st.get("phase"),
            "reason": st.get("reason"),
            "message": st.get("message"),
            "conditions": [
                c for c in st.get("conditions") or [] if c.get("type") in ("DisruptionTarget", "PodScheduled")
            ],
            "containerStatuses": st.get("containerStatuses") or [],
        },
    }


def trim_pdb(pdb: Obj) -> Obj:
    """The parts of the job's PodDisruptionBudget the lifecycle reads; what the PDB cache keeps."""
    spec = pdb.get("spec") or {}
    return {
        "metadata": {"uid": (pdb.get("metadata") or {}).get("uid"), "owner": owner_uid(pdb)},
        "spec": {"minAvailable": spec.get("minAvailable", 1), "selector": spec.get("selector")},
    }


def trim_child(kind: str, obj: Obj) -> Obj:
    """What the cache keeps of one of the job's other objects (a ServiceAccount, a Service ...)."""
    return {"kind": kind, "metadata": {"uid": (obj.get("metadata") or {}).get("uid"), "owner": owner_uid(obj)}}


def owner_uid(obj: Obj) -> str | None:
    """The uid of the RLJob that controls an object (None: no RLJob does)."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == api.KIND and ref.get("controller"):
            return str(ref.get("uid"))
    return None


def _owned(obj: Obj, uid: str) -> bool:
    """Whether an object is the job's: no RLJob owns it (a test's), or this uid does. A
    previous job of the same name owns what the garbage collector is about to delete."""
    owner = owner_uid(obj)
    return owner is None or owner == uid


def role_of(pod: Obj) -> str | None:
    """controller, worker or trainer: a pod of the job (None: not one of the job's runtime pods)."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(ROLE_LABEL) if JOB_LABEL in labels else None


def is_controller_pod(pod: Obj) -> bool:
    return role_of(pod) == "controller"


def is_standby(pod: Obj, status_attempt: int) -> bool:
    """A controller pod made ahead of its attempt (``spec.standby``) that is not the
    controller yet: its attempt is above the status's. Once the status reaches it, it is."""
    labels = (pod.get("metadata") or {}).get("labels") or {}
    return labels.get(STANDBY_LABEL) == "true" and (_int_label(labels, ATTEMPT_LABEL) or 0) > status_attempt


def is_worker_pod(pod: Obj) -> bool:
    return role_of(pod) == "worker"


def is_trainer_pod(pod: Obj) -> bool:
    return role_of(pod) == "trainer"


# --------------------------------------------------------------------- pods


def _terminated(pod: Obj) -> Obj | None:
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        terminated = (cs.get("state") or {}).get("terminated")
        if terminated is not None:
            return dict(terminated)
    return None


def _exit_code(pod: Obj) -> int | None:
    terminated = _terminated(pod)
    return None if terminated is None else int(terminated.get("exitCode", 0))


def _exit_message(pod: Obj) -> str | None:
    """The last non-empty line of the termination message (a runtime error is one line; with
    FallbackToLogsOnError the kubelet puts the log's tail there), at most 300 characters."""
    message = ((_terminated(pod) or {}).get("message") or "").strip()
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return lines[-1][:300] if lines else None


def deleting_since(pod: Obj) -> datetime | None:
    """When the pod's deletion began: deletionTimestamp is that moment plus the grace period."""
    meta = pod.get("metadata") or {}
    deadline = times.parse(meta.get("deletionTimestamp"))
    if deadline is None:
        return None
    return deadline - timedelta(seconds=int(meta.get("deletionGracePeriodSeconds") or 0))


def _int_label(labels: Mapping[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


def pod_view(pod: Obj) -> PodView:
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    attempt = _int_label(labels, ATTEMPT_LABEL) or 0
    disruption = next((s.detail or "DisruptionTarget" for s in pod_signals(pod)), None)
    return PodView(
        name=str(meta.get("name")),
        attempt=attempt,
        phase=str((pod.get("status") or {}).get("phase") or "Pending"),
        node=(pod.get("spec") or {}).get("nodeName") or None,
        deleting_since=deleting_since(pod),
        exit_code=_exit_code(pod),
        exit_message=_exit_message(pod),
        disruption=disruption,
        index=_int_label(labels, INDEX_LABELS.get(labels.get(ROLE_LABEL, ""), "")),
        scheduled_at=_scheduled_at(pod),
        standby=labels.get(STANDBY_LABEL) == "true",
        rejected=_rejected(pod),
    )


def _rejected(pod: Obj) -> str | None:
    """Why the kubelet failed the pod before any container of it ran (None: it did not). A
    kubelet that has just come back (a node given back) rejects pods at admission
    (UnexpectedAdmissionError, NodeAffinity, OutOfcpu ...): the node's doing, not the program's."""
    st = pod.get("status") or {}
    if st.get("phase") != "Failed" or _terminated(pod) is not None or not st.get("reason"):
        return None
    return f"{st['reason']}: {st.get('message') or ''}".strip().rstrip(":")[:300]


def _scheduled_at(pod: Obj) -> datetime | None:
    """When the PodScheduled condition turned True (None: not scheduled, or no time)."""
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "True":
            try:
                return times.parse(cond.get("lastTransitionTime"))
            except ValueError:
                return None
    return None


# --------------------------------------------------------------------- the world


def _pod_nodes(snap: Snapshot) -> set[str]:
    """The nodes the job's pods are on."""
    return {str(n) for p in snap.pods if (n := (p.get("spec") or {}).get("nodeName"))}


def missing_nodes(snap: Snapshot) -> set[str]:
    """The nodes the job's pods name that the snapshot's nodes lack."""
    return {n for n in _pod_nodes(snap) if n not in snap.nodes}


def _is_gone(snap: Snapshot, name: str) -> bool:
    return name not in snap.nodes and (snap.gone is None or name in snap.gone)


def _fleet(snap: Snapshot, settings: Settings, now: datetime) -> FleetView:
    if snap.fleet is not None:
        return snap.fleet
    return view_of(snap.nodes, now + snap.server_offset, settings.extra_taint_keys)  # the API server's time


def _node_sets(
    snap: Snapshot, fleet: FleetView, spec: api.RLJobSpec, settings: Settings, now: datetime
) -> tuple[set[str], set[str], str | None]:
    """(the unusable nodes, the lost ones, why force deletes are paused for this job)."""
    unusable = set(fleet.unusable_with(spec.preemption.extra_taint_keys))
    lost = set(fleet.lost(now + snap.server_offset, settings.node_lost_seconds, settings.unhealthy_node_share))
    held = fleet.held(settings.unhealthy_node_share)
    waiting = sorted(n for n in _pod_nodes(snap) if n in fleet.unhealthy_since and fleet.zone_of.get(n, "") in held)
    paused = _paused_why(fleet, held, waiting, settings.unhealthy_node_share) if waiting else None
    return unusable, lost, paused


def _paused_why(fleet: FleetView, held: frozenset[str], waiting: list[str], share: float) -> str:
    """Why the job's pods on ``waiting`` (unhealthy nodes in ``held`` zones) are not force-deleted."""
    if all_down(fleet.zones):
        total = sum(z.nodes for z in fleet.zones.values())
        what = f"no node of the {total} in any zone is Ready"
    else:
        zones = sorted({fleet.zone_of.get(n, "") for n in waiting})
        what = "; ".join(
            f"{fleet.zones[z].not_ready} of the {fleet.zones[z].nodes} nodes of zone {z or '(unlabelled)'} are not "
            f"Ready (at least {share:.0%})"
            for z in zones
        )
    return (
        f"{what}: likelier the control plane or the network than the nodes, so the job's pods on "
        f"{', '.join(waiting[:5])} are not force-deleted; waiting for the nodes to answer"
    )


def missing_children(snap: Snapshot, pdb: Obj | None, uid: str, settings: Settings) -> tuple[str, ...]:
    """The kinds of the job's objects that are missing, or another uid's (see :func:`_owned`)."""
    if snap.children is None:
        return ()
    have = {kind for kind, owner in snap.children if owner in ("", uid)}
    if pdb is not None:
        have.add("PodDisruptionBudget")
    return tuple(k for k in child_kinds(settings) if k not in have)


def seconds_until_lost(snap: Snapshot, settings: Settings, now: datetime) -> float | None:
    """Seconds until the first of the job's unhealthy nodes becomes lost (None: none will by the
    clock alone), so that the pass after the grace period comes on time."""
    fleet = snap.fleet
    if fleet is None:
        return None
    now = now + snap.server_offset  # the API server's clock, as the nodes' times are
    held = fleet.held(settings.unhealthy_node_share)
    lost = fleet.lost(now, settings.node_lost_seconds, settings.unhealthy_node_share)
    ends = [
        (fleet.since(fleet.unhealthy_since[node]) - now).total_seconds() + settings.node_lost_seconds
        for node in _pod_nodes(snap)
        if node in fleet.unhealthy_since and node not in lost and fleet.zone_of.get(node, "") not in held
    ]
    return max(0.0, min(ends)) if ends else None


def world_of(snap: Snapshot, settings: Settings, now: datetime | None = None) -> World:
    """The world :func:`reconcile` decides on. Raises :class:`~spotrl_runtime.api.rljob.SpecError`
    for a spec the model rejects (the CRD should have already)."""
    now = now or datetime.now(UTC)
    job = snap.job
    meta = job.get("metadata") or {}
    spec, skipped = api.read_stored_spec(job.get("spec") or {})
    status, dropped = status_and_skipped(job)
    extra = (*settings.extra_taint_keys, *spec.preemption.extra_taint_keys)
    uid = str(meta.get("uid") or "")
    snap = replace(snap, pods=tuple(p for p in snap.pods if _owned(p, uid)))
    pdb = snap.pdb if snap.pdb is not None and (snap.pdb.get("metadata") or {}).get("owner") in (None, uid) else None

    controllers = [p for p in snap.pods if is_controller_pod(p)]
    pods = [p for p in controllers if not is_standby(p, status.attempt)]
    standbys = [p for p in controllers if is_standby(p, status.attempt)]
    workers = [p for p in snap.pods if is_worker_pod(p)]
    trainers = [p for p in snap.pods if is_trainer_pod(p)]
    signals: list[Signal] = []
    fleet = _fleet(snap, settings, now)
    unusable, lost, paused = _node_sets(snap, fleet, spec, settings, now)
    for pod in (*workers, *standbys):  # a node gone under them is lost; it raises no signal for the job
        node_name = (pod.get("spec") or {}).get("nodeName")
        if node_name and _is_gone(snap, node_name):
            lost.add(node_name)
            unusable.add(node_name)
    # The nodes whose going is a notice for the job: the controllers', and the trainer pods'
    # (a trainer rank lost is a preemption). A trainer pod's DisruptionTarget is on its view.
    for pod in (*pods, *trainers):
        node_name = (pod.get("spec") or {}).get("nodeName")
        if node_name:
            host = snap.nodes.get(node_name)
            if host is not None:
                signals.extend(node_signals(host, extra))
            elif _is_gone(snap, node_name):
                signals.append(Signal("node-deleted", node_name, "the Node object is gone"))
                lost.add(node_name)
                unusable.add(node_name)
        if is_controller_pod(pod):
            signals.extend(pod_signals(pod))
    signals = list(dict.fromkeys(signals))  # two pods on one node: its signals once

    config_error = None
    try:
        check_job(job_ref(job), spec, settings)
    except ValueError as err:
        config_error = str(err)
    mine = job_storage(job, settings)
    shared = storage_overlap.conflict(mine, snap.peers) if mine is not None else None
    pdb_spec = (pdb or {}).get("spec") or {}
    min_available = pdb_spec.get("minAvailable", 1)
    closed = disruption_budget(job_ref(job), open_=False, trainers=budget_trainers(spec))["spec"]
    stale = (
        pdb is not None
        and min_available != 0
        and (min_available != closed["minAvailable"] or pdb_spec.get("selector") != closed["selector"])
    )
    return World(
        now=now,
        generation=int(meta.get("generation") or 0),
        job=str(meta.get("name") or ""),
        spec=spec,
        status=status,
        pods=tuple(pod_view(p) for p in pods),
        standbys=tuple(pod_view(p) for p in standbys),
        workers=tuple(pod_view(p) for p in workers),
        trainers=tuple(pod_view(p) for p in trainers),
        signals=tuple(signals),
        unusable_nodes=frozenset(unusable),
        avoid_nodes=frozenset(placement.avoid_list(spec.scheduling, snap.nodes, unusable)),
        lost_nodes=frozenset(lost),
        force_deletes_paused=paused,
        missing_children=missing_children(snap, pdb, uid, settings),
        pdb_open=pdb is not None and min_available == 0,
        pdb_stale=stale,
        deadline_caps=dict(settings.deadline_caps),
        clouds=fleet.clouds,
        skipped_fields=(*skipped, *(f"status.{p}" for p in dropped)),
        config_error=config_error,
        storage_conflict=shared,
        queue=queue_view(snap, spec, settings),
    )


STATUS_FIELDS = frozenset(f.alias or n for n, f in api.RLJobStatus.model_fields.items())
"""The status keys the model owns (Kopf's own ``status.kopf`` and unknown keys are left alone)."""


def status_of(job: Obj) -> tuple[api.RLJobStatus, Obj]:
    """The job's status as this version reads it, and the part of the stored status that
    reading kept: what another version wrote and this one does not know is left out of both
    (:mod:`~spotrl_runtime.api.lenient`), so a diff against it never erases it."""
    status, kept, _ = read_leniently(api.RLJobStatus, job.get("status") or {})
    return status, {k: v for k, v in kept.items() if k in STATUS_FIELDS}


def status_and_skipped(job: Obj) -> tuple[api.RLJobStatus, list[str]]:
    """The job's status as :func:`status_of` reads it, and the paths it skipped (Kopf's own
    ``status.kopf`` is not ours to read, so not among them)."""
    status, _, dropped = read_leniently(api.RLJobStatus, job.get("status") or {})
    return status, [p for p in dropped if p.split(".", 1)[0] != "kopf"]


# --------------------------------------------------------------------- from the API server


def rljob_path(namespace: str, name: str | None = None) -> str:
    return path(api.API_VERSION, api.PLURAL, namespace, name)


def fetch(
    kube: Kube,
    namespace: str,
    name: str,
    nodes: Mapping[str, Obj] | None = None,
    peers: tuple[JobStorage, ...] = (),
    kueue: bool = False,
) -> Snapshot | None:
    """A fresh snapshot from the API server (None once the RLJob is gone). ``nodes``: the
    node cache, if there is one (nodes change rarely and are not guarded by the job's
    resourceVersion); without it the nodes are listed too. ``peers``: the other jobs'
    storages, as the cache has them."""
    job = kube.get_or_none(rljob_path(namespace, name))
    if job is None:
        return None
    pods = list_pods(kube, namespace, name)
    pdb = kube.get_or_none(path("policy/v1", "poddisruptionbudgets", namespace, names(name)["pdb"]))
    pdb = trim_pdb(pdb) if pdb is not None else None
    if nodes is None:
        nodes = nodes_of(kube.list_all(path("v1", "nodes")))  # in chunks: 2,000 Nodes at once are large
    workload, flavors = None, {}
    if kueue:
        wl = kube.get_or_none(workload_path(namespace, queueing.workload_name(name, job["metadata"].get("uid", ""))))
        workload = trim_workload(wl) if wl is not None else None
        if workload is not None and (workload["status"].get("admission") or None):
            items = kube.get(path(queueing.API_VERSION, "resourceflavors")).get("items") or []
            flavors = {f["metadata"]["name"]: f.get("spec") or {} for f in items}
    return Snapshot(job=job, pods=tuple(pods), nodes=nodes, pdb=pdb, peers=peers, workload=workload, flavors=flavors)


def list_pods(kube: Kube, namespace: str, name: str) -> list[Obj]:
    """The job's pods (controllers, workers, trainers) as the API server has them now."""
    selector = f"{JOB_LABEL}={name},{ROLE_LABEL} in (controller,worker,trainer)"
    return list(kube.get(path("v1", "pods", namespace), labelSelector=selector).get("items") or [])


def confirm_missing(kube: Kube, snap: Snapshot) -> Snapshot:
    """The snapshot with the nodes its pods name but the cache lacks looked up live: those
    found join its nodes (a node newer than the cache), the others are :attr:`Snapshot.gone`."""
    missing = missing_nodes(snap)
    if not missing:
        return replace(snap, gone=frozenset())
    found: dict[str, Obj] = {}
    gone: set[str] = set()
    for name in sorted(missing):
        try:
            node = kube.get_or_none(path("v1", "nodes", None, name))
        except KubeError:
            continue  # not confirmed either way: neither gone nor usable this pass
        if node is None:
            gone.add(name)
        else:
            found[name] = trim_node(node)
    if not found:
        return replace(snap, gone=frozenset(gone))
    # A node the fleet lacks: this pass reads the nodes (the cache's, plus those found) instead.
    return replace(snap, nodes={**snap.nodes, **found}, fleet=None, gone=frozenset(gone))


def workload_path(namespace: str, name: str | None = None) -> str:
    return path(queueing.API_VERSION, "workloads", namespace, name)


def nodes_of(items: Iterable[Obj]) -> dict[str, Obj]:
    return {n["metadata"]["name"]: trim_node(n) for n in items}
