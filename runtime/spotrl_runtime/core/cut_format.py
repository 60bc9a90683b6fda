"""Schema version 2 of a cut: the manifest and the owner files, as bytes. Pure: no I/O.

A cut is a folder ``cuts/<cut_id>/`` holding ``manifest.json`` (written last; its
existence is the commit) and a data folder ``<writer>/`` with one file per owner:

============================  ==============  =============================================
file                          role            content
============================  ==============  =============================================
``sampler.json``              sampler         cursor, trainer step, id counters, per-step
                                              shortfall and dropped prompts, retired
                                              orders (trained or dropped), config
``loader.json``               loader          the StatefulDataLoader state (its position)
``ledger.json``               ledger          unfinished groups, locators only
``spare_pool.json``           spare_pool      spare prompts, locators only
``replay_index.json``         replay_index    finished groups: locators, stamps, row counts
``rollouts.bin``              rollouts        rollout rows of finished groups and the
                                              finished siblings of ADMITTED groups
``audit.json``                audit           the tail of the audit log
``trainer/*``                 weights, ...    the trainer's state; opaque to this module
                                              except ``trainer/meta.json`` (its step)
``redo.json``                 redo_index      a delta cut's redo steps: groups' locators in
                                              trained order, fingerprints
``redo_rows.bin``             redo_rows       a delta cut's redo rows (the rollout row format)
============================  ==============  =============================================

A cut's ``form`` is ``full`` (the trainer's state is in it) or ``delta``: no trainer state but
the redo log (:mod:`spotrl_runtime.core.redo`) since its ``base``, the full cut it extends
(id, manifest sha256, trainer step). Manifests without ``form`` are full.

Version 2 added ``retired`` to ``sampler.json``; version 1 cuts lack what check
``coverage`` needs and are not read.

``rollouts.bin`` is ``SPOTRLR1`` + u64 little-endian length + a JSON row table, then three
little-endian arrays: prompt token ids (int32), completion token ids (int32) and
log-probabilities (float64, so a restored row is bit-identical). A row of a multi-turn
episode has a tenth column, its observation spans (``[[start, end], ...]`` over the completion);
rows without observations have nine, as before there were episodes.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from array import array
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from spotrl_runtime.core.audit import AuditRecord, DroppedPrompt
from spotrl_runtime.core.fields import RecordFormatError, optional_int, require_int, require_str
from spotrl_runtime.core.ledger import LedgerRecord, Phase
from spotrl_runtime.core.orders import OrderSet
from spotrl_runtime.core.owners import OwnersSnapshot, RecoveryConfig
from spotrl_runtime.core.redo import DeltaBase, RedoStep, StepFingerprint
from spotrl_runtime.core.replay_buffer import ReplayEntry
from spotrl_runtime.core.spare_pool import Spare
from spotrl_runtime.core.types import EpisodeState, FinishedGroup, Prompt, Rollout, check_observed

SCHEMA_VERSION = 2
READABLE_SCHEMA_VERSIONS = (2,)
MANIFEST_NAME = "manifest.json"
CUT_KINDS = ("periodic", "barrier")
"""Why a cut was taken."""
CUT_FORMS = ("full", "delta")
"""What it holds: the trainer's state (full), or the redo log since a full cut (delta)."""

OWNER_FILES: dict[str, str] = {
    "sampler": "sampler.json",
    "loader": "loader.json",
    "ledger": "ledger.json",
    "spare_pool": "spare_pool.json",
    "replay_index": "replay_index.json",
    "rollouts": "rollouts.bin",
    "audit": "audit.json",
}
"""Role -> file name of the owner files every cut has."""

EPISODE_FILES: dict[str, str] = {"episodes": "episodes.json"}
"""Role -> file name of the owner file a cut has when episodes of its ledger groups have finished
turns (multi-turn jobs): a single-turn job's cut is unchanged, and a controller that does not
know the file starts those episodes again (it reads the roles it knows only)."""

OWNER_AND_EPISODE_FILES = OWNER_FILES | EPISODE_FILES
"""Every owner file a cut may have, by role: what a writer names and a reader decodes."""

DELTA_FILES: dict[str, str] = {"redo_index": "redo.json", "redo_rows": "redo_rows.bin"}
"""Role -> file name of the files a delta cut adds (:mod:`spotrl_runtime.core.redo`)."""

