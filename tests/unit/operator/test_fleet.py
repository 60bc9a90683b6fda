"""The nodes as passes read them: classified once per change, lost only on lasting evidence,
and never by their health while too many are unhealthy at once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from spotrl_operator.fleet import MIN_UNHEALTHY, Fleet
from spotrl_operator.observe import trim_node
from spotrl_runtime.api.times import rfc3339

NOW = datetime(2026, 12, 5, 8, 0, tzinfo=UTC)


def node(name: str, ready: str = "True", heartbeat: str = "t0", **spec: Any) -> dict[str, Any]:
    cond = {"type": "Ready", "status": ready, "lastHeartbeatTime": heartbeat}
    if ready != "True":
        cond["lastTransitionTime"] = rfc3339(NOW - timedelta(seconds=5))
    return {"metadata": {"name": name}, "spec": spec, "status": {"conditions": [cond]}}


def test_a_heartbeat_changes_nothing_and_builds_no_new_view() -> None:
    fleet = Fleet()
    assert fleet.update("a", trim_node(node("a")), NOW)
    view = fleet.view()
    assert not fleet.update("a", trim_node(node("a", heartbeat="t1")), NOW)
    assert fleet.view() is view, "no change: the same view, not a copy per reader"
    assert fleet.update("a", trim_node(node("a", unschedulable=True)), NOW)
    assert fleet.view().unusable == {"a"}


def test_a_deleted_node_leaves_every_set() -> None:
    fleet = Fleet()
    fleet.update("a", trim_node(node("a", "Unknown")), NOW)
    assert set(fleet.view().unhealthy_since) == {"a"}
    assert fleet.update("a", None, NOW)
    view = fleet.view()
    assert (dict(view.nodes), dict(view.unhealthy_since), view.unusable) == ({}, {}, frozenset())
    assert not fleet.update("a", None, NOW), "gone already"


def test_unhealthy_since_the_condition_else_since_first_seen() -> None:
    fleet = Fleet()
    bare = {"metadata": {"name": "b"}, "spec": {}, "status": {"conditions": [{"type": "Ready", "status": "Unknown"}]}}
    fleet.update("a", trim_node(node("a", "Unknown")), NOW)
    fleet.update("b", trim_node(bare), NOW)
    since = fleet.view().unhealthy_since
    assert since["a"] == NOW - timedelta(seconds=5)
    assert since["b"] == NOW
    # Seen again later, still Unknown: its first sighting stands.
    fleet.update(
        "b",
        {**trim_node(bare), "metadata": {**trim_node(bare)["metadata"], "labels": {"x": "y"}}},
        NOW + timedelta(seconds=9),
    )
    assert fleet.view().unhealthy_since["b"] == NOW


def test_the_brake_needs_both_the_share_and_a_minimum_count() -> None:
    fleet = Fleet()
    for i in range(MIN_UNHEALTHY - 1):
        fleet.update(f"u{i}", trim_node(node(f"u{i}", "Unknown")), NOW)
    assert not fleet.view().braking(0.55), "two of two unhealthy: a small cluster losing two nodes"
    assert fleet.view().lost(NOW + timedelta(seconds=60), 30, 0.55) == {"u0", "u1"}
    fleet.update("u9", trim_node(node("u9", "Unknown")), NOW)
    assert fleet.view().braking(0.55)
    assert fleet.view().lost(NOW + timedelta(seconds=60), 30, 0.55) == frozenset()
    for i in range(3):
        fleet.update(f"h{i}", trim_node(node(f"h{i}")), NOW)
    assert not fleet.view().braking(0.55), "3 of 6 is not above 55%"


def test_a_node_given_back_is_healthy_while_its_unreachable_taint_lingers() -> None:
    """The kubelet says Ready again; the node lifecycle controller lifts the taint seconds later,
    and a pod may be placed there meanwhile: it must not be force-deleted as on a lost node (the
    kind suite's node given back to the next test)."""
    long_ago = rfc3339(NOW - timedelta(seconds=600))
    taint = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": long_ago}
    fleet = Fleet()
    fleet.update("back", trim_node(node("back", "True", taints=[taint])), NOW)
    fleet.update("gone", trim_node(node("gone", "False", taints=[taint])), NOW)
    view = fleet.view()
    assert set(view.unhealthy_since) == {"gone"}, "tainted and not Ready: unhealthy since the taint"
    assert view.unhealthy_since["gone"] == NOW - timedelta(seconds=600)
    assert view.lost(NOW, 30, 0.55) == {"gone"}
