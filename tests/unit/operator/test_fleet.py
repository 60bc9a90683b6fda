"""The nodes as passes read them: classified once per change, lost only on lasting evidence,
and never by their health while too many are unhealthy at once."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest

from spotrl_operator.fleet import Fleet, Zone, held_zones, view_of, zone_of
from spotrl_operator.observe import trim_node
from spotrl_runtime.api.times import rfc3339
from spotrl_runtime.kube import ServerClock

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


# Kubernetes' node lifecycle controller (ComputeZoneState, handleDisruption): per zone, a node
# not Ready unless its Ready condition is True; at least 3 and at least the threshold (0.55) not
# Ready: partial (stopped there); none Ready: full (evicted as usual unless every zone is full).
ZONE_CASES = [
    # zones as (nodes, not ready), the zones held
    ({"a": (10, 0)}, set()),
    ({"a": (2, 1)}, set()),  # 1 of 2: under 3 not Ready is never partial
    ({"a": (4, 2)}, set()),
    ({"a": (5, 3)}, {"a"}),  # 60%
    ({"a": (20, 11)}, {"a"}),  # 55%: at the threshold, held
    ({"a": (20, 10)}, set()),  # 50%
    ({"a": (200, 110)}, {"a"}),  # a zone over 50 nodes too (Kubernetes slows there; SpotRL stops)
    ({"a": (2, 2)}, {"a"}),  # the only zone, all down: every zone is
    ({"a": (3, 3), "b": (3, 0)}, set()),  # one zone down, another up: the down one is gone, evicted
    ({"a": (3, 3), "b": (5, 3)}, {"b"}),  # one down, one partial: only the partial one held
    ({"a": (3, 3), "b": (1, 1)}, {"a", "b"}),  # every zone down: none anywhere
    ({"a": (0, 0), "b": (1, 1)}, {"b"}),  # an empty zone is no zone
    ({}, set()),
]


@pytest.mark.parametrize(("zones", "held"), ZONE_CASES)
def test_zones_are_held_by_the_node_lifecycle_controllers_rule(
    zones: dict[str, tuple[int, int]], held: set[str]
) -> None:
    counted = {name: Zone(*counts) for name, counts in zones.items()}
    assert held_zones(counted, 0.55) == held


def zoned(name: str, zone: str | None, ready: str = "True", region: str | None = None) -> dict[str, Any]:
    n = node(name, ready)
    labels = {"topology.kubernetes.io/zone": zone} if zone is not None else {}
    if region is not None:
        labels["topology.kubernetes.io/region"] = region
    n["metadata"]["labels"] = labels
    return trim_node(n)


def test_the_zone_key_is_region_and_zone_and_unlabelled_nodes_share_one() -> None:
    assert zone_of(zoned("a", "z1")) == "z1"
    assert zone_of(zoned("a", "z1", region="r1")) == "r1:z1"
    assert zone_of(zoned("a", None)) == ""
    assert (
        zone_of(trim_node({"metadata": {"name": "b", "labels": {"failure-domain.beta.kubernetes.io/zone": "z2"}}}))
        == "z2"
    )


def test_a_partially_disrupted_zone_keeps_its_nodes_while_a_fully_disrupted_one_loses_them() -> None:
    """60% of zone x Unknown: none of x lost; zone y wholly Unknown while z is Ready: y's are lost."""
    fleet = Fleet()
    for i in range(5):
        fleet.update(f"x{i}", zoned(f"x{i}", "x", "Unknown" if i < 3 else "True"), NOW)
    for i in range(3):
        fleet.update(f"y{i}", zoned(f"y{i}", "y", "Unknown"), NOW)
        fleet.update(f"z{i}", zoned(f"z{i}", "z"), NOW)
    later = NOW + timedelta(seconds=60)
    view = fleet.view()
    assert dict(view.zones) == {"x": Zone(5, 3), "y": Zone(3, 3), "z": Zone(3, 0)}
    assert view.held(0.55) == {"x"}
    assert view.lost(later, 30, 0.55) == {"y0", "y1", "y2"}, "9 of 11 unhealthy fleet-wide, yet y is simply gone"
    assert view.lost(later, 30, 0.7) == {"x0", "x1", "x2", "y0", "y1", "y2"}, "60% is under a 70% threshold"


