"""When the trainer takes its periodic cuts: the pure schedule, no clock of its own.

Two kinds, so that a loss without notice (a kernel panic, an OOM kill, a VM reclaimed past its
PodDisruptionBudget) costs at most one step:

- **full cuts** (weights and optimizer) every ``everySteps`` steps or ``everySeconds`` seconds.
  One that falls due is captured when the next step's groups are all finished, just before
  the step begins: it is still that step boundary, and the groups then in flight were admitted
  with the weights it holds (lookahead 1), so a resume from it generates each with its
  admission version;
- **delta cuts** (the owners and the rows of every step since the newest full cut, megabytes
  at any model size) between them: after every ``deltaEverySteps`` steps, captured right after
  the step's commit (the writer writes it while the trainer waits for the next step's groups),
  and every ``deltaEverySeconds`` while the trainer waits (a long step's finished groups).
  A delta needs a full cut to extend: a run without one takes a full cut at its first step.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CutSchedule:
    """The cadence of one controller's periodic cuts. ``now`` is any monotonic clock's seconds."""

    every_steps: int
    every_seconds: float
    delta_every_steps: int
    delta_every_seconds: float
    last_full_at: float
    """When the last full cut was captured (or the controller started)."""
    last_cut_at: float
    """When the last cut of either kind was captured."""
    last_cut_step: int
    """The trainer step the last cut was captured at."""
    full_due: str | None = None
    """Why a full cut is due at the next step boundary whose groups are ready (None: none is)."""
    based: bool = False
    """A full cut exists for deltas to extend: the one the run resumed from, or one this
    controller captured (it commits before the deltas after it: one writer writes them in order)."""

    @property
    def deltas(self) -> bool:
        """Whether delta cuts are taken between full cuts."""
        return self.delta_every_steps > 0 or self.delta_every_seconds > 0

    def after_step(self, step: int) -> str | None:
        """The trainer committed up to ``step``. Returns why to capture a delta now, if one is
        due (a full cut that falls due instead is kept in :attr:`full_due`)."""
        if self.every_steps and step % self.every_steps == 0:
            self.full_due = f"every {self.every_steps} steps"
            return None
        if self.delta_every_steps and self.based and step - self.last_cut_step >= self.delta_every_steps:
            return f"every {self.delta_every_steps} step(s), delta"
        return None

    def while_waiting(self, now: float) -> str | None:
        """The trainer waits for the next step's groups. Marks a full cut due after
        ``everySeconds``; returns why to capture a delta now after ``deltaEverySeconds``."""
        if self.every_seconds and now - self.last_full_at >= self.every_seconds:
            self.full_due = self.full_due or f"every {self.every_seconds:g} s"
        waited = now - self.last_cut_at >= self.delta_every_seconds
        if self.full_due is None and self.delta_every_seconds and self.based and waited:
            return f"every {self.delta_every_seconds:g} s, delta"
        return None

    def at_ready(self) -> str | None:
        """The next step's groups are all finished. Returns why to capture a full cut now."""
        if self.full_due is not None:
            return self.full_due
        if self.deltas and not self.based:
            return "a full cut for the delta cuts to extend"
        return None

    def taken(self, form: str, step: int, now: float) -> None:
        """A cut of ``form`` (``full`` or ``delta``) was captured at ``step``."""
        if form == "full":
            self.full_due = None
            self.based = True
            self.last_full_at = now
        self.last_cut_at = now
        self.last_cut_step = step
