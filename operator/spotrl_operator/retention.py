"""What happens to a deleted job's cuts: ``spec.checkpoint.retentionPolicy``. Pure decisions;
the finalizer (:mod:`spotrl_operator.handlers`) acts on them.

``Retain`` keeps them (a new RLJob pointed at the same storage resumes from them).
``Delete`` removes what the job wrote under its storage root and nothing else
(:mod:`spotrl_runtime.storage.purge`), and only where that root is the job's own prefix,
``<storage>/<namespace>/<name>``: anything else is refused with a Warning Event and stays.

The deletion runs in a pod in the job's namespace (:func:`~spotrl_operator.resources.retention_pod`,
``spotrl ckpt delete``) that gets the job's S3 credentials from its Secret through the
kubelet. The operator itself never reads a Secret: its RBAC has no rule on Secrets at all.
Only S3 storage can be deleted: a local path lives on the job's nodes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from spotrl_operator.observe import job_ref, job_spec
from spotrl_operator.resources import JobRef, namespace_refused, storage_uri
from spotrl_operator.settings import Settings
from spotrl_runtime.api import times
from spotrl_runtime.storage.purge import job_prefix_problem

Obj = dict[str, Any]
TRIES = 3
"""Deletion pods that may fail before the operator gives up and lets the RLJob go."""


@dataclass(frozen=True)
class Outcome:
    """What the retention step did, as the Event that reports it."""

    type: str
    reason: str
    message: str


@dataclass(frozen=True)
class DeleteCuts:
    """Run a deletion pod for the cuts at ``uri``."""

    uri: str


def decide(job: Obj, settings: Settings) -> Outcome | DeleteCuts:
    """What the job's retention policy asks for: an Outcome at once, or a deletion."""
    spec = job_spec(job)
    ref = job_ref(job)
    refused = namespace_refused(ref.namespace, settings)
    if refused:
        return Outcome("Warning", "CutsNotDeleted", f"{refused}; no deletion pod runs there, nothing was deleted")
    try:
        uri = storage_uri(ref, spec, settings)
    except ValueError:
        return Outcome("Normal", "CutsRetained", "the job had no storage; nothing to delete")
    if spec.checkpoint.retention_policy == "Retain":
        return Outcome("Normal", "CutsRetained", f"retentionPolicy Retain: the cuts stay at {uri}")
    if not uri.startswith("s3://"):
        return Outcome(
            "Warning",
            "CutsNotDeleted",
            f"retentionPolicy Delete: {uri} is a path on the job's nodes, which the operator cannot reach; "
            "delete it there",
        )
    problem = job_prefix_problem(uri, ref.namespace, ref.name)
    if problem:
        return Outcome("Warning", "CutsNotDeleted", f"refused: {problem}; nothing was deleted, the cuts stay")
    return DeleteCuts(uri)


def pod_result(pod: Obj) -> tuple[str, str] | None:
    """A deletion pod's result: ("Succeeded" | "Failed", what it said), or None while it runs.
    A container that cannot start (a bad image, a missing Secret) counts as failed."""
    status = pod.get("status") or {}
    containers = status.get("containerStatuses") or []
    state = (containers[0].get("state") or {}) if containers else {}
    waiting = state.get("waiting") or {}
    if waiting.get("reason") in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName", "CreateContainerConfigError"):
        return "Failed", f"{waiting['reason']}: {waiting.get('message', '')}".strip()
    phase = status.get("phase")
    if phase not in ("Succeeded", "Failed"):
        return None
    term = state.get("terminated") or {}
    message = (term.get("message") or status.get("message") or "").strip()
    if phase == "Failed" and not message:
        message = f"exit code {term.get('exitCode', '?')}"
    return phase, message


def outcome_of(results: list[tuple[str, str] | None], uri: str, ref: JobRef) -> Outcome | None:
    """What the deletion pods' results (:func:`pod_result`, None: running) add up to: one
    succeeded, or :data:`TRIES` failed; None: not yet."""
    done = next((r[1] for r in results if r is not None and r[0] == "Succeeded"), None)
    if done is not None:
        return deleted_outcome(uri, done)
    failed = [r[1] for r in results if r is not None and r[0] == "Failed"]
    if len(failed) < TRIES or any(r is None for r in results):
        return None
    why = f"retentionPolicy Delete: the deletion pod failed {len(failed)} times (last: {failed[-1][:300]})"
    return not_deleted(why, uri, ref)


def deleted_outcome(uri: str, message: str) -> Outcome:
    """The Event of a deletion pod that succeeded (its termination message is JSON)."""
    try:
        count = int(json.loads(message)["deleted"])
    except (ValueError, KeyError, TypeError):
        return Outcome("Normal", "CutsDeleted", f"retentionPolicy Delete: removed the job's objects under {uri}")
    return Outcome("Normal", "CutsDeleted", f"retentionPolicy Delete: removed {count} objects under {uri}")


def past_deadline(job: Obj, seconds: float, now: datetime) -> bool:
    """Whether the finalizer has waited ``seconds`` since the job's deletion began."""
    try:
        since = times.parse((job.get("metadata") or {}).get("deletionTimestamp"))
    except ValueError:
        return False
    return since is not None and now - since >= timedelta(seconds=seconds)


def gave_up(job: Obj, settings: Settings, why: str) -> Outcome:
    """The finalizer stops waiting: the cuts stay, and the Event says where and how to delete them."""
    ref = job_ref(job)
    try:
        spec = job_spec(job)
        uri = storage_uri(ref, spec, settings)
    except Exception:  # no storage, or a spec this version cannot read: the finalizer must still end
        return Outcome("Warning", "CutsNotDeleted", f"{why}; the job had no storage (or its spec does not parse)")
    if spec.checkpoint.retention_policy == "Retain":
        return Outcome("Warning", "CutsRetained", f"{why}; retentionPolicy Retain: the cuts stay at {uri}")
    return not_deleted(why, uri, ref)


def not_deleted(why: str, uri: str, ref: JobRef) -> Outcome:
    """The cuts stay: where, and the command that deletes them."""
    return Outcome(
        "Warning",
        "CutsNotDeleted",
        f"{why}; the cuts stay at {uri}; delete them with `spotrl ckpt delete {uri} --job {ref.namespace}/{ref.name}`",
    )


def namespace_closing(message: str) -> bool:
    """Whether a 403 on a create says the namespace is being deleted (no new pod can run there)."""
    return "because it is being terminated" in message
