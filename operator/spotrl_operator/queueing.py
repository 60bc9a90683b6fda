"""Kueue: the operator as the external controller of RLJobs (``integrations.externalFrameworks:
[RLJob.v1alpha1.spotrl.dev]``). Pure: what the Workload is, what Kueue's answer means for the
lifecycle, and the status patches that answer Kueue. Reading and writing the objects is
:mod:`~spotrl_operator.observe` and :mod:`~spotrl_operator.actuate`.

An RLJob that carries the label ``kueue.x-k8s.io/queue-name`` is held, as if suspended, until
Kueue admits its Workload. No pod exists before that. The operator makes one Workload per job.
It is owned by the RLJob and has one pod set per role (``controller``, ``standby``,
``workers``, ``trainers``), each with the pods' own templates and count. When the Workload is
admitted, the admission's ResourceFlavors give every pod of a pod set their node labels (as a
nodeSelector) and tolerations, and the job starts.

When Kueue evicts the Workload (a higher priority's preemption, a cohort reclaiming its quota,
a deactivated Workload), the job is held again. The operator asks the controller for a barrier
cut, exactly as for a suspend, stops the pods, and only then gives the quota back: the
Workload's admission is cleared, ``QuotaReserved`` goes False (``Pending``) and ``Requeued``
says whether Kueue may admit it again at once. Kueue never clears an evicted Workload's
admission itself; the job's controller does, once the job is no longer active. So the
preemptor waits for the cut, and the quota is never used twice. A barrier that fails or misses
its deadline gives the quota back too, after the pods are gone, falling back to the newest
committed cut as a suspend does.

A changed spec whose pod sets differ gets a new Workload once the pods are gone. When the job
ends, its Workload is marked ``Finished``, which gives the quota back.

Each Workload carries Kueue's ``kueue.x-k8s.io/resource-in-use`` finalizer, as Kueue's own job
controllers make theirs: a Workload deleted (by hand, by the garbage collector, or because its
pod sets changed) keeps its quota in Kueue's books until the job's pods are gone, and only then
does the operator take the finalizer off. So a deletion is one more way to be held: a barrier
cut, the pods stopped, then the Workload let go and made again. A Finished Workload is let go
at once; a deleted RLJob's Workloads once its pods are gone (:func:`let_go_patch`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from spotrl_operator import resources
from spotrl_runtime.api import rljob as api
from spotrl_runtime.api import times

if TYPE_CHECKING:
    from spotrl_operator.settings import Settings
    from spotrl_operator.world import Builder

Obj = dict[str, Any]

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
QUEUE_LABEL = f"{GROUP}/queue-name"
PRIORITY_LABEL = f"{GROUP}/priority-class"
"""A WorkloadPriorityClass for the job's Workload (else ``scheduling.priorityClassName``'s PriorityClass)."""
JOB_UID_LABEL = f"{GROUP}/job-uid"
POD_SETS_ANNOTATION = "spotrl.dev/pod-sets"
IN_USE_FINALIZER = f"{GROUP}/resource-in-use"
"""Kueue's: a Workload's quota stays in use until its job controller takes this off."""
"""On the Workload: a digest of the pod sets it was made from (a spec that changes them gets a new one)."""
BARRIER_REASON = "kueue-eviction"
"""The reason of a barrier asked for because Kueue evicted the job's Workload."""
REQUEUED_AT_ONCE = frozenset({"Preempted", "NodeFailures"})
"""Eviction reasons after which Kueue may admit the Workload again at once (``Requeued`` True);
after the others its own backoff or a reactivation decides, as Kueue's job controllers do."""
POD_SETS = ("controller", "standby", "workers", "trainers")


# ----------------------------------------------------------------------------- the Workload


def workload_name(job: str, uid: str) -> str:
    """Deterministic per RLJob (name and uid): a restarted operator finds the one it made."""
    digest = hashlib.sha1(f"RLJob\n{api.GROUP}\n{job}\n{uid}".encode()).hexdigest()[:5]
    return f"rljob-{job[: 253 - 6 - 6]}-{digest}"


