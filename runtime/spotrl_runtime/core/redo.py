"""The redo log: what the trainer trained on since the newest committed full cut. Pure: no I/O.

A full cut holds the weights and the optimizer, which grow with the model; a **delta cut**
holds the owners and this log instead, and names the full cut it extends (its *base*). A
resume from a delta loads the base's trainer state and trains the logged steps again from
their rows, in their recorded order, with no generation; each redone step must reproduce
the step's recorded :class:`StepFingerprint`.

One :class:`RedoStep` per trained step: its finished groups in the order the step trained
them (the replay buffer's entries, rows and all) and the fingerprint of the step. The owners
append a step when it commits and drop the steps a committed full cut includes
(:meth:`RedoLog.trim`).

In a delta cut the log is two files, whose format is :mod:`~spotrl_runtime.core.cut_format`'s:
``redo.json`` (role ``redo_index``: per step, the groups' locators, as the replay index has
them, and the fingerprint) and ``redo_rows.bin`` (role ``redo_rows``: the rows, in the replay
buffer's row format).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from spotrl_runtime.core.fields import RecordFormatError, require_int, require_str
from spotrl_runtime.core.replay_buffer import ReplayEntry

EXACT = "exact"
"""How a redone step is compared with its record when both ran in one CPU process: bit for bit."""
RELATIVE_TOLERANCE = 1e-3
"""Otherwise (another device or rank count): loss and gradient norm within this relative error."""


@dataclass(frozen=True)
class StepFingerprint:
    """What a trained step produced, cheap to record and to compare: the loss, the gradient norm
    (before clipping) and a digest of a few slices of the parameters after the optimizer step.
    ``where`` is the trainer that took it (``cpu/1``: one CPU process); only two steps taken
    in one CPU process each are compared bit for bit. ``layout`` is how the step's updates were
    laid out (``training.miniBatches`` and ``epochs``; "" for one update a step, and in every
    record written before mini-batches): a redo under another layout is refused by it."""

    loss: float
    grad_norm: float
    params: str
    where: str
    layout: str = ""

    def to_json(self) -> dict[str, Any]:
        out = {"loss": self.loss, "grad_norm": self.grad_norm, "params": self.params, "where": self.where}
        return out | ({"layout": self.layout} if self.layout else {})

    @classmethod
    def from_json(cls, data: Any) -> StepFingerprint:
        if not isinstance(data, dict):
            raise RecordFormatError("fingerprint is not a JSON object")
        values: list[float] = []
        for key in ("loss", "grad_norm"):
            v = data.get(key)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
                raise RecordFormatError(f"fingerprint {key} must be a finite number, got {v!r}")
            values.append(float(v))
        layout = data.get("layout", "")
        if not isinstance(layout, str):
            raise RecordFormatError(f"fingerprint layout must be a string, got {layout!r}")
        params = require_str(data, "params", allow_empty=True)
        return cls(values[0], values[1], params, require_str(data, "where"), layout)

    def mismatch(self, redone: StepFingerprint) -> str | None:
        """None when ``redone`` reproduces this record, else what differs."""
        if self.layout != redone.layout:
            return (
                f"the step was trained with {_layout(self.layout)} and is redone with {_layout(redone.layout)} "
                "(training.miniBatches, epochs or packing changed since)"
            )
        if self.where == redone.where == "cpu/1":
            for name in ("loss", "grad_norm", "params"):
                if getattr(self, name) != getattr(redone, name):
                    return (
                        f"{name} is {getattr(redone, name)!r} on redo, {getattr(self, name)!r} when trained "
                        "(one CPU process each: they must be equal bit for bit)"
                    )
            return None
        for name in ("loss", "grad_norm"):
            a, b = getattr(self, name), getattr(redone, name)
            if abs(a - b) > RELATIVE_TOLERANCE * max(abs(a), abs(b), 1e-6):
                return (
                    f"{name} is {b!r} on redo ({redone.where}), {a!r} when trained ({self.where}): more than "
                    f"{RELATIVE_TOLERANCE:g} apart"
                )
        return None


@dataclass(frozen=True)
class RedoStep:
    """One trained step: its groups in the order trained, and its fingerprint."""

    step: int
    entries: tuple[ReplayEntry, ...]
    fingerprint: StepFingerprint

    @property
    def group_ids(self) -> tuple[str, ...]:
        return tuple(e.group_id for e in self.entries)


@dataclass(frozen=True)
class DeltaBase:
    """The full cut a delta extends: its id, its manifest's sha256, its trainer step."""

    cut_id: str
    manifest_sha256: str
    trainer_step: int

    def to_json(self) -> dict[str, Any]:
        return {"cut_id": self.cut_id, "manifest_sha256": self.manifest_sha256, "trainer_step": self.trainer_step}

    @classmethod
    def from_json(cls, data: Any) -> DeltaBase:
        if not isinstance(data, dict):
            raise RecordFormatError("base must be a JSON object")
        digest = require_str(data, "manifest_sha256")
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise RecordFormatError("base.manifest_sha256 is not 64 lowercase hex digits")
        return cls(require_str(data, "cut_id"), digest, require_int(data, "trainer_step"))


class RedoLog:
    """The steps trained since the newest committed full cut, oldest first. Not thread-safe by
    itself: the owners' lock guards it."""

    def __init__(self, steps: Iterable[RedoStep] = ()):
        self._steps: list[RedoStep] = list(steps)

    def append(self, step: RedoStep) -> None:
        if self._steps and step.step != self._steps[-1].step + 1:
            raise ValueError(f"redo step {step.step} does not follow step {self._steps[-1].step}")
        self._steps.append(step)

    def trim(self, before: int) -> int:
        """Drops the steps below ``before`` (a committed full cut at that trainer step holds
        them); returns how many were dropped."""
        keep = [s for s in self._steps if s.step >= before]
        dropped = len(self._steps) - len(keep)
        self._steps = keep
        return dropped

    def steps(self) -> tuple[RedoStep, ...]:
        return tuple(self._steps)

    def __len__(self) -> int:
        return len(self._steps)


def _layout(layout: str) -> str:
    """A fingerprint's layout in words: "" is one update a step of padded rows."""
    parts = layout.split(",") if layout else []
    words = ",".join(p for p in parts if p != "packed") or "one update"
    return words + (", packed" if "packed" in parts else "")
