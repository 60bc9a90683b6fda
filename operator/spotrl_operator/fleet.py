"""The nodes as every pass reads them: kept up to date once per Node event, not once per pass.

A pass over one job must not cost a walk over every node: at 2,000 nodes and 500 jobs that
is a million pattern matches a second. :class:`Fleet` takes each Node event
(:meth:`Fleet.update`); only when what the operator reads of the node changed (its trimmed
form, :func:`~spotrl_operator.observe.trim_node`; a kubelet's heartbeat changes nothing) the
next reader gets a new immutable :class:`FleetView` (:meth:`Fleet.view`): the nodes, those
unusable, those unhealthy and since when. Passes run in worker threads; nothing they hold
is ever changed under them.

When is a node *lost* (its pods may be force-deleted, since no kubelet will ever confirm
them gone)? Only on evidence that outlives a blip, as Kubernetes' own node lifecycle
controller judges it:

- the ``node.kubernetes.io/out-of-service`` taint: an administrator says the node is down
  (Kubernetes' non-graceful node shutdown); lost at once;
- Ready ``Unknown`` or the ``node.kubernetes.io/unreachable`` taint for at least
  ``node_lost_seconds`` (from the condition's lastTransitionTime or the taint's timeAdded);
  never while the node's kubelet says Ready (a node given back is Ready seconds before its
  taint is lifted, and the scheduler may already have placed a pod there);
- the Node object gone, confirmed by a live GET (:func:`~spotrl_operator.observe.confirm_missing`):
  a pod on a brand-new node may arrive before its Node reaches the cache.

And the brake, per zone (``topology.kubernetes.io/zone``, with its region; nodes without
the label form one zone), by the rule of Kubernetes' node lifecycle controller
(``ComputeZoneState``, ``handleDisruption``), which counts a node not Ready when its Ready
condition is anything but True:

- a zone *partially disrupted* (at least :data:`MIN_UNHEALTHY` of its nodes not Ready, and at
  least ``unhealthy_share`` of them, ``--unhealthy-zone-threshold``, 0.55): the likelier story
  is the zone's network or the control plane, not the nodes. No node of that zone counts as
  lost by its condition or taint, so no controller there is force-deleted and no job falls
  back to an older cut. Kubernetes stops evicting in such a zone of at most 50 nodes
  (``--large-cluster-size-threshold``) and slows down in a larger one; SpotRL stops in both,
  since a controller force-deleted on a node that still runs makes two writers of one job;
- a zone *fully disrupted* (no node Ready) while another zone is not: the zone is gone (a
  spot reclaim of a whole zone), its nodes are lost after the grace period as usual;
- every zone fully disrupted: the control plane is the likelier culprit; nothing is lost by
  its health anywhere. When a zone comes back, the grace period of every node counts from
  then at the earliest (:attr:`FleetView.resumed_at`), as Kubernetes resets its probe times.

Only out-of-service nodes and confirmed deletions are lost in a held zone. The operator says
so (the ``ForceDeletesPaused`` condition on each job it holds back, and a metric) and waits.

Grace periods are measured on the API server's clock: the times above come from the node
lifecycle controller, and the callers pass ``now`` as the API server's
(:meth:`~spotrl_runtime.kube.ServerClock.now`), not the operator's wall clock.
"""

from __future__ import annotations

import enum
import fnmatch
import threading
import types
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from spotrl_operator.signals import node_cloud, node_signals
from spotrl_runtime.api import times

Obj = dict[str, Any]
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"
UNREACHABLE = "node.kubernetes.io/unreachable"
MIN_UNHEALTHY = 3
"""A zone with fewer nodes not Ready than this is never partially disrupted (Kubernetes' ``> 2``)."""
ZONE_LABELS = ("topology.kubernetes.io/zone", "failure-domain.beta.kubernetes.io/zone")
REGION_LABELS = ("topology.kubernetes.io/region", "failure-domain.beta.kubernetes.io/region")


class ZoneState(enum.Enum):
    """A zone's health, as Kubernetes' node lifecycle controller names it."""

    NORMAL = "Normal"
    PARTIAL = "PartialDisruption"
    FULL = "FullDisruption"


@dataclass(frozen=True)
class Zone:
    """How many nodes a zone has, and how many of them are not Ready."""

    nodes: int = 0
    not_ready: int = 0

    @property
    def down(self) -> bool:
        """No node of the zone is Ready (a full disruption)."""
        return bool(self.not_ready) and self.not_ready >= self.nodes

    def state(self, threshold: float) -> ZoneState:
        """Kubernetes' ``ComputeZoneState``: no node Ready is a full disruption; at least
        :data:`MIN_UNHEALTHY` and ``threshold`` of the nodes not Ready a partial one."""
        if self.down:
            return ZoneState.FULL
        if self.not_ready >= MIN_UNHEALTHY and self.not_ready / self.nodes >= threshold:
            return ZoneState.PARTIAL
        return ZoneState.NORMAL


