"""The validation chain: every check a cut must pass before anything is redispatched.

Restore and ``spotrl ckpt verify`` run this one chain. Each check is a hard error with
its own class and name, saying which file or record failed, why, and what to do. The
chain stops at the first failure: later checks read what earlier ones vouched for.

The chain is pure logic: it reads the cut through :class:`CutSource` (the storage side
hashes and reads files) and the dataset through :class:`PromptLookup`.

In order (``CHECKS``, from :data:`ERRORS`): each check's error class says in its docstring what
it refuses; ``docs/reference/validation-checks.md`` is generated from them.

``delta_base`` reads another cut: the caller opens the base's folder for :func:`validate_base`
(restore, verify and the resume's precheck do); ``redo_fingerprint`` runs when the trainer
redoes the steps (resume).

``rollout_prompt_tokens`` needs the policy's tokenizer, so it runs in restore (the
controller passes ``encode``); ``spotrl ckpt verify`` lists it as not run. The checks
from ``one_config`` on hold between owners: a cut whose every file matches its digest
can still be wrong between them (a writer bug, or an edit with the digests recomputed).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol

from spotrl_runtime.core.cut_format import (
    DELTA_FILES,
    MANIFEST_NAME,
    OWNER_AND_EPISODE_FILES,
    READABLE_SCHEMA_VERSIONS,
    TORCH_SAVE_FORMAT,
    TORCH_SAVE_ROLES,
    TRAINER_FORMAT_ROLES,
    CutDocuments,
    Manifest,
    OwnerFileError,
    decode_delta_files,
    decode_owner_files,
    document_counts,
    loader_position,
    weight_part_index,
)
from spotrl_runtime.core.fields import RecordFormatError
from spotrl_runtime.core.ledger import LedgerRecord, Phase
from spotrl_runtime.core.owners import RecoveryConfig
from spotrl_runtime.core.types import Prompt

CUTS_FOLDER = "cuts"
DCP_FORMAT = "dcp/v1"
"""The trainer format of a sharded cut: ``torch.distributed.checkpoint`` files under ``trainer/dcp/``."""
SHARD_ROLE = "trainer-shard"
"""Role of a file one rank of a trainer group wrote (``trainer/dcp/__<rank>_<n>.distcp``)."""
INDEX_ROLE = "trainer-shard-index"
"""Role of a sharded cut's one index file, ``trainer/dcp/.metadata`` (which shard holds what)."""
DCP_INDEX = "trainer/dcp/.metadata"
"""The index's path inside the cut's data folder."""
TRAINER_FORMATS: dict[str, tuple[str, ...]] = {**TRAINER_FORMAT_ROLES, DCP_FORMAT: ("trainer_meta",)}
"""Every trainer format the chain reads -> the roles it must list (``dcp/v1``'s index and shards
are counted by :func:`check_trainer_shards`)."""

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
    """Refuses a cut without a manifest: never committed."""

    check = "manifest_present"


class ManifestFormatError(CutCheckError):
    """Refuses a manifest that is not JSON, lacks fields or has one of another type (``created_at``
    not RFC 3339)."""

    check = "manifest_parses"


class SchemaVersionError(CutCheckError):
    """Refuses a cut in a format this code does not read (``READABLE_SCHEMA_VERSIONS``)."""

    check = "schema_version"


class ForeignCutError(CutCheckError):
    """Refuses a cut of another job."""

    check = "job_identity"


class ConfigMismatchError(CutCheckError):
    """Refuses another group size or prompts per step than the job's."""

    check = "config_compatible"


class FileMissingError(CutCheckError):
    """Refuses a listed file that is missing."""

    check = "file_present"


class FileSizeError(CutCheckError):
    """Refuses a listed file of another size (truncated, torn)."""

    check = "file_size"


class FileDigestError(CutCheckError):
    """Refuses a listed file with another sha256 (stale, corrupted)."""

    check = "file_digest"


class OrphanFileError(CutCheckError):
    """Refuses a file in the cut's folder that the manifest does not list."""

    check = "orphan_file"


class OwnerFileFormatError(CutCheckError):
    """Refuses an owner file that does not decode."""

    check = "owner_file_format"


class OneConfigError(CutCheckError):
    """Refuses two copies of the recovery config that differ, types included (restore uses the
    checked one)."""

    check = "one_config"


class CountersError(CutCheckError):
    """Refuses an admission, spare-batch or group id the counters never handed out; more admission
    ids than the orders can have used."""

    check = "counters"


class GateError(CutCheckError):
    """Refuses a cursor outside ``[trainer_step - 1, trainer_step + lookahead]``."""

    check = "gate"


class CoverageError(CutCheckError):
    """Refuses an order in ``[0, next_order)`` with no owner or two (live, trained, dropped)."""

    check = "coverage"


class CensusError(CutCheckError):
    """Refuses a step without ``B - shortfall`` groups (finished + in flight); a partial RESERVED
    batch."""

    check = "census"


class FingerprintsUniformError(CutCheckError):
    """Refuses some groups with a content fingerprint and some without."""

    check = "fingerprints_uniform"


class TrainerStateError(CutCheckError):
    """Refuses trainer files missing or unloadable, or under a role the format does not load (the
    optimizer or RNG would be left out); weights parts missing, extra or miscounted, or two
    holding one tensor; a trainer or audit step that disagrees."""

    check = "trainer_state"


class PolicyIdentityError(CutCheckError):
    """Refuses a LoRA adapter trained on another base (its digest), or with another rank, alpha or
    target modules than the job's ``policy.lora``; an adapter where the job trains every weight,
    or the reverse."""

    check = "policy_identity"


class LoaderPositionError(CutCheckError):
    """Refuses a loader position other than the rows handed out; a loader state that would not
    resume there (a finished pass, counts that are no integers); another shuffle or seed than the
    job's."""

    check = "loader_position"


