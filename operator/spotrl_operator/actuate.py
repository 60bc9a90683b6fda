"""Carry out a :class:`~spotrl_operator.world.Plan` against the API server, idempotently.

Order matters, so that an operator that dies at any point leaves a state the next
reconcile (this replica's or another's) completes without losing or repeating anything:

1. the **status** first, as a merge patch of only the fields that differ from what was
   observed, guarded by the observed ``resourceVersion``. The job's controller patches
   status too (step, stepAttempt, lastCut, the barrier's answer); a guard that fails (409)
   means someone wrote in between: nothing else of this plan is done, the caller observes
   again and reconciles anew (:class:`ConflictError`). So the operator never overwrites a field
   it did not see.
2. **Events**, only with a status change: a transition a user should see always changes
   the status, and a plan reached again from a stale cache must not repeat them.
3. then the **actions**: every one is idempotent (create: 409 means done; delete: 404
   means done), because a plan may be applied twice from a stale cache. Each stands alone:
   one that fails does not stop the others, and is not sent again before its backoff ends
   (:class:`Backoffs`: ``failureBudget``'s doubling wait, capped; in memory, like a work
   queue's rate limiter, so a restarted operator tries at once).
4. last, what failed is **reported** on the job (:meth:`Actuator.report`): the condition
   ``ReconcileError`` (the API's answer, the tries, the next try) and a ``ReconcileFailed``
   Event per failed try; both go once the action succeeds (a ``Reconciled`` Event).
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from spotrl_operator import queueing, resources, retention
from spotrl_operator.fleet import FleetView
from spotrl_operator.observe import (
    STATUS_FIELDS,
    Snapshot,
    job_ref,
    job_spec,
    owner_uid,
    rljob_path,
    status_of,
    workload_path,
)
from spotrl_operator.reconcile import crash_backoff
from spotrl_operator.resources import STANDBY_LABEL, JobRef
from spotrl_operator.settings import Settings
from spotrl_operator.world import (
    CloseDisruptionBudget,
    CreateControllerPod,
    CreateNodePod,
    DeletePod,
    EnsureChildren,
    Event,
    OpenDisruptionBudget,
    Plan,
    PromoteStandby,
    RequestBarrier,
    set_condition,
)
from spotrl_runtime.api import rljob as api
from spotrl_runtime.api import times
from spotrl_runtime.kube import JSON_PATCH, Kube, KubeError, path

Obj = dict[str, Any]
log = logging.getLogger("spotrl.operator")


class ConflictError(Exception):
    """The status changed since it was observed: observe again, reconcile again."""


STUCK = "ReconcileError"
"""The condition of a job whose objects the operator cannot write (True while it cannot)."""


@dataclass(frozen=True)
class Failure:
    """An action the API server refused (or did not answer), and when to try it again."""

    what: str
    """What was tried, for people: "creating pod tiny-controller-3"."""
    error: KubeError
    tries: int
    """Failed tries in a row."""
    not_before: datetime

    @property
    def permanent(self) -> bool:
        """A 4xx that the same request will meet again (a retry needs something else to change)."""
        return 400 <= self.error.status < 500 and self.error.status not in (408, 409, 429)


def retry_delay(budget: api.FailureBudget, tries: int) -> float:
    """``failureBudget``'s doubling wait before try ``tries + 1``, capped; at least a second."""
    return max(1.0, crash_backoff(budget, tries))


def failure_budget(job: Obj) -> api.FailureBudget:
    """The job's failure budget (the default one if its spec does not parse)."""
    try:
        return job_spec(job).failure_budget
    except api.SpecError:
        return api.FailureBudget()


