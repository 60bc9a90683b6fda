"""The validation chain: every check a cut must pass before anything is redispatched.

Restore and ``spotrl ckpt verify`` run this one chain. Each check is a hard error with
its own class and name, saying which file or record failed, why, and what to do. The
chain stops at the first failure: later checks read what earlier ones vouched for.

The chain is pure logic: it reads the cut through :class:`CutSource` (the storage side
hashes and reads files) and the dataset through :class:`PromptLookup`.

In order (``CHECKS``):

==========================  ========================================================
check                       what it refuses
==========================  ========================================================
``manifest_present``        a cut without a manifest: it was never committed
``manifest_parses``         a manifest that is not JSON or lacks fields
``schema_version``          a manifest written by code whose format we do not read
``job_identity``            a cut of another job (when the caller names the job)
``config_compatible``       a cut with another group size or batch size than the run
``file_present``            a listed file that is missing
``file_size``               a listed file with another size (truncated, torn)
``file_digest``             a listed file with another sha256 (stale, corrupted)
``orphan_file``             a file in the cut's data folder the manifest does not list
``owner_file_format``       an owner file that does not decode
``ledger_record``           a malformed ledger record (ids, phase, stamps by phase)
``group_counts``            counts in the manifest that differ from the files
``admission_consistent``    one admission with two phases or two stamps
``single_owner``            a group owned twice (ledger, replay buffer, spare pool)
``rollout_rows``            finished groups without all G rows; rows of no group
``cursor_covers_stamps``    a stamp above the saved sampler cursor
``stamp_not_trained``       a stamp below the trainer step (already trained)
``dataset_size``            a dataset whose length changed since the cut
``prompt_rebuild``          a row that no longer rebuilds with the same idx and task
``prompt_fingerprint``      a row whose content changed under the same idx
==========================  ========================================================
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar, Protocol

from spotrl_runtime.core.cut_format import (
    MANIFEST_NAME,
    OWNER_FILES,
    READABLE_SCHEMA_VERSIONS,
    CutDocuments,
    Manifest,
    OwnerFileError,
    decode_owner_files,
    document_counts,
)
from spotrl_runtime.core.fields import RecordFormatError
from spotrl_runtime.core.ledger import LedgerRecord, Phase
from spotrl_runtime.core.owners import RecoveryConfig
from spotrl_runtime.core.types import Prompt

# ----------------------------------------------------------------------- errors


class CutCheckError(Exception):
    """A cut failed one check of the chain. ``check`` names it; ``path`` the file (or None)."""

    check: ClassVar[str] = ""

    def __init__(self, location: str, path: str | None, why: str, todo: str = ""):
        self.location = location
        self.path = path
        self.why = why
        where = f"{location}/{path}" if path else location
        self.detail = f"{where}: {why}" + (f"; {todo}" if todo else "")
        """The message without the check's name."""
        super().__init__(f"[{self.check}] {self.detail}")


_NEWER = "restore from an older cut with `spotrl ckpt list` / --cut, or investigate what wrote this one"


class ManifestMissingError(CutCheckError):
    check = "manifest_present"


class ManifestFormatError(CutCheckError):
    check = "manifest_parses"


class SchemaVersionError(CutCheckError):
    check = "schema_version"


class ForeignCutError(CutCheckError):
    check = "job_identity"


class ConfigMismatchError(CutCheckError):
    check = "config_compatible"


class FileMissingError(CutCheckError):
    check = "file_present"


class FileSizeError(CutCheckError):
    check = "file_size"


class FileDigestError(CutCheckError):
    check = "file_digest"


class OrphanFileError(CutCheckError):
    check = "orphan_file"


class OwnerFileFormatError(CutCheckError):
    check = "owner_file_format"


class GroupCountError(CutCheckError):
    check = "group_counts"


class LedgerRecordError(CutCheckError):
    check = "ledger_record"


class AdmissionConsistencyError(CutCheckError):
    check = "admission_consistent"


class DoubleOwnerError(CutCheckError):
    check = "single_owner"


class RolloutRowsError(CutCheckError):
    check = "rollout_rows"


class CursorBehindStampError(CutCheckError):
    check = "cursor_covers_stamps"


class TrainedStampError(CutCheckError):
    check = "stamp_not_trained"


class DatasetSizeError(CutCheckError):
    check = "dataset_size"


