"""The one way a benchmark states its targets and, with ``--check``, fails when one is missed.

A target is the figure a benchmark names as its goal: a ratio against a baseline measured in
the same run (the machines' speed changes from one hour to the next, a ratio much less), or,
where the benchmark's goal is a bound of its own (``bench_operator_scale.py``'s p95 ≤ 2 s), that
bound. Each script records every target it measured and ends with :meth:`Targets.report`: it
prints each, met or NOT met, and with ``--check`` (``make bench-check``) a missed one ends the
script with exit status 1 and a line naming the target and the figure measured, so that a
regression is not one more line of a table nobody reads.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Target:
    name: str
    """What was measured against what, e.g. ``100m, first cut: SIGTERM→cut / torch.save + fsync``."""
    value: float
    goal: float
    at_most: bool = True
    """True: met when ``value <= goal``; False: when ``value >= goal``."""

    @property
    def met(self) -> bool:
        # A NaN (a baseline of 0, a figure not measured) compares False either way: missed.
        return self.value <= self.goal if self.at_most else self.value >= self.goal

    def __str__(self) -> str:
        sign = "≤" if self.at_most else "≥"
        value = f"{self.value:.4g}" if math.isfinite(self.value) else str(self.value)
        return f"{self.name}: {value} (goal {sign} {self.goal:g}): {'met' if self.met else 'NOT met'}"


@dataclass
class Targets:
    items: list[Target] = field(default_factory=list)

    def at_most(self, name: str, value: float, goal: float) -> bool:
        """Records a target met when ``value <= goal``; returns whether it was met."""
        self.items.append(Target(name, value, goal, at_most=True))
        return self.items[-1].met

    def at_least(self, name: str, value: float, goal: float) -> bool:
        """Records a target met when ``value >= goal``; returns whether it was met."""
        self.items.append(Target(name, value, goal, at_most=False))
        return self.items[-1].met

    def failure(self, check: bool) -> str | None:
        """What the script exits with: None without ``check``, or when every target is met.
        A check that measured no target fails too: flags that skip the measured parts would
        otherwise pass it by measuring nothing."""
        if not check:
            return None
        if not self.items:
            return "--check: no target was measured in this run (the parts with a goal did not run)"
        missed = [t for t in self.items if not t.met]
        if not missed:
            return None
        return f"--check: {len(missed)} of {len(self.items)} targets missed: " + "; ".join(map(str, missed))

    def report(self, check: bool) -> None:
        """Prints every target; with ``check``, a missed one ends the script (exit status 1)."""
        if self.items:
            print("\ntargets:")
        for t in self.items:
            print(f"  {t}")
        failed = self.failure(check)
        if failed:
            raise SystemExit(failed)


def add_check(parser: argparse.ArgumentParser) -> None:
    """The ``--check`` flag every benchmark with a target takes."""
    parser.add_argument(
        "--check", action="store_true", help="exit 1, naming it, when a target is missed (make bench-check)"
    )
