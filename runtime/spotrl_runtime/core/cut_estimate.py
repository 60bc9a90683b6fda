"""How long a barrier cut would take now, from the cuts already committed, and whether that
fits the shortest barrier window the job may get. Pure.

The controller feeds :class:`CutEstimator` every committed cut (its bytes, its seconds from
request to commit, the seconds its files took, its step and commit time) and publishes
:meth:`CutEstimator.estimate` as ``status.cutEstimate``; the operator compares it with the
shortest window (:func:`assess`) and says so with the ``BarrierAtRisk`` condition.

The model: a cut is a fixed part (capture under the lock, the manifest, the pointer, the
listing: everything but the files) plus its bytes over the store's throughput. A barrier
cut writes the same owners and trainer files as a periodic one, so the newest cut's size
is the state size a barrier would write now. Both parts come from the last few cuts and
lean to the safe side: the throughput is their bytes over their seconds together (one slow
cut pulls it down for the next few), or the newest cut's if that is slower (a store that just
slowed down counts at once); the fixed part is the largest seen.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

RECENT_CUTS = 5
"""Cuts an estimate is made from: the store's speed now, not at the start of the run."""

HEADROOM = 0.8
"""A barrier fits when its estimate is within this share of the window: the rest is for the
operator's request, the controller's answer and a cut slower than the last ones."""

CLEAR_HEADROOM = 0.7
"""A job at risk fits again only when its estimate is within this (smaller) share of the
window: an estimate hovering at :data:`HEADROOM` does not flip the condition, and send an
Event, on every cut."""

BUSY_RISK = 0.1
"""A barrier that finds a periodic cut being written waits for it. When the cut writer is busy
with periodic cuts this share of the time or more, a barrier is judged on that wait too."""


@dataclass(frozen=True)
class CutSample:
    """One committed cut, as the estimator needs it."""

    kind: str
    bytes: int
    seconds: float
    """From the cut's request to its committed manifest."""
    files_seconds: float
    """The part spent writing its files (the bytes); the rest is the fixed part."""
    step: int
    at: float
    """Unix time of its commit."""


@dataclass(frozen=True)
class CutEstimate:
    """A barrier cut's predicted seconds for the current state size."""

    seconds: float
    bytes: int
    """The newest cut's size: what a barrier would write now."""
    bytes_per_second: float
    overhead_seconds: float
    based_on_cuts: int
    step_seconds: float | None = None
    """Wall seconds per optimizer step between cuts (None: not yet two cuts steps apart)."""


class CutEstimator:
    """A running estimate over the last :data:`RECENT_CUTS` committed cuts. ``waits_for_step``:
    a barrier waits for a running optimizer step to end (a trainer group's ranks must finish
    it; one process stops it between micro-batches), so a step's seconds count as fixed."""

    def __init__(self, recent: int = RECENT_CUTS, *, waits_for_step: bool = False):
        if recent < 1:
            raise ValueError("recent must be at least 1")
        self._cuts: deque[CutSample] = deque(maxlen=recent)
        self.waits_for_step = waits_for_step

    def add_cut(
        self, *, kind: str, bytes: int, seconds: float, timings: Mapping[str, float], step: int, at: float
    ) -> CutEstimate | None:
        """Feeds one committed cut (``timings``: the writer's, ``files`` among them) and
        returns the new estimate."""
        files = float(timings.get("files", 0.0) or 0.0)
        seconds = max(float(seconds), files)
        self._cuts.append(CutSample(kind, max(0, int(bytes)), seconds, files, int(step), float(at)))
        return self.estimate()

    def estimate(self) -> CutEstimate | None:
        return estimate(list(self._cuts), waits_for_step=self.waits_for_step)