class LoaderRowsError(CutCheckError):
    """Refuses a group whose ``idx`` is not the row the loader reads at its order."""

    check = "loader_rows"


class PromptTokensError(CutCheckError):
    """Refuses finished rows whose prompt tokens do not encode their prompt (restore only: it needs
    the tokenizer)."""

    check = "rollout_prompt_tokens"


class GroupCountError(CutCheckError):
    """Refuses manifest counts that differ from the files."""

    check = "group_counts"


class LedgerRecordError(CutCheckError):
    """Refuses a malformed ledger record: ids, phase, stamps as the phase demands."""

    check = "ledger_record"


class AdmissionConsistencyError(CutCheckError):
    """Refuses one admission with two phases or two stamps."""

    check = "admission_consistent"


class DoubleOwnerError(CutCheckError):
    """Refuses a group owned twice (ledger, replay buffer, spare pool)."""

    check = "single_owner"


class RolloutRowsError(CutCheckError):
    """Refuses a finished group without all G rows; rows of no group; an unfinished episode's
    turns that belong to no ADMITTED group's missing rollout, or to one twice."""

    check = "rollout_rows"


class CursorBehindStampError(CutCheckError):
    """Refuses a stamp above the sampler cursor."""

    check = "cursor_covers_stamps"


class TrainedStampError(CutCheckError):
    """Refuses a stamp below the trainer step."""

    check = "stamp_not_trained"


class DatasetSizeError(CutCheckError):
    """Refuses a dataset whose length changed."""

    check = "dataset_size"


class PromptRebuildError(CutCheckError):
    """Refuses a row that no longer rebuilds with the same ``idx`` and ``task_name``."""

    check = "prompt_rebuild"


class PromptFingerprintError(CutCheckError):
    """Refuses a row whose content changed under the same ``idx``."""

    check = "prompt_fingerprint"


class RedoStepsError(CutCheckError):
    """Refuses a delta whose redo steps are not each step from its base's to its own."""

    check = "redo_steps"


class RedoRowsError(CutCheckError):
    """Refuses a redo group without its rows, rows of no redo group, a group redone at another step
    than its stamp or not retired."""

    check = "redo_rows"


class RedoAuditError(CutCheckError):
    """Refuses a redo step whose groups are not the ones (or not in the order) the audit says it
    trained."""

    check = "redo_audit"


class DeltaBaseError(CutCheckError):
    """Refuses a delta whose base is gone, has another manifest digest, job or step, is a delta, or
    fails its own chain."""

    check = "delta_base"


class RedoFingerprintError(CutCheckError):
    """Refuses a delta's redone step that does not reproduce its recorded fingerprint (resume only:
    it trains)."""

    check = "redo_fingerprint"


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
    OneConfigError,
    LedgerRecordError,
    GroupCountError,
    AdmissionConsistencyError,
    CountersError,
    DoubleOwnerError,
    RolloutRowsError,
    CursorBehindStampError,
    TrainedStampError,
    GateError,
    CoverageError,
    CensusError,
    FingerprintsUniformError,
    TrainerStateError,
    PolicyIdentityError,
    RedoStepsError,
    RedoRowsError,
    RedoAuditError,
    DeltaBaseError,
    LoaderPositionError,
    DatasetSizeError,
    LoaderRowsError,
    PromptRebuildError,
    PromptFingerprintError,
    PromptTokensError,
    RedoFingerprintError,
)
CHECKS: tuple[str, ...] = tuple(e.check for e in ERRORS)
"""Every check, in the order the chain runs them."""
DELTA_CHECKS: frozenset[str] = frozenset({"redo_steps", "redo_rows", "redo_audit", "delta_base"})
"""Checks only a delta cut has to pass (``redo_fingerprint`` too, when it is redone)."""
BYTE_LEVEL_CHECKS: frozenset[str] = frozenset({"manifest_parses", "file_present", "file_size", "file_digest"})
"""Checks that catch damaged or missing bytes (a flaky disk or store, a torn copy), not a cut
that is wrong in what it says: ``--resume auto`` may fall back past a cut failing one of these."""


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

    def epoch_order(self, epoch: int, *, shuffle: bool, seed: int) -> Sequence[int]:
        """The rows the loader visits in ``epoch``, in order (for check ``loader_rows``)."""
        ...


@dataclass(frozen=True)
class Expectations:
    """What the caller knows the cut must match (restore passes these; verify may)."""

    job: str | None = None
    config: RecoveryConfig | None = None
    dataset: Mapping[str, object] | None = None
    """The job's dataset as ``describe_dataset`` gives it: the cut's shuffle and seed must equal its."""
    policy: PolicyExpectation | None = None
    """What the job trains (``policy_identity``); None: not checked."""


@dataclass(frozen=True)
class PolicyExpectation:
    """What the job trains: every weight (``adapter`` None), or the LoRA adapter of this identity
    (:class:`~spotrl_runtime.models.lora.AdapterIdentity`'s JSON: base, rank, alpha, targets)."""

    adapter: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class ValidatedCut:
    """A cut that passed every check: its manifest, decoded owners and rebuilt prompts."""

    manifest: Manifest
    documents: CutDocuments
    prompts: Mapping[str, Prompt]
    checks: tuple[str, ...] = CHECKS
    """The checks that ran (those needing an expectation or the dataset run only when given one)."""


# ------------------------------------------------------------------------ chain


DATASET_CHECKS = ("dataset_size", "loader_rows", "prompt_rebuild", "prompt_fingerprint")


