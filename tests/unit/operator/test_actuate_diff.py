"""The status write: only the fields that differ, as a JSON merge patch."""

from __future__ import annotations

from spotrl_operator.actuate import merge_diff, status_doc
from spotrl_operator.observe import STATUS_FIELDS
from spotrl_runtime.api.rljob import BarrierStatus, RLJobStatus


def test_unchanged_fields_are_not_written() -> None:
    observed = {"phase": "Running", "step": 7, "stepAttempt": 2, "attempt": 2, "preemptions": 1}
    new = status_doc(RLJobStatus(phase="Running", step=7, step_attempt=2, attempt=2, preemptions=1))
    diff = merge_diff(observed, new, STATUS_FIELDS)
    assert "step" not in diff
    assert "stepAttempt" not in diff
    assert "phase" not in diff


def test_nested_changes_are_minimal_and_cleared_fields_are_nulled() -> None:
    observed = {
        "barrier": {"requestId": "r1", "state": "Requested", "reason": "cordon"},
        "interruptedAt": "2026-11-30T12:00:00Z",
        "kopf": {"progress": {}},
    }
    new = status_doc(RLJobStatus(barrier=BarrierStatus(request_id="r1", state="Missed", reason="cordon")))
    diff = merge_diff(observed, new, STATUS_FIELDS)
    assert diff["barrier"] == {"state": "Missed"}
    assert diff["interruptedAt"] is None
    assert "kopf" not in diff, "fields the model does not own are never removed"


def test_a_cleared_barrier_is_removed() -> None:
    diff = merge_diff({"barrier": {"requestId": "r1"}, "attempt": 1}, status_doc(RLJobStatus(attempt=2)), STATUS_FIELDS)
    assert diff["barrier"] is None
    assert diff["attempt"] == 2
