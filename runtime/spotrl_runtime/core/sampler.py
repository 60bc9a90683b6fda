"""The sampler: the dispatch cursor and the lookahead gate.

``dispatch_index`` is the last step stamped so far (-1 before the first admission). A
batch may be admitted only while ``dispatch_index < trainer_step + lookahead``; admitting
moves the cursor up by one and stamps every group of the batch with the new value. The
cursor is saved in every cut and restored as saved: rebuilding it from the trainer step
would stamp a re-admitted batch into a step that already holds finished groups.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LookaheadSampler:
    """The gate and the cursor. Not thread-safe by itself: the owners' lock guards it."""

    lookahead: int
    dispatch_index: int = -1

    def __post_init__(self) -> None:
        if self.lookahead < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead}")
        if self.dispatch_index < -1:
            raise ValueError(f"dispatch_index must be >= -1, got {self.dispatch_index}")

    def gate_open(self, trainer_step: int) -> bool:
        """Whether one more batch may be admitted while the trainer is at ``trainer_step``."""
        return self.dispatch_index < trainer_step + self.lookahead

    @property
    def next_stamp(self) -> int:
        """The step the next admitted batch will be stamped with."""
        return self.dispatch_index + 1

    def admission_version(self, step: int) -> int:
        """The weight version a batch stamped ``step`` is generated with: that of the trainer step
        at which the gate opened for it (the gate opens for ``step`` at trainer step ``step - L``)."""
        return max(0, step - self.lookahead)

    def stamp(self) -> int:
        """Moves the cursor up one step and returns the new stamp."""
        self.dispatch_index += 1
        return self.dispatch_index
