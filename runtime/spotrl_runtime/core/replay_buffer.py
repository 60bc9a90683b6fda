"""The replay buffer: finished groups, with their rollout rows, waiting for their step.

Ours and in process: a group enters when its last rollout finishes (in the same
mutation that removes it from the ledger) and leaves when its step is trained. A borrow
re-stamps one group to an earlier step.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

from spotrl_runtime.core.types import FinishedGroup


@dataclass(frozen=True)
class ReplayEntry:
    """A finished group and what orders it inside its step."""

    group: FinishedGroup
    admission_id: str
    order: int
    weight_version: int | None = None
    """Policy version the group was dispatched with (the ledger's, kept for inspection)."""
    round: int = 0
    """Dynamic sampling: the refill round that generated the group (0: the step's own batch)."""

    @property
    def group_id(self) -> str:
        return self.group.group_id

    @property
    def target_step(self) -> int:
        return self.group.target_step


class ReplayBuffer:
    """Finished groups by step. Not thread-safe by itself: the owners' lock guards it."""

    def __init__(self) -> None:
        self._by_step: dict[int, dict[str, ReplayEntry]] = {}
        self._step_of: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._step_of)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._step_of

    def add(self, entry: ReplayEntry) -> None:
        """Adds a finished group; a group_id is held at most once."""
        if entry.group_id in self._step_of:
            raise KeyError(f"group {entry.group_id} is already in the replay buffer")
        self._by_step.setdefault(entry.target_step, {})[entry.group_id] = entry
        self._step_of[entry.group_id] = entry.target_step

    def count(self, step: int) -> int:
        """Finished groups stamped for ``step``."""
        return len(self._by_step.get(step, {}))

    def steps(self) -> list[int]:
        """Steps that hold at least one finished group, ascending."""
        return sorted(self._by_step)

    def groups(self, step: int) -> list[ReplayEntry]:
        """The groups of ``step`` in loader order (the order the trainer sees them)."""
        return sorted(self._by_step.get(step, {}).values(), key=lambda e: e.order)

    def take(self, step: int) -> list[ReplayEntry]:
        """Removes and returns the groups of ``step`` in loader order."""
        entries = self.groups(step)
        self._by_step.pop(step, None)
        for e in entries:
            del self._step_of[e.group_id]
        return entries

    def remove(self, group_id: str) -> ReplayEntry:
        """Takes one finished group out (dynamic sampling filters it)."""
        step = self._step_of.pop(group_id)
        entry = self._by_step[step].pop(group_id)
        if not self._by_step[step]:
            del self._by_step[step]
        return entry

    def restamp(self, group_id: str, step: int) -> ReplayEntry:
        """Moves one finished group to another step (a borrow); returns the new entry."""
        old_step = self._step_of[group_id]
        old = self._by_step[old_step].pop(group_id)
        if not self._by_step[old_step]:
            del self._by_step[old_step]
        entry = replace(old, group=replace(old.group, target_step=step))
        self._by_step.setdefault(step, {})[group_id] = entry
        self._step_of[group_id] = step
        return entry

    def entries(self) -> Iterator[ReplayEntry]:
        """Every finished group, by step then loader order."""
        for step in self.steps():
            yield from self.groups(step)
