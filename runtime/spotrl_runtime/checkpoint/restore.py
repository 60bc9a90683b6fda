"""Restore refuses to guess: pick the newest committed cut, validate it, rebuild every owner.

The controller calls :func:`restore_cut` once at start (or :func:`start_or_restore`, which
starts a new run when the store has no cut yet). Every check of the validation chain is
a hard error (:class:`~spotrl_runtime.core.validation.CutCheckError` naming the check and
the file); a cut that fails is never redispatched, and an older cut is used only when the
caller names it. The restored :class:`~spotrl_runtime.core.owners.Owners` then resends the
ADMITTED groups first (same ``group_id`` and ``target_step``) on its first ``pump()``, and
passes RESERVED batches through the gate again, in admission order, with the saved cursor.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from spotrl_runtime.checkpoint.layout import cut_dir, newest_committed
from spotrl_runtime.checkpoint.reader import StorageCutSource
from spotrl_runtime.checkpoint.sharded_cut import ShardedCut
from spotrl_runtime.checkpoint.trainer_state import TorchSaveFormat, TrainerSnapshot, TrainerStateFormat
from spotrl_runtime.core.cut_format import Manifest, to_snapshot
from spotrl_runtime.core.owners import Owners, PromptSource, RecoveryConfig
from spotrl_runtime.core.redo import DeltaBase, RedoStep
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.core.validation import (
    CHECKS,
    DCP_FORMAT,
    Expectations,
    LoaderPositionError,
    TrainerStateError,
    ValidatedCut,
    validate_base,
    validate_cut,
)
from spotrl_runtime.data.collate import PromptCollate
from spotrl_runtime.data.dataset import PromptDataset
from spotrl_runtime.data.loader import epoch_order
from spotrl_runtime.storage import Storage


class NoCommittedCutError(RuntimeError):
    """The store holds no committed cut to restore from."""


class DatasetLookup:
    """``dataset[idx]`` through the one-row collate: how restore and verify rebuild prompts."""

    def __init__(self, dataset: PromptDataset, collate: PromptCollate):
        self.dataset = dataset
        self.collate = collate

    def __len__(self) -> int:
        return len(self.dataset)

    def rebuild(self, idx: int) -> Prompt:
        return self.collate(self.dataset[idx])

    def epoch_order(self, epoch: int, *, shuffle: bool, seed: int) -> Sequence[int]:
        return epoch_order(len(self.dataset), epoch, shuffle=shuffle, seed=seed)


@dataclass
class RestoredRun:
    """What a restore hands the controller: the owners, the trainer's state and the cut it came from."""

    owners: Owners
    trainer: TrainerSnapshot | ShardedCut | None
    """The trainer's state: loaded (``torch.save/v2`` or ``v1``), or where a trainer group loads it from
    (``dcp/v1``: :class:`~spotrl_runtime.checkpoint.sharded.ShardedCut`); None without one."""
    manifest: Manifest
    cut_id: str
    manifest_sha256: str = ""
    redo: tuple[RedoStep, ...] = ()
    """A delta cut's redo steps: ``trainer`` holds its base's state, and the trainer trains these
    again (``resume.redo``) to reach the delta's trainer step."""

    @property
    def base(self) -> DeltaBase:
        """The full cut the next delta cuts extend: this cut, or, for a delta, its base."""
        if self.manifest.base is not None:
            return self.manifest.base
        return DeltaBase(self.cut_id, self.manifest_sha256, self.manifest.trainer_step)


def validate_stored_cut(
    storage: Storage,
    cut_id: str,
    lookup: DatasetLookup | None,
    expect: Expectations | None = None,
    spool_dir: Path | None = None,
    encode: Callable[[Prompt], Sequence[int]] | None = None,
) -> ValidatedCut:
    """Runs the validation chain on one stored cut (what ``spotrl ckpt verify`` calls); a delta's
    base too (check ``delta_base``)."""
    with StorageCutSource(storage, cut_id, spool_dir) as source:
        validated = validate_cut(source, lookup, expect, encode)
    if validated.manifest.base is None:
        return validated
    with StorageCutSource(storage, validated.manifest.base.cut_id, spool_dir) as base:
        validate_base(source.location, validated.manifest, base, lookup, expect)
    ran = {*validated.checks, "delta_base"}
    return replace(validated, checks=tuple(c for c in CHECKS if c in ran))