TORCH_SAVE_V1 = "torch.save/v1"
"""One process's trainer state, the weights in one ``trainer/weights.pt`` (read, no longer written)."""
TORCH_SAVE_FORMAT = "torch.save/v2"
"""One process's trainer state, the weights in parts ``trainer/weights-00001-of-0000N.pt``
(:func:`weight_part_index`), each listed with the role ``weights``."""
TRAINER_FORMAT_ROLES: dict[str, tuple[str, ...]] = {
    TORCH_SAVE_V1: ("weights", "trainer_meta"),
    TORCH_SAVE_FORMAT: ("weights", "trainer_meta"),
}
"""Trainer formats this code reads -> the file roles a cut in that format must list.
``trainer_meta`` is a small JSON object holding at least ``trainer_step``."""
TORCH_SAVE_ROLES = ("weights", "optimizer", "rng", "trainer_meta")
"""Every role a ``torch.save`` cut's trainer files may have (an optimizer and RNG file are optional)."""
WEIGHT_PART = re.compile(r"trainer/weights-(\d{5})-of-(\d{5})\.pt")


def weight_part_name(index: int, count: int) -> str:
    """``trainer/weights-00001-of-00004.pt``: part ``index`` (1-based) of ``count``."""
    return f"trainer/weights-{index:05d}-of-{count:05d}.pt"


def weight_part_index(name: str) -> tuple[int, int] | None:
    """``trainer/weights-00002-of-00004.pt`` -> (2, 4); None for any other name."""
    m = WEIGHT_PART.fullmatch(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


_ROWS_MAGIC = b"SPOTRLR1"


# ---------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class ManifestFile:
    """One file of a cut: its path (relative to the cut folder), role, size and sha256."""

    path: str
    role: str
    size: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "role": self.role, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_json(cls, data: Any) -> ManifestFile:
        if not isinstance(data, dict):
            raise RecordFormatError("a files[] entry is not a JSON object")
        digest = require_str(data, "sha256")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise RecordFormatError(f"sha256 of {data.get('path')!r} is not 64 lowercase hex digits")
        path = require_str(data, "path")
        if path.startswith("/") or ".." in path.split("/") or path == MANIFEST_NAME:
            raise RecordFormatError(f"file path {path!r} must be relative, inside the cut, and not the manifest")
        return cls(path, require_str(data, "role"), require_int(data, "size"), digest)


@dataclass(frozen=True)
class Manifest:
    """What a committed cut contains. Written last, create-only: its existence is the commit."""

    schema_version: int
    cut_id: str
    kind: str
    job: str
    attempt: int
    writer: str
    data_dir: str
    created_at: str
    trainer_step: int
    dispatch_index: int
    group_counts: Mapping[str, int]
    dataset: Mapping[str, Any]
    config: Mapping[str, Any]
    files: tuple[ManifestFile, ...]
    trainer_format: str | None = None
    capture_seconds: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)
    form: str = "full"
    base: DeltaBase | None = None
    """A delta's base full cut (None for a full cut)."""

    @property
    def is_delta(self) -> bool:
        return self.form == "delta"

    def file(self, role: str) -> ManifestFile | None:
        """The (first) file with ``role``."""
        return next((f for f in self.files if f.role == role), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "cut_id": self.cut_id,
            "kind": self.kind,
            "job": self.job,
            "attempt": self.attempt,
            "writer": self.writer,
            "data_dir": self.data_dir,
            "created_at": self.created_at,
            "trainer_step": self.trainer_step,
            "dispatch_index": self.dispatch_index,
            "group_counts": dict(self.group_counts),
            "dataset": dict(self.dataset),
            "config": dict(self.config),
            "files": [f.to_json() for f in self.files],
            "trainer_format": self.trainer_format,
            "capture_seconds": self.capture_seconds,
            "extra": dict(self.extra),
            "form": self.form,
            "base": None if self.base is None else self.base.to_json(),
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), indent=1, sort_keys=True).encode("utf-8")

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """Parses a manifest (the schema version is checked by the caller first)."""
        if not isinstance(data, dict):
            raise RecordFormatError("the manifest is not a JSON object")
        files = data.get("files")
        if not isinstance(files, list):
            raise RecordFormatError("files must be a list")
        parsed = tuple(ManifestFile.from_json(f) for f in files)
        paths = [f.path for f in parsed]
        if len(set(paths)) != len(paths):
            raise RecordFormatError("files lists a path twice")
        roles = {f.role for f in parsed}
        missing = [r for r in OWNER_FILES if r not in roles]
        if missing:
            raise RecordFormatError(f"files lacks the owner files {missing}")
        kind = require_str(data, "kind")
        if kind not in CUT_KINDS:
            raise RecordFormatError(f"kind must be one of {CUT_KINDS}, got {kind!r}")
        for key in ("group_counts", "dataset", "config"):
            if not isinstance(data.get(key), dict):
                raise RecordFormatError(f"{key} must be a JSON object")
        counts = data["group_counts"]
        for key, value in counts.items():
            if not _whole(value):
                raise RecordFormatError(f"group_counts.{key} must be an integer >= 0, got {value!r}")
        dispatch_index = data.get("dispatch_index")
        if not isinstance(dispatch_index, int) or isinstance(dispatch_index, bool) or dispatch_index < -1:
            raise RecordFormatError(f"dispatch_index must be an integer >= -1, got {dispatch_index!r}")
        capture = data.get("capture_seconds", 0.0)
        if not isinstance(capture, (int, float)) or isinstance(capture, bool) or capture < 0:
            raise RecordFormatError(f"capture_seconds must be a number >= 0, got {capture!r}")
        if not isinstance(data.get("extra") or {}, dict):
            raise RecordFormatError("extra must be a JSON object")
        trainer_format = data.get("trainer_format")
        if trainer_format is not None and not isinstance(trainer_format, str):
            raise RecordFormatError(f"trainer_format must be a string or null, got {trainer_format!r}")
        form = data.get("form", "full")
        if form not in CUT_FORMS:
            raise RecordFormatError(f"form must be one of {CUT_FORMS}, got {form!r}")
        base = None
        if form == "delta":
            base = DeltaBase.from_json(data.get("base"))
            if trainer_format is not None:
                raise RecordFormatError(f"a delta cut holds no trainer state, but trainer_format is {trainer_format!r}")
            lacking = [r for r in DELTA_FILES if r not in roles]
            if lacking:
                raise RecordFormatError(f"files lacks the delta cut's files {lacking}")
        elif data.get("base") is not None:
            raise RecordFormatError("a full cut has no base (base must be null)")
        return cls(
            schema_version=require_int(data, "schema_version"),
            cut_id=require_str(data, "cut_id"),
            kind=kind,
            job=require_str(data, "job", allow_empty=True),
            attempt=require_int(data, "attempt"),
            writer=require_str(data, "writer"),
            data_dir=require_str(data, "data_dir"),
            created_at=_time(data, "created_at"),
            trainer_step=require_int(data, "trainer_step"),
            dispatch_index=dispatch_index,
            group_counts=dict(counts),
            dataset=dict(data["dataset"]),
            config=dict(data["config"]),
            files=parsed,
            trainer_format=trainer_format,
            capture_seconds=float(capture),
            extra=dict(data.get("extra") or {}),
            form=form,
            base=base,
        )