def role_of_pod_set(name: str) -> str:
    """The pod role whose pods a pod set holds (the standby is a controller pod)."""
    return {"controller": "controller", "standby": "controller", "workers": "worker", "trainers": "trainer"}[name]


def pod_sets(ref: resources.JobRef, spec: api.RLJobSpec, settings: Settings) -> list[Obj]:
    """One pod set per role the job runs, with the pods' templates (their requests, placement
    and priority class) and count, in :data:`POD_SETS` order."""

    def template(pod: Obj) -> Obj:
        return {"metadata": {"labels": dict(pod["metadata"]["labels"])}, "spec": pod["spec"]}

    controller = resources.controller_pod(ref, spec, settings, attempt=0)
    out = [{"name": "controller", "count": 1, "template": template(controller)}]
    if spec.standby:
        standby = resources.controller_pod(ref, spec, settings, attempt=0, standby=True)
        out.append({"name": "standby", "count": 1, "template": template(standby)})
    workers = spec.generation.workers if spec.generation.worker_pods else 0
    if workers:
        pod = resources.worker_pod(ref, spec, settings, 0, 0, "ray-head:6379")
        out.append({"name": "workers", "count": workers, "template": template(pod)})
    trainers = resources.budget_trainers(spec)
    if trainers:
        pod = resources.trainer_pod(ref, spec, settings, 0, 0, "ray-head:6379")
        out.append({"name": "trainers", "count": trainers, "template": template(pod)})
    return out


