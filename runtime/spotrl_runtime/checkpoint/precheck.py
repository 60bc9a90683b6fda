"""A resume refused before anything starts: the chain's cheap checks, ahead of Ray and torch.

A controller that resumes starts Ray, its generation workers and the policy beside its own
imports (:mod:`~spotrl_runtime.controller.prestart`), and only then restores the cut
(:func:`~spotrl_runtime.checkpoint.resume.resume_or_start`). A cut the chain refuses was thus
found out some ten seconds and a Ray cluster later, which a CrashLoop or a user's retry pays
again each time. :func:`precheck_resume` runs first: the store's owner, ``--resume never``
against a store with cuts, and the validation chain on the cut the resume would take, without
the dataset's checks (they need torch's permutation) and without the digests of the trainer's
bulk files (gigabytes at scale; their sizes are checked). It imports neither torch nor Ray,
writes nothing, and reads the manifest and the owner files: well under a second.

It only ever refuses what the restore would refuse too, and with the same error:

- under ``--resume auto`` a byte-level failure is left to the restore, which skips a
  damaged cut for an older one; so is any failure of a cut whose trainer files turn out
  damaged (the restore would skip it first);
- a store it cannot read says nothing here: the restore reads it again, and says why.

What it passes, the restore checks again, whole.
"""

from __future__ import annotations

import logging

from spotrl_runtime.checkpoint.layout import list_cut_folders
from spotrl_runtime.checkpoint.ownership import prove_ownership
from spotrl_runtime.checkpoint.reader import StorageCutSource
from spotrl_runtime.core.identity import JobIdentity
from spotrl_runtime.core.owners import RecoveryConfig
from spotrl_runtime.core.validation import (
    BYTE_LEVEL_CHECKS,
    CutCheckError,
    Expectations,
    check_files,
    check_manifest,
    validate_base,
    validate_cut,
)
from spotrl_runtime.storage import Storage, StorageError

log = logging.getLogger("spotrl.resume")


class ResumeError(RuntimeError):
    """The run cannot start from this storage as asked; the message says what to do."""


def refuse_never(storage: Storage, newest: str | None) -> None:
    """``--resume never``: raises :class:`ResumeError` if the store holds a committed cut."""
    if newest is not None:
        raise ResumeError(
            f"{storage.uri} already holds cuts of a run (newest: {newest}); "
            "resume it with --resume auto, or give a fresh --storage"
        )


def precheck_resume(storage: Storage, *, job: JobIdentity, config: RecoveryConfig, resume: str) -> str | None:
    """Raises what the restore of ``resume`` (``auto``, ``never`` or a cut id) would raise
    where a cheap check already shows it: :class:`ResumeError`, or the chain's
    :class:`~spotrl_runtime.core.validation.CutCheckError` (``job_identity`` for another job's
    store). Returns the cut it checked (None: none, or a store it could not read)."""
    try:
        prove_ownership(storage, job, claim=False)
        committed = [f.cut_id for f in list_cut_folders(storage) if f.committed]
        newest = committed[-1] if committed else None
        if resume == "never":
            refuse_never(storage, newest)
            return None
        cut_id = newest if resume == "auto" else resume
        if cut_id is None:
            return None
        expect = Expectations(job=job.name, config=config)
        with StorageCutSource(storage, cut_id) as source:
            try:
                validated = validate_cut(source, None, expect, trainer_digests=False)
            except CutCheckError as err:
                if resume == "auto" and (err.check in BYTE_LEVEL_CHECKS or _damaged(source)):
                    return None  # the restore skips it for an older cut, and says so
                raise
        if validated.manifest.base is not None:
            with StorageCutSource(storage, validated.manifest.base.cut_id) as base:
                validate_base(source.location, validated.manifest, base, None, expect, trainer_digests=False)
        return cut_id
    except StorageError as err:
        log.debug("precheck of %s: %s (the restore reads it again)", storage.uri, err)
        return None


def _damaged(source: StorageCutSource) -> bool:
    """Whether a byte-level check refuses this cut once every file's digest is computed."""
    try:
        check_files(source.location, check_manifest(source.location, source.read_manifest()), source)
    except CutCheckError as err:
        return err.check in BYTE_LEVEL_CHECKS
    return False
