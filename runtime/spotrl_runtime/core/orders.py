"""A set of loader orders kept as sorted, disjoint ``[start, end)`` intervals. Pure.

The owners use one for the orders that left every live owner (trained, or dropped): they
leave roughly in loader order, so the set stays a handful of intervals however long the
run. A cut persists it, and check ``coverage`` proves with it that every order the loader
handed out has exactly one owner.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from typing import Any


class OrderSet:
    """Non-negative integers as sorted disjoint half-open intervals."""

    def __init__(self, intervals: Iterable[tuple[int, int]] = ()):
        """The set of the given intervals, which must be ascending, non-empty, non-negative and
        separated (the form :meth:`intervals` returns); raises ``ValueError`` otherwise."""
        self._starts: list[int] = []
        self._ends: list[int] = []
        for start, end in intervals:
            if not (isinstance(start, int) and isinstance(end, int)) or not 0 <= start < end:
                raise ValueError(f"interval [{start!r}, {end!r}) is not a non-empty range of orders >= 0")
            if self._ends and start <= self._ends[-1]:
                raise ValueError(
                    f"interval [{start}, {end}) overlaps or touches [{self._starts[-1]}, {self._ends[-1]}) "
                    "or comes before it (intervals must be ascending and separated)"
                )
            self._starts.append(start)
            self._ends.append(end)

    def __contains__(self, order: int) -> bool:
        i = bisect_right(self._starts, order) - 1
        return i >= 0 and order < self._ends[i]

    def __len__(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends, strict=True))

    def add(self, order: int) -> bool:
        """Adds ``order``; False (and no change) if it was there already."""
        if order < 0:
            raise ValueError(f"orders are >= 0, got {order}")
        i = bisect_right(self._starts, order) - 1
        if i >= 0 and order < self._ends[i]:
            return False
        joins_left = i >= 0 and self._ends[i] == order
        joins_right = i + 1 < len(self._starts) and self._starts[i + 1] == order + 1
        if joins_left and joins_right:
            self._ends[i] = self._ends[i + 1]
            del self._starts[i + 1], self._ends[i + 1]
        elif joins_left:
            self._ends[i] = order + 1
        elif joins_right:
            self._starts[i + 1] = order
        else:
            self._starts.insert(i + 1, order)
            self._ends.insert(i + 1, order + 1)
        return True

    def intervals(self) -> list[tuple[int, int]]:
        """The set as ``[start, end)`` pairs, ascending."""
        return list(zip(self._starts, self._ends, strict=True))

    def to_json(self) -> list[list[int]]:
        return [[s, e] for s, e in self.intervals()]

    @classmethod
    def from_json(cls, data: Any) -> OrderSet:
        """Parses :meth:`to_json`'s form; raises ``ValueError`` saying what is wrong."""
        if not isinstance(data, list) or any(not isinstance(p, list) or len(p) != 2 for p in data):
            raise ValueError("must be a list of [start, end] pairs")
        return cls((p[0], p[1]) for p in data)