def held_zones(zones: Mapping[str, Zone], threshold: float) -> frozenset[str]:
    """The zones where no node counts as lost by its health: the partially disrupted ones, or
    every zone when all are fully disrupted (Kubernetes' ``handleDisruption``)."""
    if all_down(zones):
        return frozenset(name for name, zone in zones.items() if zone.nodes)
    return frozenset(name for name, zone in zones.items() if zone.nodes and zone.state(threshold) is ZoneState.PARTIAL)


def all_down(zones: Mapping[str, Zone]) -> bool:
    """Whether every zone is fully disrupted (whatever the threshold)."""
    sized = [zone for zone in zones.values() if zone.nodes]
    return bool(sized) and all(zone.down for zone in sized)


def zone_of(node: Obj) -> str:
    """The node's zone key, as Kubernetes' ``GetZoneKey`` makes it: region and zone (the beta
    labels as a fallback); "" without either."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    zone = next((str(labels[k]) for k in ZONE_LABELS if k in labels), "")
    region = next((str(labels[k]) for k in REGION_LABELS if k in labels), "")
    return f"{region}:{zone}" if region else zone


def not_ready(node: Obj) -> bool:
    """Whether the node's Ready condition is anything but True (missing included)."""
    ready = [c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"]
    return not ready or ready[0].get("status") != "True"


@dataclass(frozen=True)
class FleetView:
    """The nodes at one moment: what passes read. Immutable."""

    nodes: Mapping[str, Obj] = field(default_factory=lambda: types.MappingProxyType({}))
    """Every Node by name, trimmed."""
    unusable: frozenset[str] = frozenset()
    """Nodes with a notice (the operator-wide taint patterns), cordoned, NotReady or being deleted."""
    unhealthy_since: Mapping[str, datetime] = field(default_factory=dict)
    """Nodes Ready Unknown or tainted unreachable, and since when."""
    out_of_service: frozenset[str] = frozenset()
    clouds: frozenset[str] = frozenset()
    """The clouds the nodes run on (:func:`~spotrl_operator.signals.node_cloud`)."""
    zone_of: Mapping[str, str] = field(default_factory=dict)
    """Each node's zone (:func:`zone_of`)."""
    zones: Mapping[str, Zone] = field(default_factory=dict)
    """Each zone's node counts."""
    resumed_at: datetime | None = None
    """When every zone was last fully disrupted, the moment one came back (None: never seen):
    no grace period counts from earlier."""

    def held(self, share: float) -> frozenset[str]:
        """The zones where no node counts as lost by its health (:func:`held_zones`)."""
        return held_zones(self.zones, share)

    def braking(self, share: float) -> bool:
        """Whether force deletes are paused in some zone."""
        return bool(self.held(share))

    def lost(self, now: datetime, lost_after: float, share: float) -> frozenset[str]:
        """The nodes lost at ``now``, the API server's (missing ones aside: see the module's docstring)."""
        held = self.held(share)
        grace = timedelta(seconds=lost_after)
        late = {
            name
            for name, since in self.unhealthy_since.items()
            if self.zone_of.get(name, "") not in held and now - self.since(since) >= grace
        }
        return self.out_of_service | late

    def since(self, unhealthy_since: datetime) -> datetime:
        """When a node's grace period began: not before :attr:`resumed_at`."""
        return max(unhealthy_since, self.resumed_at) if self.resumed_at is not None else unhealthy_since

    def unusable_with(self, extra_taint_keys: Iterable[str]) -> frozenset[str]:
        """:attr:`unusable` plus the nodes a job's own taint keys mark (a walk over the nodes,
        only for a job that has such keys)."""
        patterns = tuple(extra_taint_keys)
        if not patterns:
            return self.unusable
        marked = {
            name
            for name, node in self.nodes.items()
            if any(fnmatch.fnmatchcase(str(t.get("key", "")), p) for t in _taints(node) for p in patterns)
        }
        return self.unusable | marked


def _taints(node: Obj) -> list[Obj]:
    return list((node.get("spec") or {}).get("taints") or [])


def unhealthy_since(node: Obj, first_seen: datetime) -> datetime | None:
    """Since when the node has been unhealthy (Ready Unknown, or tainted unreachable while its
    kubelet does not say Ready), the earliest time the object shows, else when the operator
    first saw it so; None: healthy. A node given back says Ready before the node lifecycle
    controller lifts its unreachable taint (seconds later): its kubelet's word wins."""
    ready = [c for c in (node.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"]
    status = ready[0].get("status") if ready else None
    if status == "True":
        return None
    times_seen = _when(ready[0].get("lastTransitionTime")) if status == "Unknown" else []
    tainted = [t for t in _taints(node) if t.get("key") == UNREACHABLE]
    for taint in tainted:
        times_seen.extend(_when(taint.get("timeAdded")))
    if status != "Unknown" and not tainted:
        return None
    return min(times_seen) if times_seen else first_seen


def _when(value: Any) -> list[datetime]:
    try:
        parsed = times.parse(value) if isinstance(value, str) else None
    except ValueError:
        return []
    return [parsed] if parsed is not None else []


class Fleet:
    """The nodes, updated per Node event; :meth:`view` publishes them. Thread-safe."""

    def __init__(self, extra_taint_keys: Iterable[str] = ()):
        self.extra_taint_keys = tuple(extra_taint_keys)
        self._lock = threading.Lock()
        self._view: FleetView | None = FleetView()
        self._nodes: dict[str, Obj] = {}
        self._unusable: set[str] = set()
        self._unhealthy: dict[str, datetime] = {}
        self._out_of_service: set[str] = set()
        self._zone_of: dict[str, str] = {}
        self._not_ready: set[str] = set()
        self._zones: dict[str, Zone] = {}
        self._resumed_at: datetime | None = None
        self._down_seen = False
        """A reader saw every zone down (a spell judged between events of one list is none)."""

    def update(self, name: str, node: Obj | None, now: datetime) -> bool:
        """One Node event (``node`` trimmed; None: deleted) at ``now``, the API server's.
        Returns whether anything a pass reads changed."""
        with self._lock:
            return self._update(name, node, now)

    def forget(self, uids: Collection[str], now: datetime) -> list[str]:
        """Takes out the nodes whose uid is one of ``uids`` (gone from the API server, though
        their DELETED event never came: :mod:`~spotrl_operator.relist`); returns their names.
        A node made again under the same name has another uid: it stays."""
        with self._lock:
            names = [n for n, node in self._nodes.items() if (node.get("metadata") or {}).get("uid") in uids]
            for name in names:
                self._update(name, None, now)
            return names

    def _update(self, name: str, node: Obj | None, now: datetime) -> bool:
        if self._nodes.get(name) == node and (node is not None or name not in self._nodes):
            return False
        self._unusable.discard(name)
        self._out_of_service.discard(name)
        self._count(name, -1)
        before = self._unhealthy.pop(name, None)
        if node is None:
            self._nodes.pop(name, None)
        else:
            self._nodes[name] = node
            self._classify(name, node, before or now)
        if self._down_seen and not all_down(self._zones):
            self._down_seen, self._resumed_at = False, now
        self._view = None  # built again by the next reader, once for any number of events
        return True

    def view(self) -> FleetView:
        """The nodes now, as an immutable view (built once per change, not once per reader)."""
        with self._lock:
            if self._view is None:
                self._down_seen = self._down_seen or all_down(self._zones)
                self._view = FleetView(
                    nodes=types.MappingProxyType(dict(self._nodes)),
                    unusable=frozenset(self._unusable),
                    unhealthy_since=types.MappingProxyType(dict(self._unhealthy)),
                    out_of_service=frozenset(self._out_of_service),
                    clouds=frozenset(c for n in self._nodes.values() if (c := node_cloud(n))),
                    zone_of=types.MappingProxyType(dict(self._zone_of)),
                    zones=types.MappingProxyType(dict(self._zones)),
                    resumed_at=self._resumed_at,
                )
            return self._view

    def _classify(self, name: str, node: Obj, first_seen: datetime) -> None:
        if node_signals(node, self.extra_taint_keys):
            self._unusable.add(name)
        since = unhealthy_since(node, first_seen)
        if since is not None:
            self._unhealthy[name] = since
        if any(t.get("key") == OUT_OF_SERVICE for t in _taints(node)):
            self._out_of_service.add(name)
        self._zone_of[name] = zone_of(node)
        if not_ready(node):
            self._not_ready.add(name)
        self._count(name, +1)

    def _count(self, name: str, sign: int) -> None:
        """Adds the node to its zone's counts (``sign`` +1), or takes it out (-1; it then leaves
        the zone maps too, and an empty zone is forgotten)."""
        if name not in self._zone_of:
            return
        key = self._zone_of[name]
        zone = self._zones.get(key, Zone())
        zone = Zone(zone.nodes + sign, zone.not_ready + sign * (name in self._not_ready))
        if zone.nodes > 0:
            self._zones[key] = zone
        else:
            self._zones.pop(key, None)
        if sign < 0:
            del self._zone_of[name]
            self._not_ready.discard(name)


def view_of(nodes: Mapping[str, Obj], now: datetime, extra_taint_keys: Iterable[str] = ()) -> FleetView:
    """The view of a node list read at once (a fresh LIST, or a test's nodes)."""
    fleet = Fleet(extra_taint_keys)
    for name, node in nodes.items():
        fleet.update(name, node, now)
    return fleet.view()