def estimate(cuts: list[CutSample], *, waits_for_step: bool = False) -> CutEstimate | None:
    """The estimate from ``cuts`` (oldest first); None without a cut that wrote bytes.
    ``waits_for_step``: the fixed part includes a step's seconds (once two cuts tell them)."""
    cuts = [c for c in cuts if c.bytes > 0]
    if not cuts:
        return None
    # A cut whose files took no measurable time (a tiny cut, or no timings): all of it counts
    # as writing bytes, so the throughput is never infinite.
    transfer = sum(c.files_seconds if c.files_seconds > 0 else c.seconds for c in cuts)
    total_bytes = sum(c.bytes for c in cuts)
    rate = total_bytes / transfer if transfer > 0 else math.inf
    newest = cuts[-1].files_seconds if cuts[-1].files_seconds > 0 else cuts[-1].seconds
    if newest > 0:
        rate = min(rate, cuts[-1].bytes / newest)  # a store that just slowed down counts at once
    overhead = max(max(0.0, c.seconds - c.files_seconds) if c.files_seconds > 0 else 0.0 for c in cuts)
    step_seconds = _step_seconds(cuts)
    if waits_for_step and step_seconds:
        overhead += step_seconds
    size = cuts[-1].bytes
    seconds = overhead + (size / rate if math.isfinite(rate) else 0.0)
    return CutEstimate(
        seconds=round(seconds, 3),
        bytes=size,
        bytes_per_second=round(rate, 1) if math.isfinite(rate) else 0.0,
        overhead_seconds=round(overhead, 3),
        based_on_cuts=len(cuts),
        step_seconds=step_seconds,
    )


def _step_seconds(cuts: list[CutSample]) -> float | None:
    per_step = [
        (b.at - a.at) / (b.step - a.step) for a, b in itertools.pairwise(cuts) if b.step > a.step and b.at > a.at
    ]
    return round(statistics.median(per_step), 3) if per_step else None


# ------------------------------------------------------------------------- the decision


@dataclass(frozen=True)
class Assessment:
    at_risk: bool
    message: str
    budget_seconds: float
    """The share of the window a barrier may take (:data:`HEADROOM`)."""
    worst_seconds: float
    """A barrier that finds a periodic cut being written: it waits for that cut first."""
    busy_share: float | None = None
    """How much of the time the cut writer is busy with periodic cuts (None: unknown)."""
    every_steps_to_fit: int | None = None
    """A periodic cadence (steps) to set: as often as the store takes cuts when a barrier
    cannot fit anyway, or rarely enough that a barrier seldom waits behind one."""


def _mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB"


def busy_share(est: CutEstimate, every_steps: int, every_seconds: int) -> float | None:
    """The share of the time the cut writer is busy with periodic cuts (None: unknown)."""
    periods = [float(every_seconds)] if every_seconds > 0 else []
    if every_steps > 0 and est.step_seconds:
        periods.append(every_steps * est.step_seconds)
    return min(1.0, est.seconds / min(periods)) if periods else None