def _time(data: dict[str, Any], key: str) -> str:
    """``data[key]``, an RFC 3339 time (what restore reports as the cut's commit time)."""
    value = require_str(data, key)
    try:
        datetime.fromisoformat(value)
    except ValueError:
        raise RecordFormatError(f"{key} must be an RFC 3339 time, got {value!r}") from None
    return value


def snapshot_counts(snapshot: OwnersSnapshot) -> dict[str, int]:
    """The group counts a manifest records for a snapshot."""
    return _counts(
        snapshot.ledger,
        len(snapshot.replay),
        len(snapshot.spares),
        sum(len(e.group.rollouts) for e in snapshot.replay),
        sum(len(v) for v in snapshot.partial.values()),
        len(snapshot.audit_tail),
    )


def document_counts(docs: CutDocuments) -> dict[str, int]:
    """The same counts, found in a cut's decoded files (check ``group_counts`` compares them)."""
    partial_ids = docs.partial_ids
    return _counts(
        docs.ledger,
        len(docs.replay),
        len(docs.spares),
        sum(len(v) for k, v in docs.rollouts.items() if k not in partial_ids),
        sum(len(v) for k, v in docs.rollouts.items() if k in partial_ids),
        len(docs.audit_tail),
    )


def _counts(
    ledger: tuple[LedgerRecord, ...], replay: int, spares: int, rows: int, partial: int, audit: int
) -> dict[str, int]:
    return {
        "reserved": sum(1 for r in ledger if r.phase is Phase.RESERVED),
        "admitted": sum(1 for r in ledger if r.phase is Phase.ADMITTED),
        "replay": replay,
        "spares": spares,
        "rollout_rows": rows,
        "partial_rows": partial,
        "audit": audit,
    }


# ----------------------------------------------------------------- loader state