def validate_cut(
    source: CutSource,
    lookup: PromptLookup | None,
    expect: Expectations | None = None,
    encode: Callable[[Prompt], Sequence[int]] | None = None,
    *,
    trainer_digests: bool = True,
) -> ValidatedCut:
    """Runs the whole chain on one cut; raises the first :class:`CutCheckError`.

    ``lookup`` None runs every check except the dataset ones (:data:`DATASET_CHECKS`) and
    returns no prompts; restore always passes one. ``encode`` (a prompt's token ids, as
    generation encodes it) runs ``rollout_prompt_tokens``; restore passes it.
    ``trainer_digests`` False leaves out the digests of the trainer's bulk files (weights,
    optimizer, shards: gigabytes at scale; their sizes are still checked): what a resume's
    precheck runs before anything starts, the restore then running the whole chain.
    """
    expect = expect or Expectations()
    loc = source.location
    manifest = check_manifest(loc, source.read_manifest())
    check_expectations(loc, manifest, expect)
    check_files(loc, manifest, source, trainer_digests=trainer_digests)
    blobs = {f.role: source.read(f.path) for f in manifest.files if f.role in OWNER_AND_EPISODE_FILES}
    docs = decode_documents(loc, manifest, blobs)
    if manifest.is_delta:
        redo_blobs = {f.role: source.read(f.path) for f in manifest.files if f.role in DELTA_FILES}
        docs = decode_redo(loc, manifest, docs, redo_blobs)
    check_one_config(loc, manifest, docs)
    docs = check_ledger_records(loc, manifest, docs)
    check_group_counts(loc, manifest, docs)
    check_admissions(loc, manifest, docs)
    check_counters(loc, manifest, docs)
    check_single_owner(loc, manifest, docs)
    check_rollout_rows(loc, manifest, docs)
    check_stamps(loc, manifest, docs)
    check_gate(loc, manifest, docs)
    check_coverage(loc, manifest, docs)
    check_census(loc, manifest, docs)
    check_fingerprints_uniform(loc, manifest, docs)
    meta = check_trainer_state(loc, manifest, docs, source)
    check_policy_identity(loc, manifest, meta, expect.policy)
    check_redo(loc, manifest, docs)
    check_loader_position(loc, manifest, docs, expect)
    skipped = {"job_identity"} if expect.job is None else set()
    # Run by the storage side (another cut) and by the redo itself.
    skipped |= {"delta_base", "redo_fingerprint"}
    if not manifest.is_delta:
        skipped |= DELTA_CHECKS
    skipped |= {"config_compatible"} if expect.config is None else set()
    skipped |= {"policy_identity"} if expect.policy is None or manifest.trainer_format is None else set()
    prompts: dict[str, Prompt] = {}
    if lookup is None:
        skipped |= set(DATASET_CHECKS)
    else:
        prompts = check_prompts(loc, manifest, docs, lookup)
    if encode is None or lookup is None:
        skipped.add("rollout_prompt_tokens")
    else:
        check_prompt_tokens(loc, manifest, docs, prompts, encode)
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


def check_files(loc: str, manifest: Manifest, source: CutSource, *, trainer_digests: bool = True) -> None:
    """``file_present``, ``file_size``, ``file_digest``, ``orphan_file``; ``trainer_digests``
    False: no digest of the files under the data folder's ``trainer/`` but its ``meta.json``."""
    for f in manifest.files:
        size = source.size(f.path)
        if size is None:
            raise FileMissingError(loc, f.path, f"listed in the manifest ({f.role}) but missing", _NEWER)
        if size != f.size:
            raise FileSizeError(loc, f.path, f"is {size} bytes, the manifest says {f.size} (truncated or torn)", _NEWER)
    bulk = f"{manifest.data_dir}/trainer/"
    for f in manifest.files:
        if not trainer_digests and f.path.startswith(bulk) and f.role != "trainer_meta":
            continue
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


def decode_redo(loc: str, manifest: Manifest, docs: CutDocuments, blobs: Mapping[str, bytes]) -> CutDocuments:
    """``owner_file_format`` for a delta cut's redo files."""
    try:
        return decode_delta_files(docs, blobs)
    except OwnerFileError as err:
        raise OwnerFileFormatError(loc, _path_of(manifest, err.role), str(err), _NEWER) from None


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
    """``single_owner``: every group has one owner; no loader order names two groups."""
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
    check_episodes(loc, manifest, docs)


def check_episodes(loc: str, manifest: Manifest, docs: CutDocuments) -> None:
    """Part of ``rollout_rows``: each unfinished episode is a missing rollout of an ADMITTED
    group, once."""
    path = _path_of(manifest, "episodes")
    ledger = {r.group_id: r for r in docs.ledger}
    seen: set[tuple[str, int]] = set()
    for e in docs.episodes:
        rec = ledger.get(e.group_id)
        finished = {r.index for r in docs.rollouts.get(e.group_id, ())}
        if rec is None or rec.phase is not Phase.ADMITTED:
            raise RolloutRowsError(loc, path, f"episode {e.group_id}/{e.index}: no ADMITTED group holds it", _NEWER)
        if not 0 <= e.index < rec.expected_generations or e.index in finished or (e.group_id, e.index) in seen:
            raise RolloutRowsError(
                loc,
                path,
                f"episode {e.group_id}/{e.index} is not one of the group's missing rollouts, or is listed twice",
                _NEWER,
            )
        seen.add((e.group_id, e.index))


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


def check_one_config(loc: str, manifest: Manifest, docs: CutDocuments) -> None:
    """``one_config``: the manifest's copy of the recovery config equals ``sampler.json``'s, the
    one restore uses, as JSON: types included (``true`` is not ``1``, nor ``2.0`` ``2``)."""

    def same(a: object, b: object) -> bool:
        return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)

    if not same(dict(manifest.config), dict(docs.config_raw)):
        keys = sorted(set(manifest.config) | set(docs.config_raw))
        diff = [k for k in keys if not same(manifest.config.get(k), docs.config_raw.get(k))]
        raise OneConfigError(
            loc,
            _path_of(manifest, "sampler"),
            "the recovery config differs between manifest.json and sampler.json: "
            + ", ".join(f"{k} is {manifest.config.get(k)!r} vs {docs.config_raw.get(k)!r}" for k in diff),
            _NEWER,
        )