class Backoffs:
    """Failed actions by job (uid) and action, in memory. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: dict[tuple[str, str], Failure] = {}

    def held(self, uid: str, key: str, now: datetime) -> Failure | None:
        """The failure that still holds this action back, if any."""
        with self._lock:
            f = self._failures.get((uid, key))
        return f if f is not None and now < f.not_before else None

    def failed(
        self, uid: str, key: str, what: str, error: KubeError, budget: api.FailureBudget, now: datetime
    ) -> Failure:
        with self._lock:
            before = self._failures.get((uid, key))
            tries = before.tries + 1 if before is not None else 1
            f = Failure(what, error, tries, now + timedelta(seconds=retry_delay(budget, tries)))
            self._failures[(uid, key)] = f
        return f

    def succeeded(self, uid: str, key: str) -> None:
        with self._lock:
            self._failures.pop((uid, key), None)

    def of_job(self, uid: str) -> list[Failure]:
        """The job's failures not yet followed by a success, the newest last."""
        with self._lock:
            out = [f for (u, _), f in self._failures.items() if u == uid]
        return sorted(out, key=lambda f: f.not_before)

    def forget(self, uid: str) -> None:
        with self._lock:
            for key in [k for k in self._failures if k[0] == uid]:
                del self._failures[key]


def action_key(job: str, action: object) -> tuple[str, str]:
    """(backoff key, what it does for people) of an action on a job's objects."""
    if isinstance(action, CreateControllerPod):
        name = resources.controller_pod_name(job, action.attempt)
        return f"create-pod/{name}", f"creating pod {name}"
    if isinstance(action, CreateNodePod):
        name = resources.node_pod_name(job, action.role, action.attempt, action.index)
        return f"create-pod/{name}", f"creating pod {name}"
    if isinstance(action, DeletePod):
        return f"delete-pod/{action.name}", f"deleting pod {action.name}"
    if isinstance(action, PromoteStandby):
        return f"promote-pod/{action.name}", f"taking the standby label off pod {action.name}"
    if isinstance(action, queueing.CreateWorkload):
        return "workload", "creating the job's Kueue Workload"
    if isinstance(action, queueing.DeleteWorkload):
        return "workload", f"deleting Kueue Workload {action.name} (its pod sets changed)"
    if isinstance(action, queueing.ReleaseQuota):
        return "workload-status", f"giving Kueue Workload {action.name}'s quota back (its eviction is complete)"
    if isinstance(action, queueing.FinishWorkload):
        return "workload-status", f"marking Kueue Workload {action.name} Finished"
    if isinstance(action, queueing.LetGoWorkload):
        return "workload", f"letting Kueue Workload {action.name} go (the job's pods are gone: its finalizer off)"
    if isinstance(action, EnsureChildren):
        return "children", f"making the job's {', '.join(action.kinds)} again"
    if isinstance(action, OpenDisruptionBudget | CloseDisruptionBudget):
        return "pdb", f"{'opening' if isinstance(action, OpenDisruptionBudget) else 'closing'} the PodDisruptionBudget"
    return type(action).__name__, type(action).__name__


@dataclass
class Applied:
    """What one :meth:`Actuator.apply` did."""

    status_patch: Obj | None = None
    job: Obj | None = None
    """The RLJob as our last status write returned it (None when nothing was written)."""
    done: list[object] = field(default_factory=list)
    failed: list[Failure] = field(default_factory=list)
    """Actions the API server refused this time (they back off)."""
    held: list[object] = field(default_factory=list)
    """Actions not sent: an earlier failure's backoff is still running."""


def merge_diff(old: Any, new: Any, known: frozenset[str] | None = None) -> Obj:
    """A JSON merge patch turning ``old`` into ``new`` (both mappings): changed keys, nested
    mappings recursed, lists replaced whole, removed keys set to null. With ``known``, only
    those top-level keys may be removed (others belong to someone else)."""
    out: Obj = {}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            sub = merge_diff(before, value)
            if sub:
                out[key] = sub
        elif before != value or key not in old:
            out[key] = value
    for key in old:
        if key not in new and (known is None or key in known):
            out[key] = None
    return out


