"""Carry out a :class:`~spotrl_operator.reconcile.Plan` against the API server, idempotently.

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
   means done), because a plan may be applied twice from a stale cache. One that fails
   raises; the status already says what is wanted, so the next reconcile tries again.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from spotrl_operator import resources
from spotrl_operator.kube import Kube, KubeError, path
from spotrl_operator.observe import STATUS_FIELDS, Snapshot, job_ref, rljob_path
from spotrl_operator.reconcile import (
    CloseDisruptionBudget,
    CreateControllerPod,
    CreateWorkerPod,
    DeletePod,
    Event,
    OpenDisruptionBudget,
    Plan,
    RequestBarrier,
    iso,
)
from spotrl_operator.settings import Settings
from spotrl_runtime.api import rljob as api

Obj = dict[str, Any]
log = logging.getLogger("spotrl.operator")


class ConflictError(Exception):
    """The status changed since it was observed: observe again, reconcile again."""


@dataclass
class Applied:
    """What one :meth:`Actuator.apply` did."""

    status_patch: Obj | None = None
    job: Obj | None = None
    """The RLJob as the status write returned it (None when nothing was written)."""
    done: list[object] = field(default_factory=list)


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

    # ---------------------------------------------------------------- children
    def ensure_children(self, job: Obj) -> list[str]:
        """Creates what a job needs besides its pods, if missing: the runtime's ServiceAccount,
        Role and RoleBinding, the Service, the PDB (closed). Returns the kinds it created."""
        ref = job_ref(job)
        ns = ref.namespace
        wanted = [
            (path("v1", "serviceaccounts", ns), resources.service_account(ref)),
            (path("rbac.authorization.k8s.io/v1", "roles", ns), resources.role(ref)),
            (path("rbac.authorization.k8s.io/v1", "rolebindings", ns), resources.role_binding(ref)),
            (path("v1", "services", ns), resources.service(ref)),
            (path("policy/v1", "poddisruptionbudgets", ns), resources.disruption_budget(ref, open_=False)),
        ]
        created = []
        for collection, obj in wanted:
            _, new = self.kube.create_or_get(collection, obj)
            if new:
                created.append(obj["kind"])
        return created

    # ---------------------------------------------------------------- plans
    def apply(self, snap: Snapshot, plan: Plan) -> Applied:
        """Writes the plan's status (guarded), then does its actions. Raises :class:`ConflictError`."""
        job = snap.job
        out = Applied()
        if plan.status is not None:
            observed = {k: v for k, v in (job.get("status") or {}).items() if k in STATUS_FIELDS}
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
            if not isinstance(action, Event):
                self._do(job, action)
                out.done.append(action)
        return out

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

    def _do(self, job: Obj, action: object) -> None:
        ref = job_ref(job)
        ns = ref.namespace
        if isinstance(action, CreateControllerPod):
            spec = api.parse_spec(job["spec"])
            pod = resources.controller_pod(ref, spec, self.settings, action.attempt, action.avoid_nodes)
            self.ensure_children(job)
            try:
                self.kube.create(path("v1", "pods", ns), pod)
            except KubeError as err:
                if err.status != 409:
                    raise
        elif isinstance(action, CreateWorkerPod):
            spec = api.parse_spec(job["spec"])
            pod = resources.worker_pod(
                ref, spec, self.settings, action.attempt, action.index, action.address, action.avoid_nodes
            )
            try:
                self.kube.create(path("v1", "pods", ns), pod)
            except KubeError as err:
                if err.status != 409:
                    raise
        elif isinstance(action, DeletePod):
            self.kube.delete(path("v1", "pods", ns, action.name), grace_seconds=0 if action.force else None)
        elif isinstance(action, OpenDisruptionBudget | CloseDisruptionBudget):
            self.set_disruption_budget(job, open_=isinstance(action, OpenDisruptionBudget))
        elif isinstance(action, RequestBarrier):
            pass  # the status write above carried it
        else:
            raise TypeError(f"unknown action {action!r}")
        if self.on_action is not None:
            self.on_action(job, action)

    def set_disruption_budget(self, job: Obj, open_: bool) -> None:
        ref = job_ref(job)
        want = resources.disruption_budget(ref, open_)
        url = path("policy/v1", "poddisruptionbudgets", ref.namespace, want["metadata"]["name"])
        try:
            self.kube.patch(url, {"spec": {"minAvailable": want["spec"]["minAvailable"]}})
        except KubeError as err:
            if err.status != 404:
                raise
            self.kube.create_or_get(path("policy/v1", "poddisruptionbudgets", ref.namespace), want)

    # ---------------------------------------------------------------- events
    def post_event(self, job: Obj, type_: str, reason: str, message: str) -> None:
        """A core/v1 Event about the RLJob. The same (reason, message) again raises the count
        of the existing Event instead of adding one, as the kubelet's recorder does."""
        meta = job["metadata"]
        now = iso(self.clock())
        digest = hashlib.sha256(f"{meta.get('uid')}|{type_}|{reason}|{message}".encode()).hexdigest()[:16]
        name = f"{meta['name']}.{digest}"
        url = path("v1", "events", meta["namespace"])
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": api.API_VERSION,
                "kind": api.KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": "spotrl-operator"},
            "reportingComponent": "spotrl.dev/operator",
            "reportingInstance": self.settings.identity[:128],
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
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