def _serial(value: str, prefix: str) -> int | None:
    """``n`` of an id ``<prefix><n>`` (no leading zeros), or None."""
    digits = value[len(prefix) :]
    if not value.startswith(prefix) or not digits.isdigit() or (digits != "0" and digits.startswith("0")):
        return None
    return int(digits)


def _trained_groups(docs: CutDocuments) -> Iterator[tuple[str, int, int, str]]:
    """(group_id, idx, step, what) of every group the audit tail trained or any record dropped."""
    for rec in docs.audit_tail:
        for gid, idx in zip(rec.group_ids, rec.idxs, strict=True):
            yield gid, idx, rec.step, "trained"
        for d in rec.dropped:
            yield d.group_id, d.idx, rec.step, "dropped"
    for step, dropped in docs.dropped.items():
        for d in dropped:
            yield d.group_id, d.idx, step, "dropped"


def check_counters(loc: str, manifest: Manifest, docs: CutDocuments) -> None:
    """``counters``: every admission and spare-batch id is ``a<n>`` with n below ``next_admission``;
    every group id is ``g<order>`` with its own order, below ``next_order``; ``next_admission`` is
    no more than the orders can have used."""
    ids: list[tuple[str, str, int | None, str]] = [(r.group_id, r.admission_id, r.order, "ledger") for r in docs.ledger]
    ids += [(g.group_id, g.admission_id, g.order, "replay_index") for g in docs.replay]
    ids += [(sp.group_id, sp.batch_id, sp.order, "spare_pool") for sp in docs.spares]
    ids += [(gid, "", None, "audit" if what == "trained" else "sampler") for gid, _, _, what in _trained_groups(docs)]
    for gid, admission, order, role in ids:
        n = _serial(gid, "g")
        if n is None or n >= docs.next_order or (order is not None and n != order):
            raise CountersError(
                loc,
                _path_of(manifest, role),
                f"group id {gid!r}" + (f" with order {order}" if order is not None else "") + " was never handed "
                f"out: group ids are g<order> with order below next_order {docs.next_order}",
                _NEWER,
            )
        a = _serial(admission, "a") if admission else 0
        if a is None or a >= docs.next_admission:
            raise CountersError(
                loc,
                _path_of(manifest, role),
                f"group {gid} names admission {admission!r}, which was never handed out: admission and "
                f"spare-batch ids are a<n> with n below next_admission {docs.next_admission}",
                _NEWER,
            )
    # One admission id per batch the loader read, and one per spare that replaced a dropped group.
    batches = docs.next_order // docs.config.prompts_per_step
    if docs.next_admission > batches + docs.next_order:
        raise CountersError(
            loc,
            _path_of(manifest, "sampler"),
            f"next_admission is {docs.next_admission}, more admission ids than {docs.next_order} orders can have "
            f"used: one per batch the loader read ({batches}) and one per spare that replaced a dropped group "
            f"(at most one per order)",
            _NEWER,
        )


def check_gate(loc: str, manifest: Manifest, docs: CutDocuments) -> None:
    """``gate``: ``trainer_step - 1 <= cursor <= trainer_step + lookahead``."""
    low, high = docs.trainer_step - 1, docs.trainer_step + docs.config.lookahead
    if not low <= docs.dispatch_index <= high:
        raise GateError(
            loc,
            _path_of(manifest, "sampler"),
            f"the sampler cursor is {docs.dispatch_index}, outside [{low}, {high}] (trainer step "
            f"{docs.trainer_step}, lookahead {docs.config.lookahead}): the gate admits only that far",
            _NEWER,
        )


def check_coverage(loc: str, manifest: Manifest, docs: CutDocuments) -> None:
    """``coverage``: every order in ``[0, next_order)`` is owned exactly once: by the ledger, the
    replay buffer or the spare pool, or retired (trained or dropped); the audit tail's groups and
    every dropped group are retired."""
    live: dict[int, tuple[str, str]] = {r.order: (r.group_id, "ledger") for r in docs.ledger}
    live |= {g.order: (g.group_id, "replay buffer") for g in docs.replay}
    live |= {sp.order: (sp.group_id, "spare pool") for sp in docs.spares}
    sampler = _path_of(manifest, "sampler")
    for order, (gid, owner) in sorted(live.items()):
        if order in docs.retired:
            raise CoverageError(
                loc, sampler, f"order {order} ({gid}) is owned by the {owner} and also retired (trained or dropped)"
            )
    top = max((end for _, end in docs.retired.intervals()), default=0)
    if top > docs.next_order:
        raise CoverageError(loc, sampler, f"orders up to {top - 1} are retired, but only {docs.next_order} were issued")
    if len(live) + len(docs.retired) != docs.next_order:
        missing = next(o for o in range(docs.next_order) if o not in live and o not in docs.retired)
        raise CoverageError(
            loc,
            sampler,
            f"order {missing} (group g{missing}) has no owner: it left the loader but is in no ledger, replay "
            "buffer, spare pool or retired set, so a restore would lose its prompt",
            _NEWER,
        )
    seen: set[str] = set()
    for gid, _, step, what in _trained_groups(docs):
        retired = _serial(gid, "g")
        assert retired is not None  # check counters
        if retired in live:
            raise CoverageError(
                loc, sampler, f"{gid} was {what} at step {step} but the {live[retired][1]} still owns it", _NEWER
            )
        if retired not in docs.retired or gid in seen:
            why = "appears twice among the trained and dropped groups" if gid in seen else "is not retired"
            raise CoverageError(loc, sampler, f"{gid}, {what} at step {step}, {why}", _NEWER)
        seen.add(gid)