class PromptRebuildError(CutCheckError):
    check = "prompt_rebuild"


class PromptFingerprintError(CutCheckError):
    check = "prompt_fingerprint"


ERRORS: tuple[type[CutCheckError], ...] = (
    ManifestMissingError,
    ManifestFormatError,
    SchemaVersionError,
    ForeignCutError,
    ConfigMismatchError,
    FileMissingError,
    FileSizeError,
    FileDigestError,
    OrphanFileError,
    OwnerFileFormatError,
    LedgerRecordError,
    GroupCountError,
    AdmissionConsistencyError,
    DoubleOwnerError,
    RolloutRowsError,
    CursorBehindStampError,
    TrainedStampError,
    DatasetSizeError,
    PromptRebuildError,
    PromptFingerprintError,
)
CHECKS: tuple[str, ...] = tuple(e.check for e in ERRORS)
"""Every check, in the order the chain runs them."""


# ------------------------------------------------------------------- interfaces


class CutSource(Protocol):
    """Read access to one cut folder (``cuts/<id>/``); paths are relative to it."""

    location: str
    """The cut's URI, for messages."""

    def read_manifest(self) -> bytes | None:
        """The manifest's bytes, or None if there is none."""
        ...

    def size(self, path: str) -> int | None:
        """A file's size, or None if it does not exist."""
        ...

    def digest(self, path: str) -> str:
        """A file's sha256 (hex), computed from its content."""
        ...

    def read(self, path: str) -> bytes:
        """A file's content."""
        ...

    def list_dir(self, folder: str) -> list[str]:
        """Every file under ``folder`` (recursively), as paths relative to the cut."""
        ...


class PromptLookup(Protocol):
    """The dataset as the chain needs it: its length, and ``dataset[idx]`` through the one-row collate."""

    def __len__(self) -> int: ...

    def rebuild(self, idx: int) -> Prompt: ...


@dataclass(frozen=True)
class Expectations:
    """What the caller knows the cut must match (restore passes these; verify may)."""

    job: str | None = None
    config: RecoveryConfig | None = None


@dataclass(frozen=True)
class ValidatedCut:
    """A cut that passed every check: its manifest, decoded owners and rebuilt prompts."""

    manifest: Manifest
    documents: CutDocuments
    prompts: Mapping[str, Prompt]
    checks: tuple[str, ...] = CHECKS
    """The checks that ran (those needing an expectation or the dataset run only when given one)."""


# ------------------------------------------------------------------------ chain


def validate_cut(source: CutSource, lookup: PromptLookup | None, expect: Expectations | None = None) -> ValidatedCut:
    """Runs the whole chain on one cut; raises the first :class:`CutCheckError`.

    ``lookup`` None runs every check except the dataset ones (``dataset_size``,
    ``prompt_rebuild``, ``prompt_fingerprint``) and returns no prompts; restore always
    passes one.
    """
    expect = expect or Expectations()
    loc = source.location
    manifest = check_manifest(loc, source.read_manifest())
    check_expectations(loc, manifest, expect)
    check_files(loc, manifest, source)
    blobs = {f.role: source.read(f.path) for f in manifest.files if f.role in OWNER_FILES}
    docs = decode_documents(loc, manifest, blobs)
    docs = check_ledger_records(loc, manifest, docs)
    check_group_counts(loc, manifest, docs)
    check_admissions(loc, manifest, docs)
    check_single_owner(loc, manifest, docs)
    check_rollout_rows(loc, manifest, docs)
    check_stamps(loc, manifest, docs)
    skipped = {"job_identity"} if expect.job is None else set()
    skipped |= {"config_compatible"} if expect.config is None else set()
    prompts: dict[str, Prompt] = {}
    if lookup is None:
        skipped |= {"dataset_size", "prompt_rebuild", "prompt_fingerprint"}
    else:
        prompts = check_prompts(loc, manifest, docs, lookup)
    return ValidatedCut(manifest, docs, prompts, tuple(c for c in CHECKS if c not in skipped))


