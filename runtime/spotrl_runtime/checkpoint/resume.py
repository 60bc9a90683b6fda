"""Whether a controller resumes a run or starts one, from which cut, and as which attempt.

``--resume auto`` resumes from the newest committed cut if the storage holds one, else starts
a new run; ``never`` starts a new run and refuses storage that holds cuts already; anything
else names the cut to resume from. The attempt (the controller's incarnation) is the
operator's number in a cluster; locally nobody numbers them, so it is one past every attempt
that left a trace (the newest cut's, and the audit's: an incarnation killed before its first
cut still audited its steps).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spotrl_runtime.checkpoint.fence import Fence, claimed_attempts
from spotrl_runtime.checkpoint.layout import list_cut_folders, manifest_key
from spotrl_runtime.checkpoint.ownership import prove_ownership
from spotrl_runtime.checkpoint.precheck import ResumeError, refuse_never
from spotrl_runtime.checkpoint.restore import RestoredRun, restore_cut
from spotrl_runtime.checkpoint.sharded_cut import ShardedCut, ShardError
from spotrl_runtime.checkpoint.trainer_state import TrainerSnapshot, restore_rng
from spotrl_runtime.core.identity import JobIdentity
from spotrl_runtime.core.owners import Owners, PromptSource, RecoveryConfig
from spotrl_runtime.core.types import Prompt, RankLostError
from spotrl_runtime.core.validation import (
    BYTE_LEVEL_CHECKS,
    CutCheckError,
    Expectations,
    PolicyExpectation,
    RedoFingerprintError,
    TrainerStateError,
)
from spotrl_runtime.data.collate import PromptCollate
from spotrl_runtime.data.dataset import PromptDataset
from spotrl_runtime.failpoints import failpoint
from spotrl_runtime.storage import Storage, StorageError

log = logging.getLogger("spotrl.resume")


@dataclass(frozen=True)
class SkippedCut:
    """A committed cut ``--resume auto`` passed over: a byte-level check refused it."""

    cut_id: str
    check: str
    message: str


@dataclass(frozen=True)
class Start:
    """How the run begins: its owners, the cut it resumed from (None: a new run), this
    controller's claim on the job, and the newer cuts that were skipped as damaged."""

    owners: Owners
    restored: RestoredRun | None
    fence: Fence
    skipped: tuple[SkippedCut, ...] = field(default_factory=tuple)
    older_weights: tuple[tuple[dict[str, Any], int], ...] = ()
    """(policy state dict, version) of the versions older than the trainer's that the relaunched
    groups ask for, oldest first: a delta's redo passed through them. Give them to the pool
    before the trainer's own."""


def resume_or_start(
    storage: Storage,
    *,
    job: JobIdentity,
    config: RecoveryConfig,
    dataset: PromptDataset,
    collate: PromptCollate,
    loader: PromptSource,
    trainer: Any,
    resume: str,
    attempt: int | None,
    latest_audited_attempt: Callable[[], int | None],
    dataset_description: Mapping[str, Any] | None = None,
    encode: Callable[[Prompt], Sequence[int]] | None = None,
    stop: Callable[[], bool] | None = None,
) -> Start:
    """Proves that ``storage`` is ``job``'s (:func:`~spotrl_runtime.checkpoint.ownership.prove_ownership`:
    a store of another job is refused before anything is written there), claims the job for
    this controller's attempt (:class:`~spotrl_runtime.checkpoint.fence.Fence`), then restores
    the owners and the trainer (``trainer``: weights, optimizer, RNG, step) from the cut
    ``resume`` asks for, or starts new owners over ``loader``.

    ``auto`` takes the newest committed cut that passes the whole validation chain: a newer cut
    refused by a byte-level check (a missing or damaged file, :data:`BYTE_LEVEL_CHECKS`) is
    skipped loudly (``Start.skipped``); any other refusal means a bug or tampering and stops
    the run. Raises :class:`ResumeError`, and the chain's errors."""
    prove_ownership(storage, job)
    committed = [f.cut_id for f in list_cut_folders(storage) if f.committed]
    newest = committed[-1] if committed else None
    if resume == "never":
        refuse_never(storage, newest)
    if attempt is None:
        attempt = _next_attempt(storage, newest, latest_audited_attempt)
    fence = Fence(storage, attempt, job).claim()
    if resume == "never" or (resume == "auto" and newest is None):
        return Start(Owners(config, loader, attempt=attempt), None, fence)
    adapter = getattr(trainer, "adapter", None)  # a LoRA trainer's AdapterIdentity
    policy = PolicyExpectation(adapter.to_json() if adapter is not None else None)
    expect = Expectations(job=job.name, config=config, dataset=dataset_description, policy=policy)

    older: list[tuple[dict[str, Any], int]] = []

    def restore(cut_id: str) -> RestoredRun:
        older.clear()
        restored = restore_cut(
            storage,
            dataset=dataset,
            collate=collate,
            source=loader,
            cut_id=cut_id,
            expect=expect,
            attempt=attempt,
            encode=encode,
        )
        if restored.trainer is not None:
            load_trainer(trainer, restored.trainer, restored.cut_id, storage.uri)
        wanted = restored.owners.versions_wanted()
        if restored.manifest.is_delta:
            older.extend(redo(trainer, restored, storage.uri, stop, keep=wanted))
        _say_what_the_cut_lacks(restored, wanted - {v for _, v in older})
        if trainer.step != restored.owners.trainer_step:
            raise TrainerStateError(
                f"{storage.uri}/cuts/{restored.cut_id}",
                None,
                f"the trainer state is at step {trainer.step} but the owners at {restored.owners.trainer_step}",
                "resume from an older cut with --resume CUT",
            )
        return restored

    if resume != "auto":
        restored = restore(resume)
        return Start(restored.owners, restored, fence, older_weights=tuple(older))
    skipped: list[SkippedCut] = []
    for cut_id in reversed(committed):
        try:
            restored = restore(cut_id)
        except CutCheckError as err:
            if err.check not in BYTE_LEVEL_CHECKS:
                raise
            log.warning("cut %s is damaged (check %s: %s); trying the next older cut", cut_id, err.check, err.detail)
            skipped.append(SkippedCut(cut_id, err.check, err.detail))
            continue
        if skipped:
            log.warning(
                "resumed from cut %s, older than %d damaged cut(s): %s; the steps after it are trained again",
                cut_id,
                len(skipped),
                ", ".join(f"{s.cut_id} ({s.check})" for s in skipped),
            )
        return Start(restored.owners, restored, fence, tuple(skipped), tuple(older))
    raise ResumeError(
        f"every committed cut of {storage.uri} is damaged: "
        + "; ".join(f"{s.cut_id}: [{s.check}] {s.message}" for s in skipped)
        + "; restore the files from a backup, or start over with a fresh --storage"
    )