def check_census(loc: str, manifest: Manifest, docs: CutDocuments) -> None:
    """``census``: each step from the trainer step to the cursor holds ``B - shortfall`` groups
    (finished + ADMITTED), and each RESERVED admission is one whole batch of ``B``."""
    batch = docs.config.prompts_per_step
    finished = Counter(g.target_step for g in docs.replay)
    admitted = Counter(r.target_step for r in docs.ledger if r.phase is Phase.ADMITTED)
    sampler = _path_of(manifest, "sampler")
    for step in range(docs.trainer_step, docs.dispatch_index + 1):
        short = docs.shortfall.get(step, 0)
        dropped = len(docs.dropped.get(step, ()))
        if not 0 <= short <= dropped:
            raise CensusError(
                loc, sampler, f"step {step} has a shortfall of {short} but {dropped} dropped prompts", _NEWER
            )
        if finished[step] + admitted[step] != batch - short:
            raise CensusError(
                loc,
                _path_of(manifest, "replay_index"),
                f"step {step} holds {finished[step]} finished and {admitted[step]} in-flight groups; with a "
                f"shortfall of {short} it must hold {batch - short} (prompts per step {batch})",
                _NEWER,
            )
    for step in docs.dropped:
        if not docs.trainer_step <= step <= docs.dispatch_index:
            raise CensusError(
                loc,
                sampler,
                f"prompts dropped at step {step}, outside the untrained steps [{docs.trainer_step}, "
                f"{docs.dispatch_index}]",
                _NEWER,
            )
    reserved = Counter(r.admission_id for r in docs.ledger if r.phase is Phase.RESERVED)
    for admission, count in reserved.items():
        if count != batch:
            raise CensusError(
                loc,
                _path_of(manifest, "ledger"),
                f"RESERVED admission {admission} holds {count} groups; an admission is one whole batch of {batch}",
                _NEWER,
            )


def check_fingerprints_uniform(loc: str, manifest: Manifest, docs: CutDocuments) -> None:
    """``fingerprints_uniform``: every group carries a content fingerprint, or none does."""
    groups = [(r.group_id, r.fingerprint, "ledger") for r in docs.ledger]
    groups += [(g.group_id, g.fingerprint, "replay_index") for g in docs.replay]
    groups += [(sp.group_id, sp.fingerprint, "spare_pool") for sp in docs.spares]
    with_fp = [g for g in groups if g[1]]
    without = [g for g in groups if not g[1]]
    if with_fp and without:
        raise FingerprintsUniformError(
            loc,
            _path_of(manifest, without[0][2]),
            f"{len(with_fp)} groups carry a content fingerprint but {len(without)} do not (first: {without[0][0]}); "
            "a writer records one for every group or for none, so this one was edited",
            _NEWER,
        )


def check_trainer_state(
    loc: str, manifest: Manifest, docs: CutDocuments, source: CutSource
) -> Mapping[str, Any] | None:
    """``trainer_state``: the files ``trainer_format`` needs are listed (under the data folder's
    ``trainer/``), each under a role the format loads, and the trainer's step, the audit tail's
    last step and ``trainer_step`` agree. Returns the trainer's ``meta.json`` (None: no trainer state)."""
    fmt = manifest.trainer_format
    meta: Mapping[str, Any] | None = None
    if fmt is not None and fmt not in TRAINER_FORMATS:
        raise TrainerStateError(
            loc, MANIFEST_NAME, f"trainer_format {fmt!r} is not one this code reads ({list(TRAINER_FORMATS)})"
        )
    check_trainer_roles(loc, manifest)
    if fmt is not None:
        for role in TRAINER_FORMATS[fmt]:
            f = manifest.file(role)
            if f is None or not f.path.startswith(f"{manifest.data_dir}/trainer/"):
                raise TrainerStateError(
                    loc, MANIFEST_NAME, f"format {fmt} needs a {role} file under trainer/, the manifest lists none"
                )
        if fmt == DCP_FORMAT:
            check_trainer_shards(loc, manifest)
        if fmt == TORCH_SAVE_FORMAT:
            check_weight_parts(loc, manifest)
        meta_file = manifest.file("trainer_meta")
        assert meta_file is not None
        try:
            doc = json.loads(source.read(meta_file.path))
            step = doc["trainer_step"]
            if not isinstance(step, int) or isinstance(step, bool):
                raise TypeError(f"trainer_step is {step!r}")
        except (ValueError, UnicodeDecodeError, KeyError, TypeError) as err:
            raise TrainerStateError(
                loc, meta_file.path, f"is not a JSON object with an integer trainer_step ({err})", _NEWER
            ) from None
        if step != manifest.trainer_step:
            raise TrainerStateError(
                loc,
                meta_file.path,
                f"the trainer's state is at step {step}, the cut at trainer step {manifest.trainer_step}",
                _NEWER,
            )
        meta = doc
    tail = docs.audit_tail
    steps = [r.step for r in tail]
    if tail and (steps[-1] != docs.trainer_step - 1 or steps != list(range(steps[0], steps[-1] + 1))):
        raise TrainerStateError(
            loc,
            _path_of(manifest, "audit"),
            f"the audit tail holds steps {steps[0]}..{steps[-1]} ({len(steps)} records), not consecutive steps "
            f"ending at {docs.trainer_step - 1} (trainer step {docs.trainer_step})",
            _NEWER,
        )
    if not tail and docs.trainer_step > 0 and docs.config.audit_tail > 0:
        raise TrainerStateError(
            loc, _path_of(manifest, "audit"), f"no audit record, but {docs.trainer_step} steps are trained", _NEWER
        )
    return meta