@dataclass(frozen=True)
class LoaderPosition:
    """Where the loader stands: the next row is ``epoch``'s order at ``offset``."""

    epoch: int
    offset: int
    batches: int
    """Batches yielded since the run began."""
    size: int | None = None
    """The dataset's row count the state was saved with (None in a state saved before any read)."""

    def order(self, size: int) -> int:
        """The loader order of the next row (rows handed out so far)."""
        return self.epoch * size + self.offset


def loader_position(state: Mapping[str, Any]) -> LoaderPosition:
    """Reads the position out of a saved ``StatefulDataLoader`` state over the epoch sampler of
    :mod:`spotrl_runtime.data.loader`; raises ``ValueError`` for a state of another shape."""
    it = state.get("_sampler_iter_state") or {}
    inner = (it.get("sampler_iter_state") if isinstance(it, dict) else None) or {"epoch": 0, "offset": 0}
    if not isinstance(inner, dict):
        raise ValueError("the loader state's sampler_iter_state is not an object")
    values = [inner.get("epoch"), inner.get("offset"), state.get("_num_yielded", 0)]
    if any(not _whole(v) for v in values):
        raise ValueError(f"the loader state's epoch, offset and _num_yielded must be integers >= 0, got {values}")
    # torchdata's own counts: not the position, but a loader given one that is no count fails
    # at its first batch, after the restore.
    counts = {"_sampler_iter_yielded": state.get("_sampler_iter_yielded", 0)}
    if isinstance(it, dict) and "samples_yielded" in it:
        counts["samples_yielded"] = it["samples_yielded"]
    if any(not _whole(v) for v in counts.values()):
        raise ValueError(f"the loader state's counts must be integers >= 0, got {counts}")
    if state.get("_iterator_finished", False) is not False:
        raise ValueError(
            f"the loader state's _iterator_finished is {state['_iterator_finished']!r}: a loader whose pass "
            "finished starts a new one instead of resuming at its position (the epoch sampler never finishes)"
        )
    size = inner.get("size")
    if it and (not isinstance(size, int) or isinstance(size, bool) or size < 1):
        raise ValueError(f"the loader state's dataset size must be an integer >= 1, got {size!r}")
    return LoaderPosition(values[0], values[1], values[2], size if it else None)


def _whole(value: Any) -> bool:
    """An integer >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ------------------------------------------------------------------ owner files


@dataclass(frozen=True)
class ReplayLocator:
    """A finished group in the replay index: its locator and stamp (rows are in rollouts.bin)."""

    group_id: str
    admission_id: str
    order: int
    idx: int
    task_name: str
    target_step: int
    weight_version: int | None
    fingerprint: str
    rollouts: int
    round: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "admission_id": self.admission_id,
            "order": self.order,
            "idx": self.idx,
            "task_name": self.task_name,
            "target_step": self.target_step,
            "weight_version": self.weight_version,
            "fingerprint": self.fingerprint,
            "rollouts": self.rollouts,
        } | ({"round": self.round} if self.round else {})  # cuts without dynamic sampling stay as they were

    @classmethod
    def of(cls, entry: ReplayEntry) -> ReplayLocator:
        """The locator of a finished group (its rows go to the rows file)."""
        prompt = entry.group.prompt
        return cls(
            group_id=entry.group_id,
            admission_id=entry.admission_id,
            order=entry.order,
            idx=prompt.idx,
            task_name=prompt.task_name,
            target_step=entry.target_step,
            weight_version=entry.weight_version,
            fingerprint=prompt.fingerprint,
            rollouts=len(entry.group.rollouts),
            round=entry.round,
        )

    def entry(self, prompt: Prompt, rows: tuple[Rollout, ...]) -> ReplayEntry:
        """The finished group back, from its rebuilt prompt and its rows."""
        return ReplayEntry(
            FinishedGroup(self.group_id, prompt, self.target_step, rows),
            self.admission_id,
            self.order,
            self.weight_version,
            self.round,
        )

    @classmethod
    def from_json(cls, data: Any) -> ReplayLocator:
        if not isinstance(data, dict):
            raise RecordFormatError("replay entry is not a JSON object")
        return cls(
            group_id=require_str(data, "group_id"),
            admission_id=require_str(data, "admission_id"),
            order=require_int(data, "order"),
            idx=require_int(data, "idx"),
            task_name=require_str(data, "task_name"),
            target_step=require_int(data, "target_step"),
            weight_version=optional_int(data, "weight_version"),
            fingerprint=require_str(data, "fingerprint", allow_empty=True),
            rollouts=require_int(data, "rollouts", minimum=1),
            round=require_int(data, "round") if "round" in data else 0,
        )


@dataclass(frozen=True)
class CutDocuments:
    """The owner files of a cut, decoded but not yet checked against each other or the dataset."""

    config: RecoveryConfig
    config_raw: Mapping[str, Any]
    """The config as ``sampler.json`` holds it (check ``one_config`` compares it with the manifest's)."""
    attempt: int
    trainer_step: int
    dispatch_index: int
    next_order: int
    next_admission: int
    retired: OrderSet
    shortfall: Mapping[int, int]
    dropped: Mapping[int, tuple[DroppedPrompt, ...]]
    loader_state: dict[str, Any]
    ledger_raw: list[Any]
    """Ledger records as found; :mod:`validation` parses them (check ``ledger_record``)."""
    ledger: tuple[LedgerRecord, ...]
    spares: tuple[Spare, ...]
    replay: tuple[ReplayLocator, ...]
    rollouts: Mapping[str, tuple[Rollout, ...]]
    audit_tail: tuple[AuditRecord, ...]
    redo_index: tuple[RedoIndexStep, ...] = ()
    """A delta cut's redo steps (``redo.json``); empty in a full cut."""
    redo_rollouts: Mapping[str, tuple[Rollout, ...]] = field(default_factory=dict)
    """A delta cut's redo rows by group (``redo_rows.bin``)."""
    episodes: tuple[EpisodeState, ...] = ()
    """Unfinished episodes' finished turns (``episodes.json``; absent: none)."""

    @property
    def partial_ids(self) -> set[str]:
        """Groups whose rows in rollouts.bin are finished siblings of a ledger group."""
        return {r.group_id for r in self.ledger}


class OwnerFileError(ValueError):
    """An owner file that does not decode; carries its role."""

    def __init__(self, role: str, message: str):
        self.role = role
        super().__init__(message)


def _json(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":"), sort_keys=True).encode("utf-8")