def _next_attempt(storage: Storage, newest: str | None, latest_audited_attempt: Callable[[], int | None]) -> int:
    """One past every attempt that left a trace: claims, the audit, the newest cut (0 if none did)."""
    seen = [*claimed_attempts(storage), latest_audited_attempt()]
    if newest is not None:
        # A damaged manifest has no attempt to give; the validation chain names what is wrong.
        with contextlib.suppress(StorageError, ValueError, AttributeError):
            seen.append(json.loads(storage.get_bytes(manifest_key(newest))).get("attempt"))
    numbers = [a for a in seen if isinstance(a, int) and not isinstance(a, bool)]
    return max(numbers) + 1 if numbers else 0


def load_trainer(trainer: Any, snap: TrainerSnapshot | ShardedCut, cut_id: str = "", uri: str = "") -> None:
    """Puts a cut's trainer snapshot (weights, optimizer, RNG, step) back into the trainer;
    state that does not fit the trainer is check ``trainer_state``.

    A sharded cut (:class:`~spotrl_runtime.checkpoint.sharded.ShardedCut`) is loaded by the
    trainer itself (``trainer.load_sharded(cut)``: every rank of a trainer group, or one process);
    any failure is check ``trainer_state``, naming the file when a
    :class:`~spotrl_runtime.checkpoint.sharded.ShardError` names one."""
    if isinstance(snap, ShardedCut):
        _load_sharded(trainer, snap, cut_id, uri)
        return
    if not hasattr(trainer, "model"):
        raise TrainerStateError(
            f"{uri}/cuts/{cut_id}",
            "trainer/",
            "the cut holds a single-process trainer's state (torch.save); a group of FSDP ranks resumes from "
            "sharded cuts (dcp/v1) only",
            "resume this run with training.parallelism.strategy single (its next cuts stay torch.save), "
            "or start a new run with strategy fsdp",
        )
    notice = low_precision_notice(snap.weights)
    if notice is not None:
        log.warning("cut %s: %s", cut_id, notice)
    try:
        trainer.load_trained_state(snap.weights)
        if snap.optimizer is not None:
            trainer.optimizer.load_state_dict(snap.optimizer)
        if snap.rng is not None:
            restore_rng(snap.rng)
        trainer.step = int(snap.meta["trainer_step"])
    except Exception as err:
        raise TrainerStateError(
            f"{uri}/cuts/{cut_id}",
            "trainer/",
            f"the trainer state does not load into this policy ({type(err).__name__}: {str(err)[:300]})",
            "resume with the policy the run was started with, or from an older cut with --resume CUT",
        ) from None


def low_precision_notice(weights: Mapping[str, Any]) -> str | None:
    """For a cut's weights: a sentence when they are held below float32 (a cut written before the
    trainer kept float32 master weights, from a bf16 job), None when they are float32. Loading them
    into float32 masters is exact (every bf16 value is a float32 value), so such a cut resumes
    where it stopped, and the run's later updates are no longer rounded away."""
    import torch

    low = sorted(
        {
            str(v.dtype).removeprefix("torch.")
            for v in weights.values()
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != torch.float32
        }
    )
    if not low:
        return None
    return (
        f"it holds {', '.join(low)} weights (written before the trainer kept float32 master weights); they are "
        "loaded exactly into float32 masters"
    )


