"""Whether a controller resumes a run or starts one, from which cut, and as which attempt.

``--resume auto`` resumes from the newest committed cut if the storage holds one, else starts
a new run; ``never`` starts a new run and refuses storage that holds cuts already; anything
else names the cut to resume from. The attempt (the controller's incarnation) is the
operator's number in a cluster; locally nobody numbers them, so it is one past every attempt
that left a trace (the newest cut's, and the audit's: an incarnation killed before its first
cut still audited its steps).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spotrl_runtime.checkpoint.layout import manifest_key, newest_committed
from spotrl_runtime.checkpoint.restore import RestoredRun, restore_cut
from spotrl_runtime.checkpoint.trainer_state import TrainerSnapshot, restore_rng
from spotrl_runtime.core.owners import Owners, PromptSource, RecoveryConfig
from spotrl_runtime.core.validation import Expectations
from spotrl_runtime.data.collate import PromptCollate
from spotrl_runtime.data.dataset import PromptDataset
from spotrl_runtime.storage import Storage


class ResumeError(RuntimeError):
    """The run cannot start from this storage as asked; the message says what to do."""


@dataclass(frozen=True)
class Start:
    """How the run begins: its owners, and the cut it resumed from (None: a new run)."""

    owners: Owners
    restored: RestoredRun | None


def resume_or_start(
    storage: Storage,
    *,
    job: str,
    config: RecoveryConfig,
    dataset: PromptDataset,
    collate: PromptCollate,
    loader: PromptSource,
    trainer: Any,
    resume: str,
    attempt: int | None,
    latest_audited_attempt: Callable[[], int | None],
) -> Start:
    """Restores the owners and the trainer (``trainer``: weights, optimizer, RNG, step) from the
    cut ``resume`` asks for, or starts new owners over ``loader``. Raises :class:`ResumeError`,
    and the validation chain's errors for a cut that does not validate."""
    newest = newest_committed(storage)
    if resume == "never" and newest is not None:
        raise ResumeError(
            f"{storage.uri} already holds cuts of a run (newest: {newest}); "
            "resume it with --resume auto, or give a fresh --storage"
        )
    cut_id = None if resume in ("auto", "never") else resume
    if cut_id is None and (resume == "never" or newest is None):
        return Start(Owners(config, loader, attempt=attempt or 0), None)
    if attempt is None and newest is not None:
        cut_attempt = json.loads(storage.get_bytes(manifest_key(newest))).get("attempt")
        seen = [a for a in (latest_audited_attempt(), cut_attempt) if isinstance(a, int)]
        attempt = max(seen) + 1 if seen else None
    restored = restore_cut(
        storage,
        dataset=dataset,
        collate=collate,
        source=loader,
        cut_id=cut_id,
        expect=Expectations(job=job, config=config),
        attempt=attempt,
    )
    if restored.trainer is not None:
        load_trainer(trainer, restored.trainer)
    if trainer.step != restored.owners.trainer_step:
        raise ResumeError(
            f"cut {restored.cut_id}: the trainer state is at step {trainer.step} but the owners at "
            f"{restored.owners.trainer_step}; the cut is inconsistent, resume from an older one with --resume CUT"
        )
    return Start(restored.owners, restored)


def load_trainer(trainer: Any, snap: TrainerSnapshot) -> None:
    """Puts a cut's trainer snapshot (weights, optimizer, RNG, step) back into the trainer."""
    trainer.model.load_state_dict(snap.weights, strict=True)
    if snap.optimizer is not None:
        trainer.optimizer.load_state_dict(snap.optimizer)
    if snap.rng is not None:
        restore_rng(snap.rng)
    trainer.step = int(snap.meta["trainer_step"])
