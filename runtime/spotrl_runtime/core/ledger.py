"""The ledger: the owner of every prompt that left the loader and is not finished yet.

A record is a locator, never the prompt: ``(idx, task_name)`` plus ids, phase and stamp,
so a record stays a few hundred bytes whatever the prompt's length. The live
:class:`~spotrl_runtime.core.types.Prompt` is held beside it in memory only; restore
rebuilds it from ``dataset[idx]``. Two phases:

- ``RESERVED``: taken from the loader, waiting at the lookahead gate (no stamp yet);
- ``ADMITTED``: stamped with ``target_step`` and dispatched; maybe partly generated.

A group leaves the ledger finished (into the replay buffer, then trained), or untrained in
one of two end states, each kept in its step's audit record with its reason
(:class:`~spotrl_runtime.core.audit.DroppedPrompt`): ``dropped``, given up on after a failure
(generation, reward), or ``filtered``, refused for a reason about the prompt itself (the
admission filter of :mod:`spotrl_runtime.core.admission`: too long for ``maxModelLen``).
Either way ``onDroppedPrompt`` fills its place. A filter that judges a group after generation
(dynamic sampling) or an agent's restarted episode ends the same way, with its own reason.

This module is data and bookkeeping only; the moves between owners, and their lock, are
in :mod:`spotrl_runtime.core.owners`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from spotrl_runtime.core.fields import RecordFormatError, optional_int, require_int, require_str
from spotrl_runtime.core.types import EpisodeState, Prompt, Rollout


class Phase(StrEnum):
    """Where a ledger group stands: waiting at the gate, or stamped and dispatched."""

    RESERVED = "RESERVED"
    ADMITTED = "ADMITTED"


@dataclass(frozen=True)
class LedgerRecord:
    """One unfinished group, by locator."""

    group_id: str
    admission_id: str
    order: int
    """Run-wide sequence number of the prompt in loader order; orders groups inside a step."""
    idx: int
    task_name: str
    phase: Phase
    target_step: int | None
    """The step the group will train at; None while RESERVED."""
    expected_generations: int
    """Rollouts the group needs (the group size G)."""
    weight_version: int | None = None
    """Policy version when the group was dispatched; None while RESERVED."""
    fingerprint: str = ""
    """sha256 of the dataset row at dispatch ('' if not recorded)."""
    round: int = 0
    """Dynamic sampling: the refill round the group belongs to (0: the step's own batch)."""

    def admitted(self, target_step: int, weight_version: int) -> LedgerRecord:
        """This record stamped for ``target_step``."""
        return replace(self, phase=Phase.ADMITTED, target_step=target_step, weight_version=weight_version)

    def to_json(self) -> dict[str, Any]:
        """The persisted form (locators only)."""
        return {
            "group_id": self.group_id,
            "admission_id": self.admission_id,
            "order": self.order,
            "idx": self.idx,
            "task_name": self.task_name,
            "phase": self.phase.value,
            "target_step": self.target_step,
            "expected_generations": self.expected_generations,
            "weight_version": self.weight_version,
            "fingerprint": self.fingerprint,
        } | ({"round": self.round} if self.round else {})  # cuts without dynamic sampling stay as they were

    @classmethod
    def from_json(cls, data: Any) -> LedgerRecord:
        """Parses a persisted record; raises :class:`RecordFormatError` naming the bad field."""
        if not isinstance(data, dict):
            raise RecordFormatError("record is not a JSON object")
        try:
            phase = Phase(str(data.get("phase")))
        except ValueError:
            raise RecordFormatError(f"phase is {data.get('phase')!r}, not RESERVED or ADMITTED") from None
        return cls(
            group_id=require_str(data, "group_id"),
            admission_id=require_str(data, "admission_id"),
            order=require_int(data, "order"),
            idx=require_int(data, "idx"),
            task_name=require_str(data, "task_name"),
            phase=phase,
            target_step=optional_int(data, "target_step"),
            expected_generations=require_int(data, "expected_generations", minimum=1),
            weight_version=optional_int(data, "weight_version"),
            fingerprint=require_str(data, "fingerprint", allow_empty=True),
            round=require_int(data, "round") if "round" in data else 0,
        )


class Ledger:
    """Unfinished groups by ``group_id``, with their live prompts and finished sibling rollouts.

    Keeps two indexes so the hot paths (the gate, "is step t complete?") stay O(1) with
    tens of thousands of groups in flight: RESERVED batches in admission order, and the
    number of ADMITTED groups per stamp.
    """

    def __init__(self) -> None:
        self._records: dict[str, LedgerRecord] = {}
        self._prompts: dict[str, Prompt] = {}
        self._partial: dict[str, dict[int, Rollout]] = {}
        self._episodes: dict[str, dict[int, EpisodeState]] = {}
        self._reserved: dict[str, list[str]] = {}
        self._per_step: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._records

    def get(self, group_id: str) -> LedgerRecord | None:
        """The record of ``group_id``, or None."""
        return self._records.get(group_id)

    def prompt(self, group_id: str) -> Prompt:
        """The live prompt of a ledger group."""
        return self._prompts[group_id]

    def put(
        self,
        record: LedgerRecord,
        prompt: Prompt,
        partial: tuple[Rollout, ...] = (),
        episodes: tuple[EpisodeState, ...] = (),
    ) -> None:
        """Adds a record with its prompt, and any finished sibling rollouts and unfinished
        episodes' finished turns (restore passes those)."""
        if record.group_id in self._records:
            raise KeyError(f"group {record.group_id} is already in the ledger")
        self._records[record.group_id] = record
        self._prompts[record.group_id] = prompt
        self._partial[record.group_id] = {r.index: r for r in partial}
        self._episodes[record.group_id] = {e.index: e for e in episodes}
        self._index(record, +1)

    def restamp(self, record: LedgerRecord) -> None:
        """Replaces a record by a new version of itself (same group_id), e.g. when admitted."""
        old = self._records[record.group_id]
        self._index(old, -1)
        self._records[record.group_id] = record
        self._index(record, +1)

    def remove(self, group_id: str) -> tuple[LedgerRecord, Prompt, tuple[Rollout, ...]]:
        """Takes a group out of the ledger; returns what it held."""
        record = self._records.pop(group_id)
        self._index(record, -1)
        prompt = self._prompts.pop(group_id)
        partial = self._partial.pop(group_id)
        del self._episodes[group_id]
        return record, prompt, tuple(sorted(partial.values(), key=lambda r: r.index))

    def _index(self, record: LedgerRecord, sign: int) -> None:
        if record.phase is Phase.RESERVED:
            members = self._reserved.setdefault(record.admission_id, [])
            if sign > 0:
                members.append(record.group_id)
            else:
                members.remove(record.group_id)
                if not members:
                    del self._reserved[record.admission_id]
        elif record.target_step is not None:
            self._per_step[record.target_step] += sign
            if self._per_step[record.target_step] == 0:
                del self._per_step[record.target_step]

    def partial(self, group_id: str) -> dict[int, Rollout]:
        """The finished rollouts of a group, by rollout index (mutable, owned by the ledger)."""
        return self._partial[group_id]

    def episodes(self, group_id: str) -> dict[int, EpisodeState]:
        """The finished turns of a group's unfinished episodes, by rollout index (mutable, owned
        by the ledger)."""
        return self._episodes[group_id]

    def records(self) -> list[LedgerRecord]:
        """Every record, in loader order."""
        return sorted(self._records.values(), key=lambda r: r.order)

    def oldest_reserved(self) -> list[LedgerRecord] | None:
        """The RESERVED batch that was taken first (in loader order), or None."""
        for members in self._reserved.values():
            return sorted((self._records[g] for g in members), key=lambda r: r.order)
        return None

    def has_reserved(self) -> bool:
        """Whether any batch waits at the gate."""
        return bool(self._reserved)

    def count_stamped(self, step: int) -> int:
        """ADMITTED groups stamped for ``step``."""
        return self._per_step.get(step, 0)