_ADAPTER_FIELDS = (("base", "policy.model's base"), ("rank", "policy.lora.rank"), ("alpha", "policy.lora.alpha"))


def check_policy_identity(
    loc: str, manifest: Manifest, meta: Mapping[str, Any] | None, expect: PolicyExpectation | None
) -> None:
    """``policy_identity``: the cut's trainer state (``meta``, its ``meta.json`` as
    :func:`check_trainer_state` read it) is what the job trains (see :class:`PolicyExpectation`)."""
    meta_file = manifest.file("trainer_meta")
    if expect is None or meta is None or meta_file is None:
        return
    saved = meta.get("adapter")
    wanted = expect.adapter
    if saved is None and wanted is None:
        return
    todo = "resume with the policy the run was started with, or start a new run on new storage"
    if saved is None or wanted is None:
        held = "a LoRA adapter" if saved is not None else "every weight of the policy"
        trains = "a LoRA adapter (policy.lora is set)" if wanted is not None else "every weight (policy.lora is unset)"
        raise PolicyIdentityError(loc, meta_file.path, f"the cut holds {held}, but the job trains {trains}", todo)
    if not isinstance(saved, dict):
        raise PolicyIdentityError(loc, meta_file.path, f"its adapter identity is {saved!r}, not an object", _NEWER)
    for key, field in _ADAPTER_FIELDS:
        if saved.get(key) != wanted.get(key):
            raise PolicyIdentityError(
                loc,
                meta_file.path,
                f"the cut's adapter has {key} {saved.get(key)!r}, the job's {field} gives {wanted.get(key)!r}",
                todo,
            )
    if list(saved.get("targets") or []) != list(wanted.get("targets") or []):
        raise PolicyIdentityError(
            loc,
            meta_file.path,
            f"the cut's adapter is on {saved.get('targets')}, the job's policy.lora.targetModules give "
            f"{list(wanted.get('targets') or [])}",
            todo,
        )


def check_redo(loc: str, manifest: Manifest, docs: CutDocuments) -> None:
    """``redo_steps``, ``redo_rows``, ``redo_audit`` (a delta cut only): the redo log holds each
    step from the base's trainer step to the cut's, every group with its rows, each group trained
    at its stamp and retired, and each step's groups are the ones its audit record names."""
    if not manifest.is_delta:
        return
    base = manifest.base
    assert base is not None  # manifest_parses
    index_path, rows_path = _path_of(manifest, "redo_index"), _path_of(manifest, "redo_rows")
    steps = [s.step for s in docs.redo_index]
    want = list(range(base.trainer_step, docs.trainer_step))
    if steps != want:
        shown = f"{steps[:5]}{'…' if len(steps) > 5 else ''}"
        raise RedoStepsError(
            loc,
            index_path,
            f"the redo log holds steps {shown}; a delta on cut {base.cut_id} (trainer step {base.trainer_step}) at "
            f"trainer step {docs.trainer_step} must hold each of {base.trainer_step}..{docs.trainer_step - 1} "
            "once, in order",
            _NEWER,
        )
    listed: dict[str, int] = {}
    for s in docs.redo_index:
        for g in s.groups:
            if g.group_id in listed:
                raise RedoRowsError(
                    loc,
                    index_path,
                    f"group {g.group_id} is listed twice (steps {listed[g.group_id]} and {s.step})",
                    _NEWER,
                )
            listed[g.group_id] = s.step
            if g.target_step != s.step:
                raise RedoRowsError(
                    loc,
                    index_path,
                    f"group {g.group_id} is stamped for step {g.target_step} but redone at step {s.step}",
                    _NEWER,
                )
            if g.order not in docs.retired:
                raise RedoRowsError(
                    loc,
                    index_path,
                    f"group {g.group_id} (order {g.order}) is redone at step {s.step}, but the sampler does not "
                    "retire its order (it would be trained twice)",
                    _NEWER,
                )
            rows = docs.redo_rollouts.get(g.group_id, ())
            if len(rows) != g.rollouts or [r.index for r in rows] != list(range(g.rollouts)):
                raise RedoRowsError(
                    loc,
                    rows_path,
                    f"group {g.group_id} of redo step {s.step} has rows {[r.index for r in rows]}, the index says "
                    f"{g.rollouts} (0..{g.rollouts - 1})",
                    _NEWER,
                )
    stray = sorted(set(docs.redo_rollouts) - set(listed))
    if stray:
        raise RedoRowsError(loc, rows_path, f"rows of groups no redo step lists: {stray[:5]}", _NEWER)
    audit = {r.step: r for r in docs.audit_tail}
    for s in docs.redo_index:
        rec = audit.get(s.step)
        if rec is None:
            raise RedoAuditError(
                loc,
                _path_of(manifest, "audit"),
                f"no audit record of redo step {s.step} in the cut's audit tail (it holds "
                f"{min(audit, default=None)}..{max(audit, default=None)}); raise recovery's audit tail above "
                "checkpoint.everySteps",
                _NEWER,
            )
        got = [(g.group_id, g.idx, g.task_name) for g in s.groups]
        said = list(zip(rec.group_ids, rec.idxs, rec.task_names, strict=True))
        if got != said:
            raise RedoAuditError(
                loc,
                index_path,
                f"redo step {s.step} trains groups {[g for g, _, _ in got][:6]}, the audit says step {s.step} trained "
                f"{[g for g, _, _ in said][:6]} (or other rows, or in another order)",
                _NEWER,
            )