def check_manifest(loc: str, raw: bytes | None) -> Manifest:
    """``manifest_present``, ``manifest_parses``, ``schema_version``."""
    if raw is None:
        raise ManifestMissingError(
            loc,
            MANIFEST_NAME,
            "no manifest: this cut was never committed (a crash or a deadline stopped its writer)",
            "it does not exist as a cut; restore picks the newest committed one",
        )
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise ManifestFormatError(loc, MANIFEST_NAME, f"not JSON ({err})", _NEWER) from None
    version = data.get("schema_version") if isinstance(data, dict) else None
    if version not in READABLE_SCHEMA_VERSIONS:
        raise SchemaVersionError(
            loc,
            MANIFEST_NAME,
            f"schema_version {version!r} is not one this code reads ({list(READABLE_SCHEMA_VERSIONS)})",
            "use the SpotRL version that wrote the cut",
        )
    try:
        return Manifest.from_json(data)
    except RecordFormatError as err:
        raise ManifestFormatError(loc, MANIFEST_NAME, str(err), _NEWER) from None


def check_expectations(loc: str, manifest: Manifest, expect: Expectations) -> None:
    """``job_identity``, ``config_compatible``."""
    if expect.job is not None and manifest.job != expect.job:
        raise ForeignCutError(
            loc,
            MANIFEST_NAME,
            f"the cut belongs to job {manifest.job!r}, not {expect.job!r}",
            "point the job at its own checkpoint storage",
        )
    if expect.config is not None:
        for key in ("group_size", "prompts_per_step"):
            saved = manifest.config.get(key)
            if saved != getattr(expect.config, key):
                raise ConfigMismatchError(
                    loc,
                    MANIFEST_NAME,
                    f"{key} is {saved} in the cut but {getattr(expect.config, key)} in the job",
                    "restore with the settings the cut was taken with, or start a new run",
                )


def check_files(loc: str, manifest: Manifest, source: CutSource) -> None:
    """``file_present``, ``file_size``, ``file_digest``, ``orphan_file``."""
    for f in manifest.files:
        size = source.size(f.path)
        if size is None:
            raise FileMissingError(loc, f.path, f"listed in the manifest ({f.role}) but missing", _NEWER)
        if size != f.size:
            raise FileSizeError(loc, f.path, f"is {size} bytes, the manifest says {f.size} (truncated or torn)", _NEWER)
    for f in manifest.files:
        digest = source.digest(f.path)
        if digest != f.sha256:
            raise FileDigestError(
                loc,
                f.path,
                f"sha256 is {digest[:16]}…, the manifest says {f.sha256[:16]}… (stale or corrupted)",
                _NEWER,
            )
    listed = {f.path for f in manifest.files}
    for path in source.list_dir(manifest.data_dir):
        if path not in listed:
            raise OrphanFileError(
                loc,
                path,
                "present in the cut's data folder but not listed in its manifest (an orphan from another writer)",
                "remove it, or restore from another cut",
            )


def decode_documents(loc: str, manifest: Manifest, blobs: Mapping[str, bytes]) -> CutDocuments:
    """``owner_file_format``."""
    try:
        return decode_owner_files(blobs)
    except OwnerFileError as err:
        path = _path_of(manifest, err.role)
        raise OwnerFileFormatError(loc, path, str(err), _NEWER) from None


def check_ledger_records(loc: str, manifest: Manifest, docs: CutDocuments) -> CutDocuments:
    """``ledger_record``: well-formed records, unique ids, stamps as the phase demands."""
    path = _path_of(manifest, "ledger")
    records: list[LedgerRecord] = []
    seen: set[str] = set()
    for i, raw in enumerate(docs.ledger_raw):
        try:
            rec = LedgerRecord.from_json(raw)
        except RecordFormatError as err:
            raise LedgerRecordError(loc, path, f"record {i}: {err}", _NEWER) from None
        if rec.group_id in seen:
            raise LedgerRecordError(loc, path, f"record {i}: group_id {rec.group_id} appears twice", _NEWER)
        seen.add(rec.group_id)
        if rec.phase is Phase.RESERVED and (rec.target_step is not None or rec.weight_version is not None):
            raise LedgerRecordError(
                loc, path, f"record {i} ({rec.group_id}) is RESERVED but has a target_step or weight_version", _NEWER
            )
        if rec.phase is Phase.ADMITTED and (rec.target_step is None or rec.weight_version is None):
            raise LedgerRecordError(
                loc, path, f"record {i} ({rec.group_id}) is ADMITTED but has no target_step or weight_version", _NEWER
            )
        if rec.expected_generations != docs.config.group_size:
            raise LedgerRecordError(
                loc,
                path,
                f"record {i} ({rec.group_id}) expects {rec.expected_generations} generations, "
                f"the run's group size is {docs.config.group_size}",
                _NEWER,
            )
        records.append(rec)
    return replace(docs, ledger=tuple(records))


