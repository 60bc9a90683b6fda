"""Reading what another version wrote: a status (what this version cannot read is dropped, the rest
kept) and a stored spec (keys this version does not know are skipped, nothing else)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from spotrl_runtime.api.lenient import ignoring_unknown, read_leniently
from spotrl_runtime.api.rljob import (
    API_VERSION,
    BarrierStatus,
    RLJobStatus,
    SpecError,
    parse_rljob,
    parse_spec,
    read_stored_rljob,
    read_stored_spec,
)


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


def test_a_value_this_version_cannot_read_inside_an_object_drops_the_object_not_to_its_default() -> None:
    doc = {"attempt": 3, "barrier": {"requestId": "b-1", "state": "Withdrawn", "reason": "cordon"}}
    status, kept, dropped = read_leniently(RLJobStatus, doc)
    assert status.barrier is None, "a state this version does not know must not read as Requested"
    assert dropped == ["barrier"]
    assert kept == {"attempt": 3}


def test_one_unreadable_list_item_goes_alone() -> None:
    cond = {"type": "Running", "reason": "R", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}
    doc = {"conditions": [{**cond, "status": "Perhaps"}, {**cond, "type": "Ready", "status": "True"}]}
    status, _, dropped = read_leniently(RLJobStatus, doc)
    assert [c.type for c in status.conditions] == ["Ready"]
    assert dropped == ["conditions.0"]


def test_a_stored_spec_skips_unknown_keys_only() -> None:
    spec = {
        "policy": {"model": "builtin:tiny-arith", "lmHead": "float32"},
        "dataset": {"uri": "builtin:arithmetic"},
        "reward": {"name": "arithmetic_exact"},
        "training": {"totalSteps": 3},
        "episodes": {"maxTurns": 6},
    }
    parsed, skipped = read_stored_spec(spec)
    assert parsed.training.total_steps == 3
    assert sorted(skipped) == ["spec.episodes", "spec.policy.lmHead"]
    with pytest.raises(SpecError, match="unknown field"):
        parse_spec(spec)  # what a user types is still refused
    with pytest.raises(SpecError, match=r"spec\.training\.lrSchedule"):
        read_stored_spec({**spec, "training": {"totalSteps": 3, "lrSchedule": "warmup-stable-decay"}})


def test_ignoring_unknown_raises_for_the_rest_with_the_unknown_gone() -> None:
    with pytest.raises(ValidationError) as err:
        ignoring_unknown(BarrierStatus, {"requestId": "r", "state": "Paused", "newField": 1})
    assert [e["loc"] for e in err.value.errors()] == [("state",)]


def test_a_stored_rljob_reads_a_newer_status_and_names_what_it_skipped() -> None:
    doc = {
        "apiVersion": API_VERSION,
        "kind": "RLJob",
        "metadata": {"name": "j"},
        "spec": {
            "policy": {"model": "builtin:tiny-arith"},
            "dataset": {"uri": "builtin:arithmetic"},
            "reward": {"name": "arithmetic_exact"},
            "training": {"totalSteps": 3, "knobOfANewerRelease": 2},
        },
        "status": {"attempt": 2, "phase": "Draining", "turns": {"resumed": 1}},
    }
    job, skipped = read_stored_rljob(doc)
    assert job.status is not None
    assert (job.status.attempt, job.status.phase) == (2, None)
    assert sorted(skipped) == ["spec.training.knobOfANewerRelease", "status.phase", "status.turns"]
    with pytest.raises(SpecError):
        parse_rljob(doc)
