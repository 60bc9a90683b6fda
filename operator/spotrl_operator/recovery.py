"""One recovery, phase by phase, pure: the operator's marks and the controller's times composed
into ``status.lastRecovery``.

The operator knows the first half (the notice, the barrier request, the commit, the old pod
gone) and keeps it on ``status.recovering``, since ``status.barrier`` is cleared when the next
attempt starts; the fresh pod's ``PodScheduled`` time comes from the pod; the controller
publishes the rest on ``status.attemptTimes`` (process started, cut restored, generation
ready, first trained step). :func:`compose` runs once the new attempt's first step is seen.
"""

from __future__ import annotations

from datetime import datetime

from spotrl_runtime.api import times
from spotrl_runtime.api.rljob import AttemptTimes, LastRecovery, RecoveryMarks, RecoveryPhases

PHASES: tuple[tuple[str, str], ...] = (
    ("notice_to_requested", "notice->requested"),
    ("requested_to_committed", "requested->committed"),
    ("committed_to_deleted", "committed->deleted"),
    ("deleted_to_scheduled", "deleted->scheduled"),
    ("scheduled_to_started", "scheduled->started"),
    ("started_to_restored", "started->restored"),
    ("restored_to_ready", "restored->ready"),
    ("ready_to_first_step", "ready->first-step"),
)
"""The phases in order: the model's field name and the label used in Events and metrics."""


def _seconds(start: str | None, end: str | None) -> float | None:
    a, b = times.unix(start), times.unix(end)
    if a is None or b is None:
        return None
    return round(max(0.0, b - a), 3)


def compose(
    marks: RecoveryMarks | None,
    attempt_times: AttemptTimes | None,
    attempt: int,
    scheduled_at: datetime | None,
    now: datetime,
    seconds_lost: float | None = None,
) -> LastRecovery:
    """``lastRecovery`` of ``attempt`` (whose first step is being seen ``now``). Times that do
    not belong to it (another attempt's) are left out; a missing first-step time is ``now``.
    A phase is measured only where both of its ends are known; the total runs from the
    earliest mark (the notice, else the request, else the interruption) to the first step."""
    t = attempt_times if attempt_times is not None and attempt_times.attempt == attempt else None
    m = marks if marks is not None and marks.attempt < attempt else None
    first_step = (t.first_step_at if t else None) or times.rfc3339_micro(now)
    committed = m.committed_at if m else None
    # The warm standby (spec.standby) was scheduled before the recovery began: no scheduling
    # phase of its own, and its start ("started") is when it saw its attempt.
    standby = bool(m and m.standby)
    if standby:
        scheduled_at = None
    rec = LastRecovery(
        attempt=attempt,
        kind="barrier" if committed else "abrupt",
        notice_at=m.notice_at if m else None,
        requested_at=m.requested_at if m else None,
        committed_at=committed,
        interrupted_at=m.interrupted_at if m else None,
        pod_deleted_at=m.pod_deleted_at if m else None,
        scheduled_at=times.rfc3339(scheduled_at) if scheduled_at else None,
        started_at=t.started_at if t else None,
        restored_at=t.restored_at if t else None,
        ready_at=t.ready_at if t else None,
        first_step_at=first_step,
        standby=standby,
        cut_form=t.cut_form if t else None,
        steps_redone=t.steps_redone if t else 0,
    )
    # With a barrier the pod's removal starts at the commit; after an abrupt loss, at the
    # moment the operator saw the work stop.
    stop = committed or rec.interrupted_at
    phases = RecoveryPhases(
        notice_to_requested=_seconds(rec.notice_at, rec.requested_at),
        requested_to_committed=_seconds(rec.requested_at, committed),
        committed_to_deleted=_seconds(stop, rec.pod_deleted_at),
        deleted_to_scheduled=_seconds(rec.pod_deleted_at, rec.scheduled_at),
        scheduled_to_started=_seconds(rec.scheduled_at, rec.started_at),
        started_to_restored=_seconds(rec.started_at, rec.restored_at),
        restored_to_ready=_seconds(rec.restored_at, rec.ready_at),
        ready_to_first_step=_seconds(rec.ready_at, first_step),
    )
    origin = next((x for x in (rec.notice_at, rec.requested_at, rec.interrupted_at, rec.pod_deleted_at) if x), None)
    return rec.model_copy(
        update={
            "phases": phases,
            "total_seconds": _seconds(origin, first_step),
            "seconds_lost": None if seconds_lost is None else round(max(0.0, seconds_lost), 3),
        }
    )


def phase_seconds(rec: LastRecovery) -> list[tuple[str, float]]:
    """The measured phases of ``rec`` in order, as (label, seconds)."""
    out = []
    for name, label in PHASES:
        value = getattr(rec.phases, name)
        if value is not None:
            out.append((label, float(value)))
    return out


def describe(rec: LastRecovery) -> str:
    """The Event message: every measured phase's seconds, then the total."""
    parts = [f"{label} {sec:.1f}s" for label, sec in phase_seconds(rec)]
    total = f"; total {rec.total_seconds:.1f}s" if rec.total_seconds is not None else ""
    lost = f", {rec.seconds_lost:.1f}s lost" if rec.seconds_lost is not None else ""
    how = f"{rec.kind}, the standby took over" if rec.standby else rec.kind
    if rec.cut_form == "delta":
        how += f", from a delta cut: {rec.steps_redone} step(s) redone"
    return f"attempt {rec.attempt} recovered ({how}): " + ", ".join(parts) + total + lost
