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

And the brake: when more than ``unhealthy_share`` of the nodes (and at least
:data:`MIN_UNHEALTHY`) are unhealthy at once, the likelier story is the control plane or
the network, not the nodes: no node counts as lost by its condition or taint (only
out-of-service ones and confirmed deletions do), so no controller is force-deleted and no
job falls back to an older cut. The operator says so (the ``ForceDeletesPaused`` condition
on each job it holds back, and a metric) and waits. Kubernetes' node lifecycle controller
stops evicting in the same case (``--unhealthy-zone-threshold``, 0.55).
"""

from __future__ import annotations

import fnmatch
import threading
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from spotrl_operator.signals import node_cloud, node_signals
from spotrl_runtime.api import times

Obj = dict[str, Any]
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"
UNREACHABLE = "node.kubernetes.io/unreachable"
MIN_UNHEALTHY = 3
"""Fewer unhealthy nodes than this never engage the brake (a small cluster losing two nodes)."""


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

    def braking(self, share: float) -> bool:
        """Whether so many nodes are unhealthy at once that none counts as lost by its health."""
        unhealthy = len(self.unhealthy_since)
        return unhealthy >= MIN_UNHEALTHY and unhealthy > share * len(self.nodes)

    def lost(self, now: datetime, lost_after: float, share: float) -> frozenset[str]:
        """The nodes lost at ``now`` (missing ones aside: see the module's docstring)."""
        if self.braking(share):
            return self.out_of_service
        grace = timedelta(seconds=lost_after)
        late = {name for name, since in self.unhealthy_since.items() if now - since >= grace}
        return self.out_of_service | late

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

    def update(self, name: str, node: Obj | None, now: datetime) -> bool:
        """One Node event (``node`` trimmed; None: deleted). Returns whether anything a pass
        reads changed."""
        with self._lock:
            if self._nodes.get(name) == node and (node is not None or name not in self._nodes):
                return False
            self._unusable.discard(name)
            self._out_of_service.discard(name)
            before = self._unhealthy.pop(name, None)
            if node is None:
                self._nodes.pop(name, None)
            else:
                self._nodes[name] = node
                self._classify(name, node, before or now)
            self._view = None  # built again by the next reader, once for any number of events
            return True

    def view(self) -> FleetView:
        """The nodes now, as an immutable view (built once per change, not once per reader)."""
        with self._lock:
            if self._view is None:
                self._view = FleetView(
                    nodes=types.MappingProxyType(dict(self._nodes)),
                    unusable=frozenset(self._unusable),
                    unhealthy_since=types.MappingProxyType(dict(self._unhealthy)),
                    out_of_service=frozenset(self._out_of_service),
                    clouds=frozenset(c for n in self._nodes.values() if (c := node_cloud(n))),
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


def view_of(nodes: Mapping[str, Obj], now: datetime, extra_taint_keys: Iterable[str] = ()) -> FleetView:
    """The view of a node list read at once (a fresh LIST, or a test's nodes)."""
    fleet = Fleet(extra_taint_keys)
    for name, node in nodes.items():
        fleet.update(name, node, now)
    return fleet.view()
