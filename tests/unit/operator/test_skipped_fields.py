"""A stored RLJob written by a newer CRD, operator or controller: what this operator skips, what
it still refuses, and how it says so (the ``VersionSkew`` condition)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from test_observe import NOW, SETTINGS, job
from test_reconcile import events, world

from spotrl_operator.observe import Snapshot, world_of
from spotrl_operator.reconcile import reconcile
from spotrl_operator.settings import FINALIZER_SECONDS_MAX
from spotrl_runtime.api.rljob import SpecError


def newer(**status: Any) -> dict[str, Any]:
    """A job as a newer CRD stores it: new fields defaulted into the spec, a newer writer's status."""
    doc = job(**status)
    doc["spec"]["training"]["knobOfANewerRelease"] = 1
    doc["spec"]["sampling"] = {"dynamic": {"filter": "none"}}
    return doc


def test_fields_this_version_does_not_know_are_skipped_and_named() -> None:
    w = world_of(Snapshot(job=newer(attempt=2, episodes={"turns": 3})), SETTINGS, NOW)
    assert w.spec.training.total_steps == 10, "what this version knows is read as written"
    assert w.status.attempt == 2
    assert set(w.skipped_fields) == {"spec.training.knobOfANewerRelease", "spec.sampling", "status.episodes"}


def test_kopfs_own_status_is_not_a_skipped_field() -> None:
    assert world_of(Snapshot(job=job(attempt=1)), SETTINGS, NOW).skipped_fields == ()


def test_a_value_this_version_cannot_read_is_still_refused_naming_it() -> None:
    doc = newer()
    doc["spec"]["checkpoint"] = {"retentionPolicy": "Archive"}
    with pytest.raises(SpecError, match=r"spec\.checkpoint\.retentionPolicy") as err:
        world_of(Snapshot(job=doc), SETTINGS, NOW)
    assert "knobOfANewerRelease" not in str(err.value), "the unknown key is skipped, not reported as the problem"


def test_a_barrier_in_a_state_this_version_does_not_know_is_no_request() -> None:
    barrier = {"requestId": "b-1", "state": "Withdrawn", "reason": "cordon"}
    w = world_of(Snapshot(job=job(attempt=1, barrier=barrier)), SETTINGS, NOW)
    assert w.status.barrier is None, "read as unknown, not as the default state Requested"
    assert "status.barrier" in w.skipped_fields


def test_version_skew_is_a_condition_and_one_event_until_the_fields_are_known() -> None:
    skewed = world(skipped_fields=("spec.sampling", "status.episodes"))
    plan = reconcile(skewed)
    assert plan.status is not None
    cond = next(c for c in plan.status.conditions if c.type == "VersionSkew")
    assert (cond.status, cond.reason) == ("True", "FieldsSkipped")
    assert "spec.sampling" in cond.message
    assert "status.episodes" in cond.message
    assert events(plan).count("VersionSkew") == 1

    again = reconcile(replace(skewed, status=plan.status))
    assert "VersionSkew" not in events(again), "said once, not on every pass"

    known = reconcile(replace(skewed, status=plan.status, skipped_fields=()))
    assert known.status is not None
    cond = next(c for c in known.status.conditions if c.type == "VersionSkew")
    assert (cond.status, cond.reason) == ("False", "FieldsKnown")


def test_the_finalizer_ends_before_kopfs_own_bound() -> None:
    from spotrl_operator.handlers import FINALIZER_BOUND_SECONDS

    assert FINALIZER_SECONDS_MAX + 60 <= FINALIZER_BOUND_SECONDS
