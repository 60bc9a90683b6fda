"""The spare pool: whole batches set aside to replace prompts that are given up on.

Spares are taken from the loader a batch at a time and handed out one prompt at a time,
oldest first. Each spare already has its ``group_id`` (ids are given when a prompt leaves
the loader), so a spare keeps its identity when it is dispatched.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from spotrl_runtime.core.fields import RecordFormatError, require_int, require_str
from spotrl_runtime.core.types import Prompt


@dataclass(frozen=True)
class Spare:
    """One prompt in the spare pool, by locator (the prompt itself is held in memory only)."""

    group_id: str
    batch_id: str
    """The admission id of the loader batch it came in."""
    order: int
    idx: int
    task_name: str
    fingerprint: str = ""

    def to_json(self) -> dict[str, Any]:
        """The persisted form (locators only)."""
        return {
            "group_id": self.group_id,
            "batch_id": self.batch_id,
            "order": self.order,
            "idx": self.idx,
            "task_name": self.task_name,
            "fingerprint": self.fingerprint,
        }

    @classmethod
    def from_json(cls, data: Any) -> Spare:
        """Parses a persisted spare; raises :class:`RecordFormatError` naming the bad field."""
        if not isinstance(data, dict):
            raise RecordFormatError("spare is not a JSON object")
        return cls(
            group_id=require_str(data, "group_id"),
            batch_id=require_str(data, "batch_id"),
            order=require_int(data, "order"),
            idx=require_int(data, "idx"),
            task_name=require_str(data, "task_name"),
            fingerprint=require_str(data, "fingerprint", allow_empty=True),
        )


class SparePool:
    """Spares in the order they came from the loader, each with its live prompt."""

    def __init__(self) -> None:
        self._spares: deque[tuple[Spare, Prompt]] = deque()

    def __len__(self) -> int:
        return len(self._spares)

    def add(self, spare: Spare, prompt: Prompt) -> None:
        """Appends one spare (the loader's batch order is kept)."""
        self._spares.append((spare, prompt))

    def pop(self) -> tuple[Spare, Prompt]:
        """Hands out the oldest spare."""
        return self._spares.popleft()

    def items(self) -> list[tuple[Spare, Prompt]]:
        """Every spare with its live prompt, oldest first."""
        return list(self._spares)

    def spares(self) -> list[Spare]:
        """Every spare, oldest first."""
        return [s for s, _ in self._spares]