def encode_owner_files(snapshot: OwnersSnapshot) -> dict[str, bytes]:
    """The owner files of a snapshot, by role. Locators only, except the rollout rows."""
    sampler = {
        "attempt": snapshot.attempt,
        "trainer_step": snapshot.trainer_step,
        "dispatch_index": snapshot.dispatch_index,
        "next_order": snapshot.next_order,
        "next_admission": snapshot.next_admission,
        "shortfall": {str(k): v for k, v in sorted(snapshot.shortfall.items())},
        "dropped": {str(k): [d.to_json() for d in v] for k, v in sorted(snapshot.dropped.items())},
        "retired": snapshot.retired.to_json(),
        "config": snapshot.config.to_json(),
    }
    replay = [ReplayLocator.of(e).to_json() for e in snapshot.replay]
    rows: list[tuple[str, tuple[Rollout, ...]]] = [(e.group_id, e.group.rollouts) for e in snapshot.replay]
    rows += [(gid, rs) for gid, rs in snapshot.partial.items()]
    episodes = [e.to_json() for gid in sorted(snapshot.episodes) for e in snapshot.episodes[gid]]
    return {
        **({"episodes": _json({"episodes": episodes})} if episodes else {}),
        "sampler": _json(sampler),
        "loader": _json(snapshot.loader_state),
        "ledger": _json({"records": [r.to_json() for r in snapshot.ledger]}),
        "spare_pool": _json({"spares": [s.to_json() for s in snapshot.spares]}),
        "replay_index": _json({"groups": replay}),
        "rollouts": encode_rollouts(rows),
        "audit": _json({"records": [a.to_json() for a in snapshot.audit_tail]}),
    }


def _load(role: str, blob: bytes) -> Any:
    try:
        return json.loads(blob)
    except (ValueError, UnicodeDecodeError) as err:
        raise OwnerFileError(role, f"is not JSON ({err})") from None


def _list(role: str, doc: Any, key: str) -> list[Any]:
    if not isinstance(doc, dict) or not isinstance(doc.get(key), list):
        raise OwnerFileError(role, f"must be a JSON object with a list {key!r}")
    return list(doc[key])