def check_delta_base(loc: str, manifest: Manifest, base_raw: bytes | None, base_digest: str | None) -> Manifest:
    """``delta_base``, the pure half: the base's manifest exists, has the digest the delta recorded,
    parses, is a full cut of the same job at the recorded trainer step. Returns the base's manifest;
    the caller then runs the base through the whole chain (a refusal there is ``delta_base`` too)."""
    base = manifest.base
    assert base is not None
    where = f"{CUTS_FOLDER}/{base.cut_id}/{MANIFEST_NAME}"
    todo = "restore from an older full cut with --resume CUT (spotrl ckpt list shows each delta's base)"
    if base_raw is None:
        raise DeltaBaseError(loc, MANIFEST_NAME, f"its base cut {base.cut_id} is gone ({where} does not exist)", todo)
    if base_digest != base.manifest_sha256:
        raise DeltaBaseError(
            loc,
            MANIFEST_NAME,
            f"its base cut {base.cut_id} has manifest sha256 {str(base_digest)[:16]}…, the delta recorded "
            f"{base.manifest_sha256[:16]}… (another cut now has that id)",
            todo,
        )
    try:
        parsed = check_manifest(f"{loc}/../{base.cut_id}", base_raw)
    except CutCheckError as err:
        raise DeltaBaseError(loc, MANIFEST_NAME, f"its base cut {base.cut_id} is refused: {err}", todo) from None
    if parsed.is_delta:
        raise DeltaBaseError(loc, MANIFEST_NAME, f"its base cut {base.cut_id} is a delta too, not a full cut", todo)
    if parsed.job != manifest.job:
        raise DeltaBaseError(
            loc,
            MANIFEST_NAME,
            f"its base cut {base.cut_id} belongs to job {parsed.job!r}, the delta to {manifest.job!r}",
            todo,
        )
    if parsed.trainer_step != base.trainer_step:
        raise DeltaBaseError(
            loc,
            MANIFEST_NAME,
            f"its base cut {base.cut_id} is at trainer step {parsed.trainer_step}, the delta recorded "
            f"{base.trainer_step}",
            todo,
        )
    return parsed


def validate_base(
    loc: str,
    delta: Manifest,
    source: CutSource,
    lookup: PromptLookup | None,
    expect: Expectations | None,
    *,
    trainer_digests: bool = True,
) -> Manifest:
    """Check ``delta_base`` whole: :func:`check_delta_base` on the base's manifest (``source``, the
    base's folder), then the base through the whole chain (a refusal there names the base's check).
    Returns the base's manifest."""
    raw = source.read_manifest()
    parsed = check_delta_base(loc, delta, raw, hashlib.sha256(raw).hexdigest() if raw is not None else None)
    try:
        validate_cut(source, lookup, expect, trainer_digests=trainer_digests)
    except CutCheckError as err:
        raise DeltaBaseError(
            loc,
            MANIFEST_NAME,
            f"its base cut {parsed.cut_id} is refused by check {err.check}: {err.detail}",
            "restore from an older full cut with --resume CUT (spotrl ckpt list shows each delta's base)",
        ) from None
    return parsed


def check_trainer_roles(loc: str, manifest: Manifest) -> None:
    """``trainer_state``: every file under ``trainer/`` has a role its format loads. ``torch.save``
    loads each file by its role, so one listed under another role would be left out, silently (a
    resume with a fresh optimizer or RNG); a cut without a trainer format has no trainer files.
    ``dcp/v1`` loads every file under ``trainer/`` (:func:`check_trainer_shards`)."""
    fmt = manifest.trainer_format
    if fmt == DCP_FORMAT:
        return
    for f in manifest.files:
        if not f.path.startswith(f"{manifest.data_dir}/trainer/") or (fmt is not None and f.role in TORCH_SAVE_ROLES):
            continue
        if fmt is None:
            why = "is a trainer file, but the manifest names no trainer_format: nothing would load it"
        else:
            why = f"has role {f.role!r}, which {fmt} does not load (it loads {', '.join(TORCH_SAVE_ROLES)})"
        raise TrainerStateError(loc, f.path, why, _NEWER)


def check_weight_parts(loc: str, manifest: Manifest) -> None:
    """``trainer_state`` for a ``torch.save/v2`` cut: its ``weights`` files are parts
    ``trainer/weights-<i>-of-<n>.pt`` of one count, each of 1..n listed once and nothing else
    (a cut that lost or gained a part of its weights is refused here, not half loaded)."""
    prefix = f"{manifest.data_dir}/"
    parts: list[tuple[int, int]] = []
    for f in manifest.files:
        if f.role != "weights":
            continue
        index = weight_part_index(f.path[len(prefix) :]) if f.path.startswith(prefix) else None
        if index is None:
            raise TrainerStateError(
                loc, f.path, f"a weights file of {TORCH_SAVE_FORMAT} is named trainer/weights-<i>-of-<n>.pt", _NEWER
            )
        parts.append(index)
    counts = {n for _, n in parts}
    want = list(range(1, parts[0][1] + 1)) if len(counts) == 1 else []
    if sorted(i for i, _ in parts) != want:
        listed = ", ".join(f"{i}-of-{n}" for i, n in sorted(parts))
        raise TrainerStateError(
            loc, MANIFEST_NAME, f"the weights' parts listed are {listed}: not each of one count, once", _NEWER
        )


def check_trainer_shards(loc: str, manifest: Manifest) -> None:
    """``trainer_state`` for a ``dcp/v1`` cut: exactly one index (``trainer/dcp/.metadata``, role
    ``trainer-shard-index``) and at least one shard, all under ``trainer/dcp/``. Their bytes are
    the per-file checks' business; whether DCP can load them is the restore's."""
    folder = f"{manifest.data_dir}/trainer/dcp/"
    index = f"{manifest.data_dir}/{DCP_INDEX}"
    indexes = [f for f in manifest.files if f.role == INDEX_ROLE]
    shards = [f for f in manifest.files if f.role == SHARD_ROLE]
    todo = "the cut's trainer group did not write all of its shards; restore from an older cut with --resume CUT"
    if len(indexes) != 1 or indexes[0].path != index:
        listed = ", ".join(f.path for f in indexes) or "none"
        raise TrainerStateError(
            loc,
            index,
            f"format {DCP_FORMAT} needs exactly one {INDEX_ROLE} file at {index}; the manifest lists {listed}",
            todo,
        )
    if not shards:
        raise TrainerStateError(
            loc, index, f"format {DCP_FORMAT} needs at least one {SHARD_ROLE} file; the manifest lists none", todo
        )
    for f in shards:
        if not f.path.startswith(folder) or f.path == index:
            raise TrainerStateError(loc, f.path, f"a {SHARD_ROLE} file outside {folder}", _NEWER)