def kept_account(obj: Obj | None, job: str) -> bool:
    """Whether ``obj`` is the ServiceAccount SpotRL keeps, owned by no one, for the keyless
    deletion pod of the job named ``job`` (:func:`~spotrl_operator.resources.retention_service_account`)."""
    meta = (obj or {}).get("metadata") or {}
    return not meta.get("ownerReferences") and (meta.get("labels") or {}).get(resources.RETENTION_LABEL) == job


def _refuse_foreign(existing: Obj, kind: str, ref: JobRef) -> None:
    """An object of the job's name that is not the job's own is never used, adopted or changed.
    One another RLJob (a deleted one of the same name) owns: the garbage collector deletes it
    with its owner, and the next pass makes the job's own. One that no RLJob owns (someone's
    ``web-runtime`` account, with its RBAC and cloud role) is refused until it is renamed or
    deleted, but for the account SpotRL keeps for a deletion pod (:func:`kept_account`). Raises
    a KubeError (409) that says so; it backs off like any failed action, and the job says why
    (condition ``ReconcileError``, Event ``ReconcileFailed``)."""
    owner = owner_uid(existing)
    meta = existing.get("metadata") or {}
    if owner is None and not (kind == "ServiceAccount" and kept_account(existing, ref.name)):
        raise KubeError(
            "POST",
            f"{meta.get('namespace')}/{meta.get('name')}",
            409,
            "NotMadeBySpotRL",
            f"{kind} {meta.get('name')} already exists and SpotRL did not make it (no RLJob owns it): the operator "
            f"neither runs the job with it nor changes or deletes it; create the job under another name, or delete "
            f"or rename the {kind}",
        )
    if owner is not None and owner != ref.uid:
        raise KubeError(
            "POST",
            f"{meta.get('namespace')}/{meta.get('name')}",
            409,
            "OwnedByAnotherJob",
            f"{kind} {meta.get('name')} belongs to RLJob uid {owner}, not this one ({ref.uid}): a deleted job of the "
            "same name; it is made again once the garbage collector has deleted it",
        )


def _closed_budget(job: Obj) -> Obj:
    """The job's PodDisruptionBudget, closed: the controller and the job's trainer pods."""
    try:
        trainers = resources.budget_trainers(job_spec(job))
    except api.SpecError:
        trainers = 0
    return resources.disruption_budget(job_ref(job), open_=False, trainers=trainers)


def admitted(pod: Obj, status: api.RLJobStatus | None, pod_set: str) -> None:
    """Adds what Kueue's admission assigned to ``pod_set`` (its flavors' node labels and
    tolerations) to a pod about to be created."""
    queue = status.queue if status is not None else None
    where = queue.placement.get(pod_set) if queue is not None and queue.admitted else None
    if where is None:
        return
    spec = pod["spec"]
    spec["nodeSelector"] = {**(spec.get("nodeSelector") or {}), **where.node_selector}
    tolerations = list(spec.get("tolerations") or [])
    added = [t.model_dump(by_alias=True, exclude_none=True) for t in where.tolerations]
    spec["tolerations"] = tolerations + [t for t in added if t not in tolerations]


def uids_of(snap: Snapshot) -> dict[str, str]:
    """The uid of each pod and Workload of the snapshot, by name (:meth:`Actuator._do`)."""
    seen = [*snap.pods, *([snap.workload] if snap.workload is not None else [])]
    return {str(m.get("name")): str(m["uid"]) for m in (o.get("metadata") or {} for o in seen) if m.get("uid")}


def status_doc(status: api.RLJobStatus) -> Obj:
    """The status as the API stores it (camelCase, unset fields absent)."""
    return status.model_dump(by_alias=True, exclude_none=True, mode="json")