def _by_step(doc: dict[str, Any], key: str) -> dict[int, Any]:
    """``doc[key]``, an object keyed by step numbers, with the keys as ints."""
    value = doc.get(key) or {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and k.isdigit() for k in value):
        raise RecordFormatError(f"{key} must be an object keyed by step numbers")
    return {int(k): v for k, v in value.items()}


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def decode_owner_files(blobs: Mapping[str, bytes]) -> CutDocuments:
    """Decodes the owner files. Ledger records stay raw (``ledger_raw``) for check ``ledger_record``;
    every other malformed file raises :class:`OwnerFileError` naming its role."""
    sampler = _load("sampler", blobs["sampler"])
    try:
        if not isinstance(sampler, dict):
            raise RecordFormatError("not a JSON object")
        config_raw = sampler.get("config")
        if not isinstance(config_raw, dict):
            raise RecordFormatError("config must be a JSON object")
        config = RecoveryConfig.from_json(config_raw)
        try:
            retired = OrderSet.from_json(sampler.get("retired"))
        except ValueError as err:
            raise RecordFormatError(f"retired {err}") from None
        dispatch_index = sampler.get("dispatch_index")
        if not isinstance(dispatch_index, int) or dispatch_index < -1:
            raise RecordFormatError(f"dispatch_index must be an integer >= -1, got {dispatch_index!r}")
        shortfall = {k: v for k, v in _by_step(sampler, "shortfall").items() if _count(v)}
        if len(shortfall) != len(_by_step(sampler, "shortfall")):
            raise RecordFormatError("shortfall values must be integers >= 1")
        dropped = {}
        for step, prompts in _by_step(sampler, "dropped").items():
            if not isinstance(prompts, list):
                raise RecordFormatError(f"dropped[{step}] must be a list")
            dropped[step] = tuple(DroppedPrompt.from_json(d) for d in prompts)
        fields = {k: require_int(sampler, k) for k in ("attempt", "trainer_step", "next_order", "next_admission")}
    except (RecordFormatError, ValueError, TypeError) as err:
        raise OwnerFileError("sampler", str(err)) from None
    loader_state = _load("loader", blobs["loader"])
    if not isinstance(loader_state, dict):
        raise OwnerFileError("loader", "must be a JSON object (a StatefulDataLoader state)")
    ledger_raw = _list("ledger", _load("ledger", blobs["ledger"]), "records")
    try:
        spares = tuple(
            Spare.from_json(s) for s in _list("spare_pool", _load("spare_pool", blobs["spare_pool"]), "spares")
        )
    except RecordFormatError as err:
        raise OwnerFileError("spare_pool", str(err)) from None
    try:
        replay = tuple(
            ReplayLocator.from_json(g)
            for g in _list("replay_index", _load("replay_index", blobs["replay_index"]), "groups")
        )
    except RecordFormatError as err:
        raise OwnerFileError("replay_index", str(err)) from None
    try:
        audit = tuple(AuditRecord.from_json(a) for a in _list("audit", _load("audit", blobs["audit"]), "records"))
    except RecordFormatError as err:
        raise OwnerFileError("audit", str(err)) from None
    rollouts = decode_rollouts(blobs["rollouts"])
    episodes = decode_episodes(blobs["episodes"]) if "episodes" in blobs else ()
    return CutDocuments(
        config=config,
        config_raw=config_raw,
        attempt=fields["attempt"],
        trainer_step=fields["trainer_step"],
        dispatch_index=dispatch_index,
        next_order=fields["next_order"],
        next_admission=fields["next_admission"],
        retired=retired,
        shortfall=shortfall,
        dropped=dropped,
        loader_state=loader_state,
        ledger_raw=ledger_raw,
        ledger=(),
        spares=spares,
        replay=replay,
        rollouts=rollouts,
        audit_tail=audit,
        episodes=episodes,
    )


def decode_episodes(blob: bytes) -> tuple[EpisodeState, ...]:
    """``episodes.json``; an episode that does not parse raises :class:`OwnerFileError`."""
    out = []
    for i, data in enumerate(_list("episodes", _load("episodes", blob), "episodes")):
        try:
            out.append(EpisodeState.from_json(data))
        except ValueError as err:
            raise OwnerFileError("episodes", f"episode {i}: {err}") from None
    return tuple(out)


@dataclass(frozen=True)
class RedoIndexStep:
    """One step of ``redo.json``: its groups' locators in the order trained, and its fingerprint."""

    step: int
    groups: tuple[ReplayLocator, ...]
    fingerprint: StepFingerprint


def encode_redo_index(steps: Iterable[RedoStep]) -> bytes:
    """``redo.json``: per step, its groups' locators (as the replay index has them) and its fingerprint."""
    doc = [
        {
            "step": s.step,
            "groups": [ReplayLocator.of(e).to_json() for e in s.entries],
            "fingerprint": s.fingerprint.to_json(),
        }
        for s in steps
    ]
    return _json({"steps": doc})