def check_group_counts(loc: str, manifest: Manifest, docs: CutDocuments) -> None:
    """``group_counts``: the manifest's counts equal what the files hold."""
    found = document_counts(docs)
    for key, value in found.items():
        if manifest.group_counts.get(key) != value:
            raise GroupCountError(
                loc,
                MANIFEST_NAME,
                f"group_counts.{key} is {manifest.group_counts.get(key)} but the files hold {value} (truncated file?)",
                _NEWER,
            )


def check_admissions(loc: str, manifest: Manifest, docs: CutDocuments) -> None:
    """``admission_consistent``: the groups of one admission share one phase and one stamp."""
    by_admission: dict[str, tuple[Phase, int | None, str]] = {}
    for rec in docs.ledger:
        first = by_admission.setdefault(rec.admission_id, (rec.phase, rec.target_step, rec.group_id))
        if first[:2] != (rec.phase, rec.target_step):
            raise AdmissionConsistencyError(
                loc,
                _path_of(manifest, "ledger"),
                f"admission {rec.admission_id}: {first[2]} is {first[0].value} stamped {first[1]}, "
                f"{rec.group_id} is {rec.phase.value} stamped {rec.target_step}",
                _NEWER,
            )


def check_single_owner(loc: str, manifest: Manifest, docs: CutDocuments) -> None:
    """``single_owner``: every group has one owner; loader-order numbers are unique and issued."""
    owners: dict[str, str] = {}
    orders: Counter[int] = Counter()
    items: list[tuple[str, str, int]] = [(r.group_id, "ledger", r.order) for r in docs.ledger]
    items += [(g.group_id, "replay buffer", g.order) for g in docs.replay]
    items += [(s.group_id, "spare pool", s.order) for s in docs.spares]
    for gid, owner, order in items:
        if gid in owners:
            raise DoubleOwnerError(
                loc,
                _path_of(manifest, "ledger" if "ledger" in (owner, owners[gid]) else "replay_index"),
                f"group {gid} is owned by both the {owners[gid]} and the {owner}",
                "the cut is inconsistent; restore from an older cut",
            )
        owners[gid] = owner
        orders[order] += 1
        if order >= docs.next_order:
            raise DoubleOwnerError(
                loc,
                _path_of(manifest, "sampler"),
                f"group {gid} has loader order {order} but the sampler has issued only {docs.next_order}",
                _NEWER,
            )
    dup = [o for o, n in orders.items() if n > 1]
    if dup:
        raise DoubleOwnerError(loc, _path_of(manifest, "ledger"), f"loader order {dup[0]} names two groups", _NEWER)


def check_rollout_rows(loc: str, manifest: Manifest, docs: CutDocuments) -> None:
    """``rollout_rows``: finished groups have all their rows; partial rows belong to ADMITTED groups."""
    path = _path_of(manifest, "rollouts")
    ledger = {r.group_id: r for r in docs.ledger}
    replay = {g.group_id: g for g in docs.replay}
    for gid, rows in docs.rollouts.items():
        if gid in replay:
            if len(rows) != replay[gid].rollouts or len(rows) != docs.config.group_size:
                raise RolloutRowsError(
                    loc,
                    path,
                    f"finished group {gid} has {len(rows)} rows; the index says {replay[gid].rollouts} "
                    f"and the group size is {docs.config.group_size}",
                    _NEWER,
                )
        elif gid in ledger:
            rec = ledger[gid]
            if rec.phase is not Phase.ADMITTED or len(rows) >= rec.expected_generations:
                raise RolloutRowsError(
                    loc, path, f"ledger group {gid} ({rec.phase.value}) has {len(rows)} finished rows", _NEWER
                )
        else:
            raise RolloutRowsError(loc, path, f"rows of group {gid}, which no owner holds", _NEWER)
        if len({r.index for r in rows}) != len(rows) or any(not 0 <= r.index < docs.config.group_size for r in rows):
            raise RolloutRowsError(loc, path, f"group {gid} has duplicate or out-of-range rollout indexes", _NEWER)
    missing = [gid for gid in replay if gid not in docs.rollouts]
    if missing:
        raise RolloutRowsError(loc, path, f"finished group {missing[0]} has no rows", _NEWER)