def pod_sets_digest(sets: Sequence[Obj]) -> str:
    return hashlib.sha256(json.dumps(list(sets), sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Priority:
    """The Workload's priority, resolved the way Kueue's job controllers resolve it."""

    kind: str
    """WorkloadPriorityClass or PriorityClass."""
    name: str
    value: int

    def ref(self) -> Obj:
        group = GROUP if self.kind == "WorkloadPriorityClass" else "scheduling.k8s.io"
        return {"group": group, "kind": self.kind, "name": self.name}


def workload(
    ref: resources.JobRef, spec: api.RLJobSpec, settings: Settings, queue: str, priority: Priority | None
) -> Obj:
    """The job's Workload: owned by the RLJob (controller), in its LocalQueue, with its pod
    sets and priority."""
    sets = pod_sets(ref, spec, settings)
    labels = {JOB_UID_LABEL: ref.uid} if ref.uid and len(ref.uid) <= 63 else {}
    body: Obj = {
        "apiVersion": API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": workload_name(ref.name, ref.uid),
            "namespace": ref.namespace,
            "labels": labels,
            "annotations": {POD_SETS_ANNOTATION: pod_sets_digest(sets)},
            "ownerReferences": [resources.owner_reference(ref)],
            "finalizers": [IN_USE_FINALIZER],
        },
        "spec": {"queueName": queue, "podSets": sets},
    }
    if priority is not None:
        body["spec"]["priorityClassRef"] = priority.ref()
        body["spec"]["priority"] = priority.value
    return body


# ----------------------------------------------------------------------------- what Kueue said


@dataclass(frozen=True)
class WorkloadView:
    """What the lifecycle needs to know about the job's Workload."""

    name: str
    pod_sets: str | None = None
    """The digest it was made from (:data:`POD_SETS_ANNOTATION`)."""
    reserved: bool = False
    """QuotaReserved True: it holds quota (admitted, or evicted and not yet given back)."""
    admitted: bool = False
    evicted: tuple[str, str, str] | None = None
    """(reason, message, since) of an Evicted=True condition."""
    pending: tuple[str, str] | None = None
    """(reason, message) of QuotaReserved=False: why it waits."""
    cluster_queue: str | None = None
    flavors: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """Per pod set, the ResourceFlavors its admission assigned."""
    finished: bool = False
    deleting: bool = False
    in_use: bool = False
    """It carries :data:`IN_USE_FINALIZER`."""


def _conditions(obj: Obj) -> dict[str, Obj]:
    return {c.get("type", ""): c for c in (obj.get("status") or {}).get("conditions") or []}


def _evicted(cond: Obj | None) -> tuple[str, str, str] | None:
    if cond is None or cond.get("status") != "True":
        return None
    return str(cond.get("reason") or ""), str(cond.get("message") or ""), str(cond.get("lastTransitionTime") or "")


def workload_view(obj: Obj) -> WorkloadView:
    meta, st = obj.get("metadata") or {}, obj.get("status") or {}
    conds = _conditions(obj)

    def true(ctype: str) -> bool:
        return (conds.get(ctype) or {}).get("status") == "True"

    evicted = conds.get("Evicted")
    quota = conds.get("QuotaReserved")
    admission = st.get("admission") or {}
    flavors = {
        a.get("name", ""): tuple(sorted(set((a.get("flavors") or {}).values())))
        for a in admission.get("podSetAssignments") or []
    }
    return WorkloadView(
        name=str(meta.get("name") or ""),
        pod_sets=(meta.get("annotations") or {}).get(POD_SETS_ANNOTATION),
        reserved=true("QuotaReserved"),
        admitted=true("Admitted") and bool(admission),
        evicted=_evicted(evicted),
        pending=(
            (str(quota.get("reason") or ""), str(quota.get("message") or ""))
            if quota is not None and quota.get("status") == "False"
            else None
        ),
        cluster_queue=admission.get("clusterQueue"),
        flavors=flavors,
        finished=true("Finished"),
        deleting=bool(meta.get("deletionTimestamp")),
        in_use=IN_USE_FINALIZER in (meta.get("finalizers") or []),
    )


def placement(view: WorkloadView, flavors: Mapping[str, Obj]) -> dict[str, api.PodPlacement]:
    """Per pod set, what its admission adds to its pods: the union of its flavors' nodeLabels
    and their tolerations (``flavors``: ResourceFlavors by name, their ``spec``)."""
    out: dict[str, api.PodPlacement] = {}
    for pod_set, names in view.flavors.items():
        labels: dict[str, str] = {}
        tolerations: list[api.Toleration] = []
        for name in names:
            spec = flavors.get(name) or {}
            labels.update(spec.get("nodeLabels") or {})
            for t in spec.get("tolerations") or []:
                tol = api.Toleration.model_validate(t)
                if tol not in tolerations:
                    tolerations.append(tol)
        out[pod_set] = api.PodPlacement(node_selector=labels, tolerations=tolerations)
    return out


@dataclass(frozen=True)
class QueueView:
    """The job's place in Kueue, as observed: the label, the Workload it should have, the one it has."""

    name: str
    """The LocalQueue (the ``kueue.x-k8s.io/queue-name`` label)."""
    want_pod_sets: str
    """:func:`pod_sets_digest` of the spec's pod sets."""
    workload: WorkloadView | None = None
    placement: Mapping[str, api.PodPlacement] = field(default_factory=dict)
    """The admission's, per pod set (:func:`placement`)."""


# ----------------------------------------------------------------------------- the lifecycle


@dataclass(frozen=True)
class CreateWorkload:
    queue: str


@dataclass(frozen=True)
class DeleteWorkload:
    name: str


@dataclass(frozen=True)
class ReleaseQuota:
    """Kueue's eviction is complete: the pods are gone (and the barrier answered)."""

    name: str
    reason: str
    message: str


@dataclass(frozen=True)
class FinishWorkload:
    name: str
    succeeded: bool
    message: str


@dataclass(frozen=True)
class LetGoWorkload:
    """Takes :data:`IN_USE_FINALIZER` off: the job's pods are gone (or it finished)."""

    name: str


def _active(b: Builder) -> bool:
    """Whether any pod of the job still exists (Kueue's ``IsActive``)."""
    w = b.world
    return bool(w.pods or w.standbys or w.workers or w.trainers)


def tend(b: Builder) -> str | None:
    """Kueue's part of the lifecycle, before the rest of it. Returns why the job must be held
    (stopped through a barrier cut, as a suspend is) or None when Kueue lets it run."""
    q = b.world.queue
    if q is None:
        return None
    st = b.st.queue or api.QueueStatus(name=q.name)
    st = st.model_copy(update={"name": q.name})
    wl = q.workload
    if b.st.phase in ("Succeeded", "Failed"):
        if wl is not None and not wl.finished and not wl.deleting:
            b.act(FinishWorkload(wl.name, b.st.phase == "Succeeded", b.st.message or b.st.phase))
        elif wl is not None and wl.in_use and not _active(b):
            b.act(LetGoWorkload(wl.name))
        b.update(queue=st.model_copy(update={"admitted": False, "cluster_queue": None}))
        return None
    if wl is not None and wl.deleting:
        if wl.in_use and not _active(b):
            b.act(LetGoWorkload(wl.name))
        b.update(queue=st.model_copy(update={"workload": None, "admitted": False, "cluster_queue": None}))
        return f"its Kueue Workload {wl.name} is being deleted: let go once the job's pods are gone, then made again"
    if wl is None:
        if not _active(b):
            b.act(CreateWorkload(q.name))
        b.update(queue=st.model_copy(update={"workload": None, "admitted": False, "cluster_queue": None}))
        return f"waiting for its Kueue Workload in LocalQueue {q.name}"
    st = st.model_copy(update={"workload": wl.name})
    if wl.pod_sets != q.want_pod_sets:
        if not _active(b):
            b.act(DeleteWorkload(wl.name))
            b.event("Normal", "WorkloadReplaced", f"the pod sets changed: Workload {wl.name} is made again")
        b.update(queue=st.model_copy(update={"admitted": False}))
        return f"the spec changed the job's pod sets: its Workload {wl.name} is made again once its pods are gone"
    if wl.evicted is not None and wl.reserved:
        reason, message, since = wl.evicted
        last = st.last_eviction
        if last is None or last.at != since:
            barrier = b.st.barrier
            st = st.model_copy(
                update={
                    "evictions": st.evictions + 1,
                    "last_eviction": api.QueueEviction(
                        reason=reason,
                        message=message[:2048],
                        at=since,
                        barrier=barrier.request_id if barrier is not None and _active(b) else None,
                    ),
                }
            )
            b.event("Warning", "Evicted", f"evicted by Kueue ({reason}): {message}"[:1000])
        b.condition("Admitted", False, "Evicted", f"evicted by Kueue ({reason}): {message}"[:1000])
        b.update(queue=st.model_copy(update={"admitted": False}))
        return f"evicted by Kueue ({reason}): taking a barrier cut, then giving the quota back"
    if wl.admitted:
        flavors = {k: list(v) for k, v in sorted(wl.flavors.items())}
        if not st.admitted:
            said = ", ".join(f"{ps}: {'/'.join(f) or 'no flavor'}" for ps, f in flavors.items())
            b.event("Normal", "Admitted", f"admitted by ClusterQueue {wl.cluster_queue} ({said})")
            b.condition("Admitted", True, "Admitted", f"ClusterQueue {wl.cluster_queue} ({said})")
        if b.has_condition("Queued"):
            b.condition("Queued", False, "Admitted", f"admitted by ClusterQueue {wl.cluster_queue}")
        b.update(
            queue=st.model_copy(
                update={
                    "admitted": True,
                    "cluster_queue": wl.cluster_queue,
                    "flavors": flavors,
                    "placement": dict(q.placement),
                }
            )
        )
        return None
    reason, message = wl.pending or ("Pending", "waiting for Kueue to reserve quota")
    if wl.reserved:
        reason, message = "AdmissionChecks", "quota reserved; waiting for the Workload's admission checks"
    b.condition("Queued", True, reason or "Pending", f"LocalQueue {q.name}: {message}"[:1000])
    b.update(queue=st.model_copy(update={"admitted": False, "cluster_queue": None}))
    return f"queued in LocalQueue {q.name}: {message}"[:1000]


def settle(b: Builder) -> None:
    """The job is held and none of its pods is left: complete Kueue's eviction (give the quota
    back), noting the barrier's cut on the eviction record."""
    q = b.world.queue
    wl = q.workload if q is not None else None
    if wl is None or wl.evicted is None or not wl.reserved or _active(b):
        return
    reason, message, _ = wl.evicted
    b.act(ReleaseQuota(wl.name, reason, message))
    st = b.st.queue
    if st is not None and st.last_eviction is not None and st.last_eviction.released_at is None:
        barrier = b.st.barrier
        cut = barrier.cut_id if barrier is not None and barrier.state == "Committed" else None
        eviction = st.last_eviction.model_copy(
            update={"released_at": times.rfc3339(b.world.now), "cut_id": cut or st.last_eviction.cut_id}
        )
        b.update(queue=st.model_copy(update={"last_eviction": eviction}))
        said = f"cut {cut} committed" if cut else "no barrier cut committed: the next run resumes from the newest cut"
        b.event("Normal", "QuotaReleased", f"Kueue's eviction is complete ({said}); the Workload waits to be admitted")


# ----------------------------------------------------------------------------- status patches


def _condition(ctype: str, status: bool, reason: str, message: str, now: datetime, old: Obj | None) -> Obj:
    value = "True" if status else "False"
    since = old.get("lastTransitionTime") if old is not None and old.get("status") == value else None
    return {
        "type": ctype,
        "status": value,
        "reason": reason,
        "message": message[:32768],
        "lastTransitionTime": since or times.rfc3339(now),
    }


def _with(conds: Mapping[str, Obj], *new: Obj) -> list[Obj]:
    out = dict(conds)
    for c in new:
        out[c["type"]] = c
    return list(out.values())


def release_patch(obj: Obj, reason: str, message: str, now: datetime) -> Obj:
    """The status merge patch that completes an eviction as Kueue's job controllers do: no
    admission, QuotaReserved False (Pending, the eviction's message), Admitted False, and
    Requeued True only where Kueue may admit it again at once."""
    conds = _conditions(obj)
    gen = (obj.get("metadata") or {}).get("generation")
    new = [
        _condition("QuotaReserved", False, "Pending", message, now, conds.get("QuotaReserved")),
        _condition("Admitted", False, "NoReservation", "The workload has no reservation", now, conds.get("Admitted")),
        _condition("Requeued", reason in REQUEUED_AT_ONCE, reason, message, now, conds.get("Requeued")),
    ]
    for c in new:
        if gen is not None:
            c["observedGeneration"] = gen
    return {"admission": None, "conditions": _with(conds, *new)}


def let_go_patch(obj: Obj) -> Obj | None:
    """The merge patch that takes :data:`IN_USE_FINALIZER` off the Workload, guarded by its
    resourceVersion (None: it is not there)."""
    meta = obj.get("metadata") or {}
    finalizers = list(meta.get("finalizers") or [])
    if IN_USE_FINALIZER not in finalizers:
        return None
    rest = [f for f in finalizers if f != IN_USE_FINALIZER]
    return {"metadata": {"resourceVersion": meta.get("resourceVersion"), "finalizers": rest or None}}


def finish_patch(obj: Obj, succeeded: bool, message: str, now: datetime) -> Obj:
    conds = _conditions(obj)
    done = _condition("Finished", True, "Succeeded" if succeeded else "Failed", message, now, conds.get("Finished"))
    return {"conditions": _with(conds, done)}
