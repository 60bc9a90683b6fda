"""Which job a store belongs to: proved before a controller writes anything there.

A store's first writer leaves ``JOB.json`` (:data:`~spotrl_runtime.storage.purge.OWNER_KEY`)
at its root, create-only: the job's name, and in a cluster its namespace and uid. Every
controller reads it before its fence claim (:func:`prove_ownership`), so a job pointed at
another job's storage (an easy slip with an explicit ``spec.checkpoint.storage`` or
``--storage``) is refused before it writes a claim, an audit record or a cut, and cannot fence
the job that trains there. The refusal is check ``job_identity``, as for a foreign cut: one
line, exit code 3.

A store written before ``JOB.json`` existed is adopted by the first job that can show the
store is its own: its newest committed cut and every claim that names a job name this job. A
claim or cut of another job refuses it. Who counts as the same job:
:class:`~spotrl_runtime.core.identity.JobIdentity`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

from spotrl_runtime.checkpoint.fence import ATTEMPTS, claim_owner
from spotrl_runtime.checkpoint.layout import manifest_key, newest_committed
from spotrl_runtime.core.cut_format import MANIFEST_NAME
from spotrl_runtime.core.identity import JobIdentity
from spotrl_runtime.core.validation import ForeignCutError
from spotrl_runtime.storage import ObjectExistsError, ObjectNotFoundError, Storage
from spotrl_runtime.storage.purge import OWNER_KEY

log = logging.getLogger("spotrl.ownership")

_ADVICE = "point the job at its own checkpoint storage"


def prove_ownership(storage: Storage, job: JobIdentity, *, claim: bool = True) -> None:
    """Returns once ``storage`` is ``job``'s: ``JOB.json`` names it, or the store holds nothing
    of another job and ``JOB.json`` was just written (create-only) for it (``claim=False``:
    only checked, nothing written, as ``spotrl ckpt verify`` does). Raises
    :class:`~spotrl_runtime.core.validation.ForeignCutError` (check ``job_identity``) naming
    the file that belongs to another job; nothing is written then."""
    loc = storage.uri.rstrip("/")
    owner = _stored_owner(storage, loc)
    if owner is None:
        for key, other in _traces(storage):
            if not other.same_job(job):
                what = "cut" if key.endswith(MANIFEST_NAME) else "claim"
                raise ForeignCutError(loc, key, f"the {what} belongs to job {str(other)!r}, not {str(job)!r}", _ADVICE)
        if not claim:
            return
        try:
            storage.put_bytes(OWNER_KEY, json.dumps(job.to_json(), sort_keys=True).encode(), create_only=True)
            log.info("%s is job %s's store from now on (%s written)", loc, job, OWNER_KEY)
            return
        except ObjectExistsError:
            owner = _stored_owner(storage, loc)  # another controller wrote it first: whose is it?
            if owner is None:
                raise ForeignCutError(
                    loc, OWNER_KEY, "was written and then removed while this job started", _ADVICE
                ) from None
    if not owner.same_job(job):
        raise ForeignCutError(loc, OWNER_KEY, f"the store belongs to job {str(owner)!r}, not {str(job)!r}", _ADVICE)


def _stored_owner(storage: Storage, loc: str) -> JobIdentity | None:
    """Who ``JOB.json`` names (None: there is none); a file that names nobody is refused."""
    try:
        data = storage.get_bytes(OWNER_KEY)
    except ObjectNotFoundError:
        return None
    try:
        owner = JobIdentity.from_json(json.loads(data))
    except ValueError:
        owner = None
    if owner is None:
        raise ForeignCutError(
            loc,
            OWNER_KEY,
            'names no job (expected {"name": ..., "namespace": ..., "uid": ...})',
            "remove it only if this store is this job's own, or point the job at its own checkpoint storage",
        )
    return owner


def _traces(storage: Storage) -> Iterator[tuple[str, JobIdentity]]:
    """The jobs a store without ``JOB.json`` shows traces of: each claim that names its job,
    and the newest committed cut's."""
    for info in storage.list(f"{ATTEMPTS}/"):
        if info.key.endswith(".json"):
            who = claim_owner(storage, info.key)
            if who is not None:
                yield info.key, who
    newest = newest_committed(storage)
    if newest is not None:
        try:
            name = json.loads(storage.get_bytes(manifest_key(newest))).get("job")
        except (ObjectNotFoundError, ValueError, AttributeError):
            return  # the validation chain names what is wrong with it
        if isinstance(name, str) and name:
            yield manifest_key(newest), JobIdentity(name)