def check_stamps(loc: str, manifest: Manifest, docs: CutDocuments) -> None:
    """``cursor_covers_stamps`` and ``stamp_not_trained``: every stamp in [trainer_step, cursor]."""
    stamps: list[tuple[str, int, str]] = [
        (r.group_id, r.target_step, "ledger") for r in docs.ledger if r.target_step is not None
    ]
    stamps += [(g.group_id, g.target_step, "replay_index") for g in docs.replay]
    stamps += [(f"shortfall of step {s}", s, "sampler") for s in docs.shortfall]
    if manifest.dispatch_index != docs.dispatch_index or manifest.trainer_step != docs.trainer_step:
        raise CursorBehindStampError(
            loc,
            _path_of(manifest, "sampler"),
            f"sampler.json has cursor {docs.dispatch_index} and trainer step {docs.trainer_step}, the manifest "
            f"{manifest.dispatch_index} and {manifest.trainer_step}",
            _NEWER,
        )
    for gid, stamp, role in stamps:
        if stamp > docs.dispatch_index:
            raise CursorBehindStampError(
                loc,
                _path_of(manifest, role),
                f"{gid} is stamped {stamp}, above the saved sampler cursor {docs.dispatch_index}; re-admitting "
                "would stamp a new batch into a step that already has groups",
                _NEWER,
            )
        if stamp < docs.trainer_step:
            raise TrainedStampError(
                loc,
                _path_of(manifest, role),
                f"{gid} is stamped {stamp}, but steps below {docs.trainer_step} are already trained",
                _NEWER,
            )


def check_prompts(loc: str, manifest: Manifest, docs: CutDocuments, lookup: PromptLookup) -> dict[str, Prompt]:
    """``dataset_size``, ``prompt_rebuild``, ``prompt_fingerprint``: every prompt rebuilds from ``dataset[idx]``."""
    size = manifest.dataset.get("size")
    uri = manifest.dataset.get("uri", "the dataset")
    if size is not None and size != len(lookup):
        raise DatasetSizeError(
            loc,
            MANIFEST_NAME,
            f"{uri} had {size} rows when the cut was taken and has {len(lookup)} now; the loader's saved "
            "position and every locator would name other rows",
            "restore with the dataset the run started with",
        )
    locators: list[tuple[str, int, str, str, str]] = [
        (r.group_id, r.idx, r.task_name, r.fingerprint, "ledger") for r in docs.ledger
    ]
    locators += [(s.group_id, s.idx, s.task_name, s.fingerprint, "spare_pool") for s in docs.spares]
    locators += [(g.group_id, g.idx, g.task_name, g.fingerprint, "replay_index") for g in docs.replay]
    prompts: dict[str, Prompt] = {}
    todo = "restore with the dataset the run started with (rows must keep their idx)"
    for gid, idx, task, fingerprint, role in locators:
        path = _path_of(manifest, role)
        try:
            prompt = lookup.rebuild(idx)
        except (IndexError, KeyError) as err:
            raise PromptRebuildError(loc, path, f"group {gid}: idx {idx} is not in {uri} ({err})", todo) from None
        except Exception as err:
            raise PromptRebuildError(
                loc, path, f"group {gid}: row {idx} of {uri} does not rebuild ({err})", todo
            ) from None
        if prompt.idx != idx or prompt.task_name != task:
            raise PromptRebuildError(
                loc,
                path,
                f"group {gid}: row {idx} of {uri} rebuilds as (idx {prompt.idx}, task {prompt.task_name!r}), "
                f"the cut has (idx {idx}, task {task!r}): the dataset was reordered or changed",
                todo,
            )
        if fingerprint and prompt.fingerprint != fingerprint:
            raise PromptFingerprintError(
                loc,
                path,
                f"group {gid}: row {idx} of {uri} has other content than when it was dispatched "
                f"(fingerprint {prompt.fingerprint[:12]}… vs {fingerprint[:12]}…)",
                todo,
            )
        prompts[gid] = prompt
    return prompts


def _path_of(manifest: Manifest, role: str) -> str:
    f = manifest.file(role)
    return f.path if f is not None else role
