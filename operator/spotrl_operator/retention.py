"""What happens to a deleted job's cuts: ``spec.checkpoint.retentionPolicy``.

``Retain`` keeps them (a new RLJob pointed at the same storage resumes from them).
``Delete`` removes what the job wrote under its storage root, and nothing else: the cut
folders (``cuts/``), the pointer (``LATEST.json``), the audit log (``audit/``) and the
controllers' fence claims (``attempts/``). Other keys under the same root are not the
job's and stay.

Only S3 storage can be deleted by the operator: a local path lives on the job's nodes.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from spotrl_operator.observe import job_ref
from spotrl_operator.resources import storage_uri
from spotrl_operator.settings import Settings
from spotrl_runtime.api import rljob as api
from spotrl_runtime.kube import Kube, KubeError, path

Obj = dict[str, Any]
# attempts/ is spotrl_runtime.checkpoint.fence.ATTEMPTS, spelled out: the checkpoint package
# imports torch, which the operator's image does not have (a unit test keeps them equal).
JOB_PREFIXES = ("cuts/", "audit/", "attempts/")
JOB_KEYS = ("LATEST.json",)


@dataclass(frozen=True)
class Outcome:
    """What the retention step did, as the Event that reports it."""

    type: str
    reason: str
    message: str


class RetentionError(RuntimeError):
    """Deleting the cuts failed for now (storage unreachable, credentials missing ...)."""


def _credentials(kube: Kube, namespace: str, secret: str | None) -> tuple[str | None, str | None]:
    if not secret:
        return None, None
    try:
        obj = kube.get(path("v1", "secrets", namespace, secret))
    except KubeError as err:
        raise RetentionError(
            f"cannot read Secret {namespace}/{secret} named by spec.checkpoint.credentialsSecret: {err.message}"
        ) from None
    data = obj.get("data") or {}
    try:
        access = base64.b64decode(data["AWS_ACCESS_KEY_ID"]).decode()
        secret_key = base64.b64decode(data["AWS_SECRET_ACCESS_KEY"]).decode()
    except KeyError as err:
        raise RetentionError(f"Secret {namespace}/{secret} lacks the key {err.args[0]}") from None
    return access, secret_key


def apply_retention(kube: Kube, job: Obj, settings: Settings) -> Outcome:
    """Applies the job's retention policy to its cuts. Raises :class:`RetentionError` when a
    deletion should be tried again."""
    spec = api.parse_spec(job.get("spec") or {})
    ref = job_ref(job)
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

    from spotrl_runtime.storage import StorageError, open_storage

    access, secret_key = _credentials(
        kube, ref.namespace, spec.checkpoint.credentials_secret or settings.default_credentials_secret
    )
    try:
        store = open_storage(
            uri,
            endpoint_url=spec.checkpoint.s3_endpoint or settings.default_s3_endpoint,
            region=spec.checkpoint.s3_region,
            access_key=access,
            secret_key=secret_key,
        )
        keys = [info.key for prefix in JOB_PREFIXES for info in store.list(prefix)]
        keys += [k for k in JOB_KEYS if store.head(k) is not None]
        for key in keys:
            store.delete(key)
    except (StorageError, OSError) as err:
        raise RetentionError(f"deleting the cuts at {uri}: {err}") from None
    except Exception as err:  # botocore's errors do not share a base with StorageError
        raise RetentionError(f"deleting the cuts at {uri}: {type(err).__name__}: {err}") from None
    return Outcome("Normal", "CutsDeleted", f"retentionPolicy Delete: removed {len(keys)} objects under {uri}")