def assess(
    est: CutEstimate,
    window_seconds: float,
    *,
    every_steps: int,
    every_seconds: int,
    window_source: str = "",
    was_at_risk: bool = False,
    delta_every_steps: int = 0,
) -> Assessment:
    """Whether a barrier cut of ``est`` fits ``window_seconds`` (the shortest deadline the
    job may get; ``window_source`` says whose it is), and if not, what an abrupt loss would
    cost under the job's periodic cuts and what would fit.

    One writer writes every cut, so a barrier that arrives while a periodic cut is being
    written waits for it: up to two cuts' time. That counts when the writer is busy at
    least :data:`BUSY_RISK` of the time. A job that ``was_at_risk`` is judged against
    :data:`CLEAR_HEADROOM` of the window instead of :data:`HEADROOM` (hysteresis)."""
    share = CLEAR_HEADROOM if was_at_risk else HEADROOM
    budget = window_seconds * share
    whose = f" ({window_source})" if window_source else ""
    window = f"{budget:.1f} s ({share:.0%}) of the shortest barrier window, {window_seconds:g} s{whose}"
    what = (
        f"a barrier cut is estimated at {est.seconds:.1f} s ({_mb(est.bytes)} at {_mb(est.bytes_per_second)}/s "
        f"+ {est.overhead_seconds:.1f} s fixed, from the last {est.based_on_cuts} cut(s))"
    )
    busy = busy_share(est, every_steps, every_seconds)
    worst = 2 * est.seconds
    behind = (
        f"the cut writer is busy with periodic cuts ~{busy:.0%} of the time, and a barrier that finds "
        f"one being written waits for it: up to {worst:.1f} s"
        if busy
        else ""
    )
    alone_fits = est.seconds <= budget
    waits = busy is not None and busy >= BUSY_RISK and worst > budget
    if alone_fits and not waits:
        msg = f"{what}, within {window}"
        if busy and worst > budget:
            msg += f"; {behind}"
        return Assessment(False, msg, budget, worst, busy)
    step = est.step_seconds
    if alone_fits:
        # Only the wait behind a periodic cut does not fit: fewer periodic cuts would.
        parts = [
            f"{what}, within {window}, but {behind}: a notice then may end in BarrierMissed, "
            "and the job resume from its newest periodic cut"
        ]
        fits = []
        fit_steps = None
        if step and step > 0:
            fit_steps = math.ceil(est.seconds / (BUSY_RISK * step))
            fits.append(
                f"periodic cuts less often (checkpoint.everySteps={fit_steps} keeps the writer busy under "
                f"{BUSY_RISK:.0%} of the time; an abrupt loss then costs up to ~{fit_steps * step:.0f} s)"
            )
        room = budget / 2 - est.overhead_seconds
        if room > 0:
            fits.append(f"a store that writes at least {_mb(est.bytes / room)}/s")
        fits.append("a longer window (spec.checkpoint.barrierDeadlineSeconds, signals.deadlineCaps)")
        parts.append("what would fit: " + ", or ".join(fits))
        return Assessment(True, "; ".join(parts), budget, worst, busy, fit_steps)
    parts = [
        f"{what}, over {window}: a notice that short will likely end in BarrierMissed, and the job "
        "resume from its newest periodic cut"
    ]
    bounds = []
    if delta_every_steps > 0 and (every_steps == 0 or delta_every_steps < every_steps):
        # Delta cuts between the full ones bound the loss tighter.
        about = f" (~{delta_every_steps * step:.0f} s)" if step else ""
        bounds.append(f"checkpoint.deltaEverySteps={delta_every_steps} steps{about}")
    else:
        if every_steps > 0:
            about = f" (~{every_steps * step:.0f} s)" if step else ""
            bounds.append(f"checkpoint.everySteps={every_steps} steps{about}")
        if every_seconds > 0:
            bounds.append(f"checkpoint.everySeconds={every_seconds} s")
    parts.append("an abrupt loss then costs up to " + " or ".join(bounds) + " of training")
    fits = []
    room = budget - est.overhead_seconds
    if room > 0:
        fits.append(f"a store that writes at least {_mb(est.bytes / room)}/s")
    else:
        fits.append(f"a store with less than {budget:.1f} s of fixed cost (now {est.overhead_seconds:.1f} s)")
    fits.append("a longer window (spec.checkpoint.barrierDeadlineSeconds, signals.deadlineCaps)")
    parts.append("what would fit: " + ", or ".join(fits))
    fit_steps = None
    if step and step > 0 and every_steps != 1 and delta_every_steps == 0:
        # A periodic cut is written in the background, but the next waits for it: cuts can
        # come no more often than one cut's time.
        k = max(1, math.ceil(est.seconds / step))
        if every_steps == 0 or k < every_steps:
            fit_steps = k
            parts.append(
                f"until then, set checkpoint.everySteps to {k} to lose at most {k} step(s) (~{k * step:.0f} s)"
            )
    return Assessment(True, "; ".join(parts), budget, worst, busy, fit_steps)


def barrier_form(
    mode: str, est: CutEstimate | None, remaining: float, *, delta_possible: str | None
) -> tuple[Literal["full", "delta"], str]:
    """What a barrier cut holds, and why. ``mode`` is ``spec.checkpoint.barrier``; ``est`` the
    full cut's estimate; ``remaining`` the seconds left before the barrier's deadline;
    ``delta_possible`` None when a delta can be cut, else why not (no full cut to extend yet,
    a redo log that lacks a step since it). ``auto`` cuts full when the estimate fits
    :data:`HEADROOM` of what is left."""
    if mode == "full":
        return "full", "checkpoint.barrier is full"
    if delta_possible is not None:
        return "full", f"a delta cut is not possible: {delta_possible}"
    if mode == "delta":
        return "delta", "checkpoint.barrier is delta"
    if est is None:
        return "delta", "no full cut of this controller measured yet"
    if est.seconds <= remaining * HEADROOM:
        return "full", f"a full cut is estimated at {est.seconds:.1f} s, within {HEADROOM:.0%} of {remaining:.1f} s"
    return "delta", f"a full cut is estimated at {est.seconds:.1f} s, over {HEADROOM:.0%} of the {remaining:.1f} s left"