def _say_what_the_cut_lacks(restored: RestoredRun, missing: set[int]) -> None:
    """Warns when relaunched groups ask for weights the cut cannot rebuild (a full cut holds the
    newest only; a delta rebuilds those since its base): they are generated with the trainer's."""
    if missing:
        log.warning(
            "groups admitted with weight versions %s are relaunched, but cut %s cannot rebuild those weights; "
            "they are generated with version %d (counted in version_mismatches; the importance weight corrects "
            "for the difference)",
            sorted(missing),
            restored.cut_id,
            restored.owners.trainer_step,
        )


class RedoStoppedError(Exception):
    """The process was asked to stop during a redo: it stops, having written nothing (the next
    controller resumes from the same delta cut)."""


def _packed(trainer: Any) -> bool | None:
    """Whether ``trainer`` packs its micro-batches; None for one that cannot (it has no config)."""
    config = getattr(trainer, "config", None)
    return None if config is None else bool(config.packed)


def redo(
    trainer: Any,
    restored: RestoredRun,
    uri: str = "",
    stop: Callable[[], bool] | None = None,
    keep: Collection[int] = (),
) -> list[tuple[dict[str, Any], int]]:
    """Trains a delta cut's redo steps again on ``trainer`` (at the base's state): each step from
    its recorded groups, in their recorded order, no generation; each must reproduce its recorded
    fingerprint (check ``redo_fingerprint``: bit for bit when both ran in one CPU process).
    Writes nothing: a process killed during the redo resumes from the same delta, and one asked to
    ``stop`` stops between steps (:class:`RedoStoppedError`). Returns the policy weights of each
    version in ``keep`` it passed through, oldest first (those the relaunched groups ask for)."""
    kept: list[tuple[dict[str, Any], int]] = []
    loc = f"{uri}/cuts/{restored.cut_id}"
    index = restored.manifest.file("redo_index")
    path = index.path if index is not None else None
    started = time.monotonic()
    job_packed = _packed(trainer)
    for step in restored.redo:
        if trainer.step != step.step:
            raise TrainerStateError(
                loc, path, f"redo step {step.step} comes after trainer step {trainer.step}", "resume from its base"
            )
        if trainer.step in keep:
            kept.append((trainer.policy_state_dict(), trainer.step))
        failpoint("redo.step", step.step)
        if stop is not None and stop():
            raise RedoStoppedError(
                f"stopped during the redo of delta cut {restored.cut_id}, before step {step.step}; nothing was "
                "written, and the next controller resumes from the same cut"
            )
        # A step trained before packing (or with it) is redone as it was trained.
        packed = "packed" in step.fingerprint.layout.split(",")
        if job_packed is not None and packed != _packed(trainer):
            log.info("redo step %d: %s, as it was trained", step.step, "packed" if packed else "padded rows")
            trainer.use_packing(packed)
        metrics = trainer.train_step([e.group for e in step.entries])
        problem = step.fingerprint.mismatch(trainer.fingerprint(metrics))
        if problem is not None:
            raise RedoFingerprintError(
                loc,
                path,
                f"redo step {step.step} does not reproduce its recorded step: {problem}",
                "resume from the delta's base with --resume CUT (its steps are trained again, with generation)",
            )
    if job_packed is not None and _packed(trainer) != job_packed:
        trainer.use_packing(job_packed)  # the steps after the redo train as the job says
    if restored.redo:
        log.info(
            "redid steps %d..%d of delta cut %s on its base %s in %.2f s (no generation)",
            restored.redo[0].step,
            restored.redo[-1].step,
            restored.cut_id,
            restored.base.cut_id,
            time.monotonic() - started,
        )
    return kept


def _load_sharded(trainer: Any, cut: ShardedCut, cut_id: str, uri: str) -> None:
    try:
        trainer.load_sharded(cut)
        trainer.step = int(cut.meta["trainer_step"])
    except RankLostError:
        raise  # not the cut's fault: the next controller tries again
    except Exception as err:
        shard = _shard_error(err)
        prefix = f"cuts/{cut_id}/"
        data_dir = cut.folder[len(prefix) :] if cut.folder.startswith(prefix) else cut.folder
        cause = shard or err
        raise TrainerStateError(
            f"{uri}/cuts/{cut_id}",
            f"{data_dir}/{shard.file}" if shard is not None and shard.file else f"{data_dir}/trainer/",
            f"the trainer's sharded state does not load ({type(cause).__name__}: {str(cause)[:400]})",
            "resume with the policy the run was started with, or from an older cut with --resume CUT",
        ) from None


def _shard_error(err: BaseException) -> ShardError | None:
    """The innermost :class:`ShardError` behind ``err`` that names a file: itself, or a cause
    (a Ray error wraps a rank's, and passes for its class)."""
    found: ShardError | None = err if isinstance(err, ShardError) else None
    seen: set[int] = set()
    todo: list[Any] = [err]
    while todo:
        e = todo.pop(0)
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ShardError) and getattr(e, "file", None):
            found = e
        todo += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return found
