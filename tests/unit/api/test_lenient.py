"""Reading a status another version wrote: what this version cannot read is dropped, the rest kept."""

from __future__ import annotations

from spotrl_runtime.api.lenient import read_leniently
from spotrl_runtime.api.rljob import RLJobStatus


def test_unknown_keys_at_every_depth_are_dropped_and_named() -> None:
    doc = {
        "attempt": 2,
        "newTop": {"a": 1},
        "barrier": {"requestId": "r", "state": "Requested", "reason": "cordon", "newInner": [1]},
        "conditions": [
            {
                "type": "Running",
                "status": "True",
                "reason": "R",
                "message": "",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
                "extra": 1,
            }
        ],
    }
    status, kept, dropped = read_leniently(RLJobStatus, doc)
    assert status.attempt == 2
    assert status.barrier is not None
    assert status.barrier.request_id == "r"
    assert [c.type for c in status.conditions] == ["Running"]
    assert sorted(dropped) == ["barrier.newInner", "conditions.0.extra", "newTop"]
    assert "newTop" not in kept
    assert "newInner" not in kept["barrier"]
    assert doc["barrier"]["newInner"] == [1], "the caller's document is left as it was"


def test_a_value_this_version_cannot_read_is_dropped_not_the_document() -> None:
    status, kept, dropped = read_leniently(RLJobStatus, {"phase": "Hibernating", "attempt": 4, "preemptions": -1})
    assert status.attempt == 4
    assert status.phase is None
    assert status.preemptions == 0
    assert sorted(dropped) == ["phase", "preemptions"]
    assert kept == {"attempt": 4}


def test_an_object_missing_a_field_this_version_requires_is_dropped_whole() -> None:
    status, kept, dropped = read_leniently(RLJobStatus, {"attempt": 1, "lastCut": {"unknownShape": True}})
    assert status.attempt == 1
    assert status.last_cut is None
    assert "lastCut" not in kept
    assert "lastCut" in dropped
