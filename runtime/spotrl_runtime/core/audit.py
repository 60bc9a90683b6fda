"""The audit: which prompts each trained step consumed, machine-checkable across preemptions.

One :class:`AuditRecord` per trained step per attempt (controller incarnation). After an
abrupt loss the steps since the last cut are trained again by a later attempt, so a step
can have several records; the *effective stream* keeps the last one per step (the highest
attempt). A run preempted any number of times must have the same effective stream as one
that never was.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from spotrl_runtime.core.fields import RecordFormatError, require_int, require_str

DROPPED = "dropped"
"""A prompt given up on: its generation or its reward failed (``maxRetries``, ``reward.onError: drop``)."""
FILTERED = "filtered"
"""A prompt a filter refused, for a reason about the prompt itself (e.g. ``prompt_too_long``), not a failure."""
LEFT_STATES = (DROPPED, FILTERED)


@dataclass(frozen=True)
class DroppedPrompt:
    """A prompt that left the run untrained, with its ``state`` (:data:`DROPPED` or
    :data:`FILTERED`) and its reason. Either way its place in the step is filled as
    ``preemption.onDroppedPrompt`` says, and it is never generated again."""

    group_id: str
    idx: int
    task_name: str
    reason: str
    state: str = DROPPED

    def __post_init__(self) -> None:
        if self.state not in LEFT_STATES:
            raise RecordFormatError(f"state is {self.state!r}, not one of {', '.join(LEFT_STATES)}")

    def to_json(self) -> dict[str, Any]:
        out = {"group_id": self.group_id, "idx": self.idx, "task_name": self.task_name, "reason": self.reason}
        # Written only when not the default, so the records and cuts of runs that filter nothing
        # stay byte for byte what they were.
        return out if self.state == DROPPED else out | {"state": self.state}

    @classmethod
    def from_json(cls, data: Any) -> DroppedPrompt:
        if not isinstance(data, dict):
            raise RecordFormatError("dropped prompt is not a JSON object")
        return cls(
            require_str(data, "group_id"),
            require_int(data, "idx"),
            require_str(data, "task_name"),
            require_str(data, "reason", allow_empty=True),
            str(data.get("state", DROPPED)),
        )


@dataclass(frozen=True)
class AuditRecord:
    """One trained step: its prompts (in the order trained), the resulting policy version, the attempt."""

    step: int
    attempt: int
    weight_version: int
    group_ids: tuple[str, ...]
    idxs: tuple[int, ...]
    task_names: tuple[str, ...]
    dropped: tuple[DroppedPrompt, ...] = ()
    rounds: int = 0
    """Dynamic sampling: the refill rounds the step took (0: its groups are its own batch's)."""

    @property
    def prompts(self) -> tuple[tuple[int, str], ...]:
        """The locators trained, in order."""
        return tuple(zip(self.idxs, self.task_names, strict=True))

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "attempt": self.attempt,
            "weight_version": self.weight_version,
            "group_ids": list(self.group_ids),
            "idxs": list(self.idxs),
            "task_names": list(self.task_names),
            "dropped": [d.to_json() for d in self.dropped],
        } | ({"rounds": self.rounds} if self.rounds else {})

    @classmethod
    def from_json(cls, data: Any) -> AuditRecord:
        if not isinstance(data, dict):
            raise RecordFormatError("audit record is not a JSON object")
        lists = {k: data.get(k) for k in ("group_ids", "idxs", "task_names", "dropped")}
        for key, value in lists.items():
            if not isinstance(value, list):
                raise RecordFormatError(f"{key} must be a list, got {value!r}")
        group_ids, idxs, task_names, dropped = (list(v or ()) for v in lists.values())
        if not len(group_ids) == len(idxs) == len(task_names):
            raise RecordFormatError("group_ids, idxs and task_names must have one entry per trained group")
        if not all(isinstance(g, str) and g for g in group_ids) or not all(isinstance(t, str) for t in task_names):
            raise RecordFormatError("group_ids and task_names must be strings")
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in idxs):
            raise RecordFormatError(f"idxs must be integers >= 0, got {idxs!r}")
        return cls(
            step=require_int(data, "step"),
            attempt=require_int(data, "attempt"),
            weight_version=require_int(data, "weight_version"),
            group_ids=tuple(group_ids),
            idxs=tuple(idxs),
            task_names=tuple(task_names),
            dropped=tuple(DroppedPrompt.from_json(d) for d in dropped),
            rounds=require_int(data, "rounds") if "rounds" in data else 0,
        )


def effective_stream(records: Iterable[AuditRecord]) -> dict[int, AuditRecord]:
    """The last record per step: highest attempt wins; within an attempt, the later record."""
    out: dict[int, AuditRecord] = {}
    for rec in records:
        prev = out.get(rec.step)
        if prev is None or rec.attempt >= prev.attempt:
            out[rec.step] = rec
    return dict(sorted(out.items()))


class AuditLog:
    """The records of this process, newest last; keeps the newest ``keep`` for the cut's tail."""

    def __init__(self, keep: int = 1024, records: Iterable[AuditRecord] = ()):
        self.keep = keep
        self._records: list[AuditRecord] = list(records)[-keep:]

    def append(self, record: AuditRecord) -> None:
        self._records.append(record)
        if len(self._records) > 2 * self.keep:
            del self._records[: len(self._records) - self.keep]

    def tail(self) -> tuple[AuditRecord, ...]:
        """The newest ``keep`` records, oldest first."""
        return tuple(self._records[-self.keep :])