class Actuator:
    """Applies plans for any job, as one identity. Thread-safe."""

    def __init__(
        self,
        kube: Kube,
        settings: Settings,
        on_action: Callable[[Obj, object], None] | None = None,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ):
        self.kube = kube
        self.settings = settings
        self.on_action = on_action
        self.clock = clock
        self.backoffs = Backoffs()

    # ---------------------------------------------------------------- children
    def ensure_children(self, job: Obj) -> list[str]:
        """Creates what a job needs besides its pods, if missing: the runtime's ServiceAccount,
        Role and RoleBinding, the Service, the PDB (closed), the NetworkPolicy. Returns the kinds
        it created. Nothing in a refused namespace (the job fails there: :func:`resources.check_job`)."""
        ref = job_ref(job)
        ns = ref.namespace
        if resources.namespace_refused(ns, self.settings):
            return []
        wanted = [
            (path("v1", "serviceaccounts", ns), resources.service_account(ref, self.settings)),
            (path("rbac.authorization.k8s.io/v1", "roles", ns), resources.role(ref)),
            (path("rbac.authorization.k8s.io/v1", "rolebindings", ns), resources.role_binding(ref)),
            (path("v1", "services", ns), resources.service(ref)),
            (path("policy/v1", "poddisruptionbudgets", ns), _closed_budget(job)),
        ]
        if self.settings.network_policy:
            wanted.append(
                (path("networking.k8s.io/v1", "networkpolicies", ns), resources.network_policy(ref, self.settings))
            )
        created = []
        for collection, obj in wanted:
            existing, new = self.kube.create_or_get(collection, obj)
            if new:
                created.append(obj["kind"])
            else:
                _refuse_foreign(existing, obj["kind"], ref)
        return created

    # ---------------------------------------------------------------- plans
    def apply(self, snap: Snapshot, plan: Plan) -> Applied:
        """Writes the plan's status (guarded), does its actions, and reports those that failed.
        Raises :class:`ConflictError` (the status write) and :class:`KubeError` (the status write,
        or an Event); an action's own failure is reported and backs off instead."""
        job = snap.job
        uid = str(job["metadata"].get("uid", ""))
        now = self.clock()
        out = Applied()
        if plan.status is not None:
            _, observed = status_of(job)
            diff = merge_diff(observed, status_doc(plan.status), STATUS_FIELDS)
            if diff:
                out.status_patch = diff
                out.job = self.write_status(job, diff)
        if out.status_patch is not None:
            for action in plan.actions:
                if isinstance(action, Event):
                    self.post_event(job, action.type, action.reason, action.message)
                    out.done.append(action)
        for action in plan.actions:
            if isinstance(action, Event):
                continue
            key, what = action_key(job["metadata"]["name"], action)
            if self.backoffs.held(uid, key, now) is not None:
                out.held.append(action)
                continue
            try:
                self._do(job, action, plan.status, snap.pdb, uids_of(snap))
            except KubeError as err:
                failure = self.backoffs.failed(uid, key, what, err, failure_budget(job), now)
                log.warning("%s: %s (try %d)", what, err, failure.tries)
                out.failed.append(failure)
                continue
            self.backoffs.succeeded(uid, key)
            out.done.append(action)
        reported = self.report(out.job or job)
        if reported is not None:
            out.job = reported
        return out

    def report(self, job: Obj) -> Obj | None:
        """Puts the job's failed actions on its status (condition :data:`STUCK`) and in an Event
        per failed try, or takes the condition away once they succeeded. Returns the job as
        the write returned it (None: nothing to write, or a conflict that the next pass redoes)."""
        meta = job["metadata"]
        failures = self.backoffs.of_job(str(meta.get("uid", "")))
        raw_conditions = (job.get("status") or {}).get("conditions") or []
        if not failures and not any(isinstance(c, dict) and c.get("type") == STUCK for c in raw_conditions):
            return None  # the usual pass: nothing failed, nothing to take back
        status, _ = status_of(job)
        current = next((c for c in status.conditions if c.type == STUCK), None)
        if failures:
            f = failures[-1]
            err = f.error
            kind = "cannot succeed until something changes" if f.permanent else "may be passing"
            message = (
                f"{f.what} failed {f.tries} time(s): HTTP {err.status} {err.reason}: {err.message} "
                f"(an error that {kind}); next try at {times.rfc3339(f.not_before)}"
            )
            if current is not None and current.status == "True" and current.message == message:
                return None
            reason = "".join(w[:1].upper() + w[1:] for w in re.split(r"[^A-Za-z0-9]+", err.reason)) or "Error"
            status = set_condition(status, self.clock(), int(meta.get("generation") or 0), STUCK, True, reason, message)
            event = ("Warning", "ReconcileFailed", f"{f.what}: HTTP {err.status} {err.reason}: {err.message}")
        elif current is not None:
            status = status.model_copy(update={"conditions": [c for c in status.conditions if c.type != STUCK]})
            event = ("Normal", "Reconciled", f"the operator's writes succeed again (was: {current.message})")
        else:
            return None
        diff = {"conditions": status_doc(status).get("conditions", [])}
        try:
            written = self.write_status(job, diff)
        except ConflictError:
            return None
        self.post_event(job, *event)
        return written

    def write_status(self, job: Obj, diff: Obj) -> Obj:
        """A merge patch of ``diff`` into the status, only if the job is still at the observed
        resourceVersion. Raises :class:`ConflictError` otherwise."""
        meta = job["metadata"]
        body = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": diff}
        try:
            return self.kube.patch(rljob_path(meta["namespace"], meta["name"]) + "/status", body)
        except KubeError as err:
            if err.status == 409:
                raise ConflictError(str(err)) from None
            raise

    def _do(
        self,
        job: Obj,
        action: object,
        status: api.RLJobStatus | None = None,
        pdb: Obj | None = None,
        uids: Mapping[str, str] | None = None,
    ) -> None:
        """One action. ``uids``: the uid of each pod and Workload the pass saw, by name: a delete
        is sent with it as a precondition, so an object made under that name since is not deleted."""
        uids = uids or {}
        ref = job_ref(job)
        ns = ref.namespace
        if isinstance(action, CreateControllerPod):
            spec = job_spec(job)
            pod = resources.controller_pod(
                ref, spec, self.settings, action.attempt, action.avoid_nodes, standby=action.standby
            )
            admitted(pod, status, "standby" if action.standby else "controller")
            self.ensure_children(job)
            try:
                self.kube.create(path("v1", "pods", ns), pod)
            except KubeError as err:
                if err.status != 409:
                    raise
        elif isinstance(action, CreateNodePod):
            spec = job_spec(job)
            build = resources.trainer_pod if action.role == "trainer" else resources.worker_pod
            pod = build(ref, spec, self.settings, action.attempt, action.index, action.address, action.avoid_nodes)
            admitted(pod, status, "trainers" if action.role == "trainer" else "workers")
            try:
                self.kube.create(path("v1", "pods", ns), pod)
            except KubeError as err:
                if err.status != 409:
                    raise
        elif isinstance(action, DeletePod):
            url = path("v1", "pods", ns, action.name)
            self.kube.delete(url, grace_seconds=0 if action.force else None, uid=uids.get(action.name))
        elif isinstance(action, PromoteStandby):
            # A merge patch with null removes the label, and is a no-op once it is gone.
            self.kube.patch(path("v1", "pods", ns, action.name), {"metadata": {"labels": {STANDBY_LABEL: None}}})
        elif isinstance(action, OpenDisruptionBudget | CloseDisruptionBudget):
            seen = (pdb or {}).get("spec", {}).get("minAvailable") if pdb is not None else None
            self.set_disruption_budget(job, open_=isinstance(action, OpenDisruptionBudget), seen=seen)
        elif isinstance(action, RequestBarrier):
            pass  # the status write above carried it
        elif isinstance(action, EnsureChildren):
            self.ensure_children(job)
        elif isinstance(action, queueing.CreateWorkload):
            spec = job_spec(job)
            body = queueing.workload(ref, spec, self.settings, action.queue, self.priority(job, spec))
            try:
                self.kube.create(workload_path(ns), body)
            except KubeError as err:
                if err.status != 409:
                    raise
        elif isinstance(action, queueing.DeleteWorkload):
            try:
                self.kube.delete(workload_path(ns, action.name), uid=uids.get(action.name))
            except KubeError as err:
                if err.status != 404:
                    raise
        elif isinstance(action, queueing.ReleaseQuota | queueing.FinishWorkload):
            self.patch_workload_status(ns, action)
        elif isinstance(action, queueing.LetGoWorkload):
            self.let_go_workload(ns, action.name)
        else:
            raise TypeError(f"unknown action {action!r}")
        if self.on_action is not None:
            self.on_action(job, action)

    def priority(self, job: Obj, spec: api.RLJobSpec) -> queueing.Priority | None:
        """The Workload's priority, as Kueue's job controllers resolve it: the job's
        WorkloadPriorityClass label, else its pods' PriorityClass, else none. A class that does
        not exist is an error (no Workload is made until it does)."""
        wpc = ((job.get("metadata") or {}).get("labels") or {}).get(queueing.PRIORITY_LABEL)
        if wpc:
            found = self.kube.get(path(queueing.API_VERSION, "workloadpriorityclasses", None, wpc))
            return queueing.Priority("WorkloadPriorityClass", wpc, int(found.get("value") or 0))
        pc = spec.scheduling.priority_class_name
        if pc:
            found = self.kube.get(path("scheduling.k8s.io/v1", "priorityclasses", None, pc))
            return queueing.Priority("PriorityClass", pc, int(found.get("value") or 0))
        return None

    def patch_workload_status(self, namespace: str, action: queueing.ReleaseQuota | queueing.FinishWorkload) -> None:
        """Kueue's side of an eviction or of the job's end, on the Workload's status, guarded by
        the resourceVersion read (a conflict is retried by the next pass)."""
        url = workload_path(namespace, action.name)
        wl = self.kube.get_or_none(url)
        if wl is None:
            return
        now = self.clock()
        if isinstance(action, queueing.ReleaseQuota):
            view = queueing.workload_view(wl)
            if not view.reserved:
                return  # given back already (a pass from a stale cache)
            diff = queueing.release_patch(wl, action.reason, action.message, now)
        else:
            diff = queueing.finish_patch(wl, action.succeeded, action.message, now)
        body = {"metadata": {"resourceVersion": wl["metadata"]["resourceVersion"]}, "status": diff}
        self.kube.patch(url + "/status", body)

    def let_go_workload(self, namespace: str, name: str) -> None:
        """Takes Kueue's in-use finalizer off the Workload, guarded by the resourceVersion read
        (a conflict is retried by the next pass); gone or let go already: nothing to do."""
        url = workload_path(namespace, name)
        wl = self.kube.get_or_none(url)
        diff = queueing.let_go_patch(wl) if wl is not None else None
        if diff is None:
            return
        try:
            self.kube.patch(url, diff)
        except KubeError as err:
            if err.status != 404:
                raise

    def let_go_workloads(self, job: Obj) -> None:
        """A deleted job whose pods are gone: every Workload it owns let go, so that the garbage
        collector can delete them (with Kueue's finalizer on, nobody else would)."""
        ref = job_ref(job)
        items = self.kube.get(workload_path(ref.namespace)).get("items") or []
        for wl in items:
            owners = (wl.get("metadata") or {}).get("ownerReferences") or []
            if any(o.get("uid") == ref.uid for o in owners):
                self.let_go_workload(ref.namespace, wl["metadata"]["name"])

    def stop_pods(self, job: Obj, fleet: FleetView) -> int:
        """Deletes every pod of the job (a pod on a lost node at once: nobody is left to run its
        SIGTERM path); returns how many still exist, so the caller waits for their cuts."""
        ref = job_ref(job)
        pods = self.kube.get(path("v1", "pods", ref.namespace), labelSelector=f"{resources.JOB_LABEL}={ref.name}")
        items = pods.get("items") or []
        now = self.clock() + timedelta(seconds=self.kube.server_clock.offset())  # the API server's, as the nodes' times
        lost = set(fleet.lost(now, self.settings.node_lost_seconds, self.settings.unhealthy_node_share))
        named = {(pod.get("spec") or {}).get("nodeName") for pod in items}
        lost |= {n for n in named if n and n not in lost and self._node_gone(n, fleet)}  # one GET a node, not a pod
        for pod in items:
            node = (pod.get("spec") or {}).get("nodeName") or ""
            gone = node in lost
            if gone or not pod["metadata"].get("deletionTimestamp"):
                url = path("v1", "pods", ref.namespace, pod["metadata"]["name"])
                self.kube.delete(url, grace_seconds=0 if gone else None, uid=pod["metadata"].get("uid"))
        return len(items)

    def _node_gone(self, node: str, fleet: FleetView) -> bool:
        """A node the cache lacks, confirmed gone by a live GET (a new node may not be cached yet)."""
        return node not in fleet.nodes and self.kube.get_or_none(path("v1", "nodes", None, node)) is None

    def delete_cuts(self, job: Obj, uri: str, late: bool = False) -> retention.Outcome | None:
        """retentionPolicy Delete through deletion pods (``<job>-retention-<try>``): creates the
        next one when none runs (not once ``late``: the finalizer's time is up), and returns the
        outcome once one succeeded, ``TRIES`` failed, or none can run (the namespace is being
        deleted); the pods are then deleted. None while one runs."""
        ref = job_ref(job)
        spec = job_spec(job)
        keyless = not resources.credentials_secret(ref, spec, self.settings)
        pods_url = path("v1", "pods", ref.namespace)
        found = self.kube.get(pods_url, labelSelector=f"{resources.RETENTION_LABEL}={ref.name}").get("items") or []
        outcome = retention.outcome_of([retention.pod_result(pod) for pod in found], uri, ref)
        if outcome is None and not late and not any(retention.pod_result(p) is None for p in found):
            try:
                problem = self._hold_identity(ref) if keyless else None
                if problem is None:
                    pod = resources.retention_pod(ref, spec, self.settings, uri, len(found))
                    self.kube.create_or_get(pods_url, pod)
                    return None
                outcome = retention.not_deleted(problem, uri, ref)
            except KubeError as err:
                if err.status != 403 or not retention.namespace_closing(err.message):
                    raise
                outcome = retention.gave_up(job, self.settings, "the namespace is being deleted: no pod can run there")
        if outcome is None:
            return None
        for pod in found:
            self.kube.delete(path("v1", "pods", ref.namespace, pod["metadata"]["name"]), uid=pod["metadata"].get("uid"))
        if keyless:
            self._let_go_identity(ref)
        return outcome

    def _hold_identity(self, ref: JobRef) -> str | None:
        """Keeps the job's ServiceAccount for its keyless deletion pod
        (:func:`~spotrl_operator.resources.retention_service_account`): taken out of the garbage
        collector's hands, or made again where a foreground deletion's collector took it. An
        account SpotRL did not make for this job is left as it is, and the pod never runs as it:
        returns why (None: held)."""
        held = resources.retention_service_account(ref, self.settings)
        name = held["metadata"]["name"]
        url = path("v1", "serviceaccounts", ref.namespace, name)
        sa = self.kube.get_or_none(url)
        if sa is None:
            sa, _ = self.kube.create_or_get(path("v1", "serviceaccounts", ref.namespace), held)
        if kept_account(sa, ref.name):
            return None
        meta = sa.get("metadata") or {}
        if owner_uid(sa) != ref.uid:
            return (
                f"retentionPolicy Delete: the deletion pod would run as ServiceAccount {name}, which SpotRL did not "
                "make for this job; it was left as it is"
            )
        # Guarded by the resourceVersion read: changed since, the finalizer's next pass looks again.
        guard = {"resourceVersion": meta["resourceVersion"]}
        self.kube.patch(url, {"metadata": {"ownerReferences": None, "labels": held["metadata"]["labels"], **guard}})
        return None

    def _let_go_identity(self, ref: JobRef) -> None:
        """Deletes the account kept for the deletion pod, that one only (its uid as the precondition)."""
        url = path("v1", "serviceaccounts", ref.namespace, resources.names(ref.name)["service_account"])
        sa = self.kube.get_or_none(url)
        if sa is not None and kept_account(sa, ref.name):
            self.kube.delete(url, uid=sa["metadata"].get("uid"))

    def finished(self, job: Obj, outcome: retention.Outcome) -> None:
        """The finalizer's outcome: its Event, and (a warning) its condition on the job, best effort:
        the RLJob goes next."""
        self.post_event(job, outcome.type, outcome.reason, outcome.message)
        if outcome.type != "Warning":
            return
        status, _ = status_of(job)
        meta = job["metadata"]
        status = set_condition(
            status,
            self.clock(),
            int(meta.get("generation") or 0),
            outcome.reason,
            True,
            outcome.reason,
            outcome.message,
        )
        try:
            self.write_status(job, {"conditions": status_doc(status).get("conditions", [])})
        except (ConflictError, KubeError) as err:
            log.info("%s/%s: condition %s not written: %s", meta["namespace"], meta["name"], outcome.reason, err)

    def set_disruption_budget(self, job: Obj, open_: bool, seen: Any = None) -> None:
        """Opens or closes the job's PDB; closing also sets which pods it holds (the job's
        trainer pods may have changed), so its selector is replaced, not merged. Guarded: only
        if its ``minAvailable`` is still what the pass saw (``seen``; None: not seen), so a pass
        on a stale view never undoes a newer decision. A missing PDB is made again."""
        ref = job_ref(job)
        want = _closed_budget(job)
        if open_:
            want["spec"]["minAvailable"] = 0
        url = path("policy/v1", "poddisruptionbudgets", ref.namespace, want["metadata"]["name"])
        ops = [{"op": "add", "path": f"/spec/{k}", "value": want["spec"][k]} for k in ("minAvailable", "selector")]
        if seen is not None:
            ops.insert(0, {"op": "test", "path": "/spec/minAvailable", "value": seen})
        try:
            self.kube.patch(url, ops, content_type=JSON_PATCH)
        except KubeError as err:
            if err.status == 422 and seen is not None:
                # Changed since this pass saw it: its watch event brings the next pass, which decides anew.
                log.info("%s/%s: the budget changed since it was seen; not patched", ref.namespace, ref.name)
                return
            if err.status != 404:
                raise
            created, new = self.kube.create_or_get(path("policy/v1", "poddisruptionbudgets", ref.namespace), want)
            if not new:
                _refuse_foreign(created, "PodDisruptionBudget", ref)

    # ---------------------------------------------------------------- events
    def post_event(self, job: Obj, type_: str, reason: str, message: str) -> None:
        """A core/v1 Event about the RLJob. The same (reason, message) again raises the count
        of the existing Event instead of adding one, as the kubelet's recorder does."""
        meta = job["metadata"]
        now = times.rfc3339(self.clock())
        event = resources.event(meta, type_, reason, message, now, self.settings.identity)
        name = event["metadata"]["name"]
        url = path("v1", "events", meta["namespace"])
        try:
            self.kube.create(url, event)
        except KubeError as err:
            if err.status != 409:
                log.warning("event %s on %s/%s not posted: %s", reason, meta["namespace"], meta["name"], err)
                return
            try:
                old = self.kube.get(f"{url}/{name}")
                self.kube.patch(f"{url}/{name}", {"count": int(old.get("count") or 1) + 1, "lastTimestamp": now})
            except KubeError as err2:
                log.warning("event %s on %s/%s not counted: %s", reason, meta["namespace"], meta["name"], err2)
