"""What a cut borrows from a one-process trainer: its live weights and optimizer state.

A cut is captured between steps, under the cut's lock, and written while the next step trains.
By default the tensors are lent by reference (microseconds under the lock;
:class:`~spotrl_runtime.checkpoint.trainer_state.LentTrainerState`): a background thread copies
them, into buffers reused across cuts, while the next step's gradients are computed, and the
trainer's next optimizer step waits for that copy (:meth:`Lender.wait`). A barrier's cut
(``last``) copies nothing at all: the cut writer reads the live tensors, and the next optimizer
step waits for the whole cut (a barrier parks the trainer anyway). ``mode = "locked"`` copies
right there, under the lock. The trainer knows nothing of this but to call :meth:`Lender.wait`
before it changes its tensors.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from spotrl_runtime.checkpoint.trainer_state import (
    BufferPool,
    LentTrainerState,
    TrainerSnapshot,
    capture_rng,
    snapshot_trainer,
)


class Lender:
    """Lends one trainer's tensors to cuts; see the module docstring."""

    def __init__(self) -> None:
        self.mode = "background"
        """``"background"`` (lent by reference, copied beside the next step) or ``"locked"``."""
        self.wait_seconds = 0.0
        """Seconds the trainer waited, before an optimizer step, for cuts to be done with its tensors."""
        self._lent: list[LentTrainerState] = []
        self._buffers: BufferPool | None = None

    def lend(
        self, weights: Mapping[str, Any], optimizer: Any, step: int, meta: Mapping[str, Any], *, last: bool = False
    ) -> Any:
        """The trainer's part of a cut at ``step`` (written later as ``torch.save/v2``):
        ``weights``, the live tensors it trains, and its optimizer's state."""
        if self.mode == "locked":
            return snapshot_trainer(weights, optimizer.state_dict(), step=step, meta=meta)
        if self._buffers is None:
            self._buffers = BufferPool()
        live = TrainerSnapshot(
            weights=weights,
            optimizer=optimizer.state_dict(),
            rng=capture_rng(),
            meta={**meta, "trainer_step": step},
        )
        lent = LentTrainerState(live, copy=not last, buffers=self._buffers)
        self._lent = [x for x in self._lent if not x.released()] + [lent]
        return lent

    def wait(self) -> float:
        """Waits until no cut holds the lent tensors (call it before changing them); returns the
        seconds waited (also added to :attr:`wait_seconds`)."""
        t0 = time.perf_counter()
        for lent in self._lent:
            lent.wait_released()
        self._lent = []
        waited = time.perf_counter() - t0
        self.wait_seconds += waited
        return waited