def decode_redo_index(blob: bytes) -> tuple[RedoIndexStep, ...]:
    """Parses ``redo.json``; raises :class:`RecordFormatError` naming what is malformed."""
    doc = _load("redo_index", blob)
    out = []
    for raw in _list("redo_index", doc, "steps"):
        if not isinstance(raw, dict) or not isinstance(raw.get("groups"), list):
            raise RecordFormatError("each step must be a JSON object with a list 'groups'")
        groups = tuple(ReplayLocator.from_json(g) for g in raw["groups"])
        out.append(RedoIndexStep(require_int(raw, "step"), groups, StepFingerprint.from_json(raw.get("fingerprint"))))
    return tuple(out)


class DeltaNotCoveredError(ValueError):
    """The redo log does not hold every step from the base's to the snapshot's: only a full cut can."""


def encode_delta_files(snapshot: OwnersSnapshot, base: DeltaBase) -> dict[str, bytes]:
    """A delta cut's files besides the owner files: the redo steps from ``base``'s trainer step
    to the snapshot's. Raises :class:`DeltaNotCoveredError` when the redo log lacks one."""
    steps = [s for s in snapshot.redo if s.step >= base.trainer_step]
    want = list(range(base.trainer_step, snapshot.trainer_step))
    if [s.step for s in steps] != want:
        have = f"{steps[0].step}..{steps[-1].step}" if steps else "none"
        raise DeltaNotCoveredError(
            f"the redo log holds steps {have}, a delta on cut {base.cut_id} needs {base.trainer_step}.."
            f"{snapshot.trainer_step - 1}"
        )
    rows = [(e.group_id, e.group.rollouts) for s in steps for e in s.entries]
    return {"redo_index": encode_redo_index(steps), "redo_rows": encode_rollouts(rows)}


def decode_delta_files(docs: CutDocuments, blobs: Mapping[str, bytes]) -> CutDocuments:
    """``docs`` with a delta cut's redo files decoded; raises :class:`OwnerFileError` naming the role."""
    try:
        index = decode_redo_index(blobs["redo_index"])
    except RecordFormatError as err:
        raise OwnerFileError("redo_index", str(err)) from None
    try:
        rows = decode_rollouts(blobs["redo_rows"])
    except OwnerFileError as err:
        raise OwnerFileError("redo_rows", str(err)) from None
    return replace(docs, redo_index=index, redo_rollouts=rows)


def to_snapshot(docs: CutDocuments, prompts: Mapping[str, Prompt]) -> OwnersSnapshot:
    """The snapshot a restore rebuilds the owners from, given the rebuilt prompts of every group."""
    replay = tuple(loc.entry(prompts[loc.group_id], docs.rollouts[loc.group_id]) for loc in docs.replay)
    return OwnersSnapshot(
        config=docs.config,
        attempt=docs.attempt,
        trainer_step=docs.trainer_step,
        dispatch_index=docs.dispatch_index,
        next_order=docs.next_order,
        next_admission=docs.next_admission,
        loader_state=docs.loader_state,
        ledger=docs.ledger,
        partial={r.group_id: docs.rollouts[r.group_id] for r in docs.ledger if r.group_id in docs.rollouts},
        episodes=_by_group(docs.episodes),
        spares=docs.spares,
        replay=replay,
        shortfall=docs.shortfall,
        dropped=docs.dropped,
        audit_tail=docs.audit_tail,
        retired=docs.retired,
        redo=redo_steps(docs, prompts),
        prompts=prompts,
    )


def _by_group(episodes: Iterable[EpisodeState]) -> dict[str, tuple[EpisodeState, ...]]:
    out: dict[str, list[EpisodeState]] = {}
    for e in episodes:
        out.setdefault(e.group_id, []).append(e)
    return {gid: tuple(sorted(es, key=lambda e: e.index)) for gid, es in out.items()}


def redo_steps(docs: CutDocuments, prompts: Mapping[str, Prompt]) -> tuple[RedoStep, ...]:
    """A delta cut's redo steps as the trainer redoes them (prompts rebuilt by the chain)."""
    return tuple(
        RedoStep(
            s.step, tuple(g.entry(prompts[g.group_id], docs.redo_rollouts[g.group_id]) for g in s.groups), s.fingerprint
        )
        for s in docs.redo_index
    )


# ----------------------------------------------------------------- rollout rows


