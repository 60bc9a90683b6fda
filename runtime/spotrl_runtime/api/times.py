"""Times as the Kubernetes API writes them, and a barrier's deadline: one module for the
operator and the runtime.

Status fields are RFC 3339 strings in UTC (:func:`rfc3339`; Leases use microseconds,
:func:`rfc3339_micro`); :func:`parse` reads any RFC 3339 form. A barrier's deadline enters the
controller once as a :class:`Deadline` (a monotonic instant) and keeps that form down to the
cut writer, so no wall-clock step on the node moves it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime


def rfc3339(t: datetime | float) -> str:
    """``t`` (an aware datetime, or Unix seconds) in UTC, second precision, as Kubernetes writes times."""
    when = datetime.fromtimestamp(t, UTC) if isinstance(t, int | float) else t.astimezone(UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def rfc3339_micro(t: datetime | None = None) -> str:
    """A MicroTime (Lease fields): microsecond precision, UTC; default now."""
    return (t or datetime.now(UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse(t: str | None) -> datetime | None:
    """RFC 3339 (any precision, ``Z`` or an offset) as an aware UTC datetime; a time without a
    zone is UTC; None for None or "". Raises ValueError for anything else."""
    if not t:
        return None
    parsed = datetime.fromisoformat(t)
    return parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)


def unix(t: str | None) -> float | None:
    """:func:`parse` as Unix seconds."""
    parsed = parse(t)
    return None if parsed is None else parsed.timestamp()


@dataclass(frozen=True)
class Deadline:
    """When a barrier cut must have committed, as a ``time.monotonic()`` instant."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds)

    @classmethod
    def at_unix(cls, t: float) -> Deadline:
        """From a wall-clock time (the RLJob's ``status.barrier.deadline``)."""
        return cls.after(t - time.time())

    def remaining(self) -> float:
        """Seconds left (negative once passed)."""
        return self.at - time.monotonic()

    def unix(self) -> float:
        """As a wall-clock time, for people and logs."""
        return time.time() + self.remaining()