def restore_cut(
    storage: Storage,
    *,
    dataset: PromptDataset,
    collate: PromptCollate,
    source: PromptSource,
    cut_id: str | None = None,
    expect: Expectations | None = None,
    attempt: int | None = None,
    trainer_format: TrainerStateFormat | None = None,
    load_trainer: bool = True,
    spool_dir: Path | None = None,
    encode: Callable[[Prompt], Sequence[int]] | None = None,
) -> RestoredRun:
    """Validates a committed cut (the newest unless ``cut_id`` is given) and rebuilds the run.

    ``source`` is a fresh loader over ``dataset``; it resumes at the cut's position.
    ``attempt`` defaults to the cut's attempt + 1 (the audit tells attempts apart).
    ``encode`` (a prompt's token ids, as generation makes them) runs check
    ``rollout_prompt_tokens``. A trainer file that does not load is check ``trainer_state``.
    A ``dcp/v1`` cut's shards are not loaded here: ``trainer`` is a
    :class:`~spotrl_runtime.checkpoint.sharded.ShardedCut` (the validated files and
    ``trainer/meta.json``) that the trainer loads (``resume.load_trainer``).
    """
    chosen = cut_id or newest_committed(storage)
    if chosen is None:
        raise NoCommittedCutError(f"{storage.uri} holds no committed cut (no cuts/<id>/manifest.json)")
    with StorageCutSource(storage, chosen, spool_dir) as cut:
        validated = validate_cut(cut, DatasetLookup(dataset, collate), expect, encode)
        if validated.manifest.is_delta:
            base_id = validated.manifest.base.cut_id  # type: ignore[union-attr]
            with StorageCutSource(storage, base_id, spool_dir) as base_cut:
                base = validate_base(
                    cut.location, validated.manifest, base_cut, DatasetLookup(dataset, collate), expect
                )
                trainer = _load_trainer(storage, base_id, base, base_cut, trainer_format) if load_trainer else None
        docs = validated.documents
        snapshot = to_snapshot(docs, validated.prompts)
        try:
            owners = Owners.restore(snapshot, source, attempt=docs.attempt + 1 if attempt is None else attempt)
        except Exception as err:
            # The chain vouched for the loader state; a loader that still refuses it is named too.
            raise LoaderPositionError(
                cut.location,
                validated.manifest.file("loader").path,  # type: ignore[union-attr]
                f"the loader does not accept its saved state ({type(err).__name__}: {err})",
                "restore from an older cut with --resume CUT",
            ) from None
        if not validated.manifest.is_delta:
            trainer = _load_trainer(storage, chosen, validated.manifest, cut, trainer_format) if load_trainer else None
        digest = hashlib.sha256(cut.read_manifest() or b"").hexdigest()
    return RestoredRun(owners, trainer, validated.manifest, chosen, digest, snapshot.redo)


def _load_trainer(
    storage: Storage,
    cut_id: str,
    manifest: Manifest,
    cut: StorageCutSource,
    trainer_format: TrainerStateFormat | None,
) -> TrainerSnapshot | ShardedCut | None:
    """A validated full cut's trainer state: loaded (``torch.save``), or where a trainer group
    loads it from (``dcp/v1``)."""
    if manifest.trainer_format == DCP_FORMAT:
        return sharded_cut(storage, cut_id, manifest, cut)
    if manifest.trainer_format is None:
        return None
    fmt = trainer_format or TorchSaveFormat()
    if manifest.trainer_format not in fmt.reads:
        raise TrainerStateError(
            cut.location,
            None,
            f"the cut holds trainer state in format {manifest.trainer_format!r}; this restore reads "
            f"{', '.join(fmt.reads)}",
        )
    try:
        return fmt.load(trainer_files(manifest, cut))
    except Exception as err:
        raise TrainerStateError(
            cut.location,
            f"{manifest.data_dir}/trainer/",
            f"the trainer's files do not load as {fmt.name} ({type(err).__name__}: {err})",
            "restore from an older cut with --resume CUT",
        ) from None


def trainer_files(manifest: Manifest, cut: StorageCutSource) -> dict[str, list[Path]]:
    """A validated cut's ``torch.save`` trainer files as a format loads them: role -> local
    paths, in path order."""
    paths: dict[str, list[Path]] = {}
    for f in sorted(manifest.files, key=lambda f: f.path):
        if f.path.startswith(f"{manifest.data_dir}/trainer/"):
            paths.setdefault(f.role, []).append(cut.local_path(f.path))
    return paths


def sharded_cut(storage: Storage, cut_id: str, manifest: Manifest, cut: StorageCutSource) -> ShardedCut:
    """Where a trainer group loads a validated ``dcp/v1`` cut from: its trainer files (sizes and
    digests from the manifest) and ``trainer/meta.json`` (the chain checked its step)."""
    prefix = f"{manifest.data_dir}/"
    files = {
        f.path[len(prefix) :]: (f.size, f.sha256)
        for f in manifest.files
        if f.path.startswith(f"{manifest.data_dir}/trainer/")
    }
    meta_file = manifest.file("trainer_meta")
    assert meta_file is not None  # check trainer_state
    meta = json.loads(cut.read(meta_file.path))
    return ShardedCut(storage.uri, f"{cut_dir(cut_id)}/{manifest.data_dir}", files, meta)


def start_or_restore(
    storage: Storage,
    *,
    config: RecoveryConfig,
    dataset: PromptDataset,
    collate: PromptCollate,
    source: PromptSource,
    expect_job: str | None = None,
) -> RestoredRun | Owners:
    """A restored run if the store holds a committed cut, else new owners over ``source``."""
    if newest_committed(storage) is None:
        return Owners(config, source)
    return restore_cut(
        storage,
        dataset=dataset,
        collate=collate,
        source=source,
        expect=Expectations(job=expect_job, config=config),
    )