def encode_rollouts(groups: list[tuple[str, tuple[Rollout, ...]]]) -> bytes:
    """Rollout rows in a compact columnar form (see the module docstring)."""
    table: list[list[Any]] = []
    prompt_ids = array("i")
    completion_ids = array("i")
    logprobs = array("d")
    for group_id, rollouts in groups:
        for r in rollouts:
            table.append(
                [
                    group_id,
                    r.index,
                    r.reward,
                    r.weight_version,
                    r.text,
                    r.finish_reason,
                    len(r.prompt_token_ids),
                    len(r.completion_token_ids),
                    len(r.logprobs),
                    # A tenth column only where an episode had observations: a single-turn cut
                    # stays readable by a controller from before them.
                    *([[list(span) for span in r.observed]] if r.observed else []),
                ]
            )
            prompt_ids.extend(r.prompt_token_ids)
            completion_ids.extend(r.completion_token_ids)
            logprobs.extend(r.logprobs)
    header = json.dumps({"rows": table}, separators=(",", ":")).encode("utf-8")
    if sys.byteorder == "big":
        for arr in (prompt_ids, completion_ids, logprobs):
            arr.byteswap()
    return b"".join(
        [
            _ROWS_MAGIC,
            struct.pack("<Q", len(header)),
            header,
            prompt_ids.tobytes(),
            completion_ids.tobytes(),
            logprobs.tobytes(),
        ]
    )


def _row_ok(row: Any) -> bool:
    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    if not isinstance(row, list) or len(row) not in (9, 10):
        return False
    group_id, index, reward, version, text, finish, *counts = row[:9]
    return (
        _spans_ok(row[9:], row[7])
        and isinstance(group_id, str)
        and bool(group_id)
        and count(index)
        and isinstance(reward, (int, float))
        and not isinstance(reward, bool)
        and count(version)
        and isinstance(text, str)
        and isinstance(finish, str)
        and all(count(c) for c in counts)
    )


def _spans_ok(column: list[Any], completion: Any) -> bool:
    """A row's observation spans (its tenth column, if any), as :func:`check_observed` takes them."""
    if not column:
        return True
    spans = column[0]
    if not (isinstance(spans, list) and spans and isinstance(completion, int)):
        return False
    if not all(isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s) for s in spans):
        return False
    try:
        check_observed(spans, completion, "")
    except ValueError:
        return False
    return True


def decode_rollouts(blob: bytes) -> dict[str, tuple[Rollout, ...]]:
    """Rollout rows by group, each group's rows in index order."""
    if not blob.startswith(_ROWS_MAGIC) or len(blob) < len(_ROWS_MAGIC) + 8:
        raise OwnerFileError("rollouts", "does not start with SPOTRLR1 (not a rollout rows file)")
    (hlen,) = struct.unpack_from("<Q", blob, len(_ROWS_MAGIC))
    start = len(_ROWS_MAGIC) + 8
    try:
        table = json.loads(blob[start : start + hlen])["rows"]
        for i, row in enumerate(table):
            if not _row_ok(row):
                raise ValueError(
                    f"row {i} is not [group_id, index, reward, weight_version, text, finish_reason, "
                    f"three counts >= 0, and optional observation spans] of those types: {str(row)[:200]}"
                )
        n_prompt = sum(int(row[6]) for row in table)
        n_completion = sum(int(row[7]) for row in table)
        n_logprobs = sum(int(row[8]) for row in table)
    except (ValueError, KeyError, TypeError, IndexError) as err:
        raise OwnerFileError("rollouts", f"has an unreadable row table ({err})") from None
    pos = start + hlen
    arrays = []
    for code, count in (("i", n_prompt), ("i", n_completion), ("d", n_logprobs)):
        arr = array(code)
        end = pos + count * arr.itemsize
        if end > len(blob):
            raise OwnerFileError("rollouts", "is shorter than its row table says (truncated)")
        arr.frombytes(blob[pos:end])
        if sys.byteorder == "big":
            arr.byteswap()
        arrays.append(arr)
        pos = end
    if pos != len(blob):
        raise OwnerFileError("rollouts", f"has {len(blob) - pos} bytes after its last row")
    # Plain lists slice into tuples several times faster than arrays do.
    prompt_ids, completion_ids, logprobs = (a.tolist() for a in arrays)
    out: dict[str, list[Rollout]] = {}
    p = c = lp = 0
    for group_id, index, reward, version, text, finish, np_, nc, nl, *observed in table:
        out.setdefault(group_id, []).append(
            Rollout(
                group_id=group_id,
                index=index,
                prompt_token_ids=tuple(prompt_ids[p : p + np_]),
                completion_token_ids=tuple(completion_ids[c : c + nc]),
                logprobs=tuple(logprobs[lp : lp + nl]),
                reward=reward,
                weight_version=version,
                text=text,
                finish_reason=finish,
                observed=tuple((a, b) for a, b in observed[0]) if observed else (),
            )
        )
        p, c, lp = p + np_, c + nc, lp + nl
    return {g: tuple(sorted(rs, key=lambda r: r.index)) for g, rs in out.items()}