def test_with_every_zone_down_none_is_lost_and_when_one_comes_back_the_grace_starts_again() -> None:
    fleet = Fleet()
    fleet.update("y0", zoned("y0", "y", "Unknown"), NOW)
    fleet.update("z0", zoned("z0", "z"), NOW)
    fleet.update("z0", zoned("z0", "z", "Unknown"), NOW)
    later = NOW + timedelta(seconds=600)
    assert fleet.view().lost(later, 30, 0.55) == frozenset(), "every zone down: likelier the control plane"
    assert fleet.view().resumed_at is None, "a node listed Unknown before the others is no spell"
    back = NOW + timedelta(seconds=300)
    assert fleet.update("z0", zoned("z0", "z"), back)
    view = fleet.view()
    assert view.resumed_at == back
    assert view.lost(back + timedelta(seconds=29), 30, 0.55) == frozenset(), "the grace counts from the return"
    assert view.lost(back + timedelta(seconds=30), 30, 0.55) == {"y0"}


def test_a_list_read_at_once_is_no_spell_of_every_zone_down() -> None:
    """The first node of a list Unknown, the next Ready: every zone was never down."""
    listed = {"a": zoned("a", "x", "Unknown"), "b": zoned("b", "x")}
    view = view_of(listed, NOW)
    assert view.resumed_at is None
    assert view.lost(NOW + timedelta(seconds=60), 30, 0.55) == {"a"}
    fleet = Fleet()
    fleet.update("a", listed["a"], NOW)
    fleet.update("b", listed["b"], NOW)
    fleet.view()  # read while a zone is up
    fleet.update("c", zoned("c", "x"), NOW + timedelta(seconds=10))
    assert fleet.view().resumed_at is None, "no zone came back: none was down"


def test_the_zone_counts_follow_relabels_and_deletions() -> None:
    fleet = Fleet()
    fleet.update("a", zoned("a", "x", "Unknown"), NOW)
    fleet.update("b", zoned("b", "x"), NOW)
    fleet.update("a", zoned("a", "y", "Unknown"), NOW)
    assert dict(fleet.view().zones) == {"x": Zone(1, 0), "y": Zone(1, 1)}
    fleet.update("a", None, NOW)
    fleet.update("b", zoned("b", "x", "False"), NOW)
    view = fleet.view()
    assert (dict(view.zones), dict(view.zone_of)) == ({"x": Zone(1, 1)}, {"b": "x"})
    fleet.update("b", None, NOW)
    assert dict(fleet.view().zones) == {}


def test_the_grace_is_measured_on_the_api_servers_clock() -> None:
    """The operator's wall clock runs 5 minutes behind the API server's: a node Unknown for 10 s
    by the API server's clock is not lost yet, though by the wall clock the condition's time is
    in the future; 40 s later it is, by the server's clock, whatever the wall clock says."""
    skew = timedelta(minutes=5)
    server = ServerClock(wall=lambda: (NOW - skew).timestamp())
    server.observe(format_datetime(NOW, usegmt=True))  # its answers say NOW
    assert abs(server.offset() - skew.total_seconds() - 0.5) < 1e-6
    fleet = Fleet()
    fleet.update("a", zoned("a", "x", "Unknown"), server.now())  # Unknown since NOW - 5 s (server)
    fleet.update("b", zoned("b", "x"), server.now())
    view = fleet.view()
    assert view.lost(server.now() + timedelta(seconds=20), 30, 0.55) == frozenset()
    assert view.lost(server.now() + timedelta(seconds=40), 30, 0.55) == {"a"}
    assert view.lost(NOW - skew + timedelta(seconds=40), 30, 0.55) == frozenset(), "the wall clock would wait 5 min"


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