def check_loader_position(loc: str, manifest: Manifest, docs: CutDocuments, expect: Expectations) -> None:
    """``loader_position``: the loader has handed out exactly ``next_order`` rows, in whole batches,
    of a dataset of the manifest's size, walked with the job's shuffle and seed."""
    path = _path_of(manifest, "loader")
    try:
        pos = loader_position(docs.loader_state)
    except ValueError as err:
        raise LoaderPositionError(loc, path, str(err), _NEWER) from None
    size = manifest.dataset.get("size")
    size = pos.size if not isinstance(size, int) else size
    if pos.size is not None and pos.size != size:
        raise LoaderPositionError(
            loc, path, f"the loader state is for {pos.size} rows, the manifest's dataset has {size}", _NEWER
        )
    read = pos.order(size) if isinstance(size, int) else pos.offset
    batch = docs.config.prompts_per_step
    if read != docs.next_order or pos.batches * batch != docs.next_order:
        raise LoaderPositionError(
            loc,
            path,
            f"the loader stands at epoch {pos.epoch} offset {pos.offset} after {pos.batches} batches of {batch} "
            f"({read} rows), but the sampler handed out {docs.next_order} orders",
            _NEWER,
        )
    for key in ("shuffle", "seed"):
        if expect.dataset is not None and manifest.dataset.get(key) != expect.dataset.get(key):
            raise LoaderPositionError(
                loc,
                MANIFEST_NAME,
                f"the cut's loader walks the dataset with {key}={manifest.dataset.get(key)!r}, the job asks for "
                f"{key}={expect.dataset.get(key)!r}: every saved position would name other rows",
                "restore with the dataset settings the run started with",
            )


def check_loader_rows(loc: str, manifest: Manifest, docs: CutDocuments, lookup: PromptLookup) -> None:
    """``loader_rows``: each group's ``idx`` is the row the loader yields at the group's order."""
    shuffle, seed = manifest.dataset.get("shuffle"), manifest.dataset.get("seed")
    if not isinstance(shuffle, bool) or not isinstance(seed, int):
        raise LoaderRowsError(loc, MANIFEST_NAME, f"dataset.shuffle/seed are {shuffle!r}/{seed!r}", _NEWER)
    size = len(lookup)
    epochs: dict[int, Sequence[int]] = {}
    groups = [(r.group_id, r.order, r.idx, "ledger") for r in docs.ledger]
    groups += [(g.group_id, g.order, g.idx, "replay_index") for g in docs.replay]
    groups += [(sp.group_id, sp.order, sp.idx, "spare_pool") for sp in docs.spares]
    groups += [(gid, _serial(gid, "g") or 0, idx, "audit") for gid, idx, _, _ in _trained_groups(docs)]
    for gid, order, idx, role in groups:
        epoch, offset = divmod(order, size)
        if epoch not in epochs:
            epochs[epoch] = lookup.epoch_order(epoch, shuffle=shuffle, seed=seed)
        row = epochs[epoch][offset]
        if row != idx:
            raise LoaderRowsError(
                loc,
                _path_of(manifest, role),
                f"group {gid} has idx {idx}, but the loader yields row {row} at its order {order} "
                f"(epoch {epoch}, shuffle={shuffle}, seed={seed})",
                _NEWER,
            )


def check_prompt_tokens(
    loc: str,
    manifest: Manifest,
    docs: CutDocuments,
    prompts: Mapping[str, Prompt],
    encode: Callable[[Prompt], Sequence[int]],
) -> None:
    """``rollout_prompt_tokens``: every finished rollout row's prompt tokens encode its group's
    rebuilt prompt (the rows would otherwise train one prompt's completions under another)."""
    for gid, rows in [*docs.rollouts.items(), *docs.redo_rollouts.items()]:
        want = tuple(encode(prompts[gid]))
        for row in rows:
            if tuple(row.prompt_token_ids) != want:
                raise PromptTokensError(
                    loc,
                    _path_of(manifest, "rollouts"),
                    f"rollout {row.index} of group {gid} has {len(row.prompt_token_ids)} prompt tokens that do not "
                    f"encode its prompt (row {prompts[gid].idx}, {len(want)} tokens)",
                    _NEWER,
                )


def check_prompts(loc: str, manifest: Manifest, docs: CutDocuments, lookup: PromptLookup) -> dict[str, Prompt]:
    """``dataset_size``, ``loader_rows``, ``prompt_rebuild``, ``prompt_fingerprint``: every prompt
    rebuilds from ``dataset[idx]``, at the row its order reads."""
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
    check_loader_rows(loc, manifest, docs, lookup)
    locators: list[tuple[str, int, str, str, str]] = [
        (r.group_id, r.idx, r.task_name, r.fingerprint, "ledger") for r in docs.ledger
    ]
    locators += [(s.group_id, s.idx, s.task_name, s.fingerprint, "spare_pool") for s in docs.spares]
    locators += [(g.group_id, g.idx, g.task_name, g.fingerprint, "replay_index") for g in docs.replay]
    locators += [
        (g.group_id, g.idx, g.task_name, g.fingerprint, "redo_index") for s in docs.redo_index for g in s.groups
    ]
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
