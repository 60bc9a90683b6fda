"""Preemption signals: which Node and Pod states announce that a node is going away.

Pure classification of Kubernetes objects (plain dicts as the API returns them); the
watches that feed it live in :mod:`spotrl_operator.handlers`.

Budgets to plan for: AWS gives 120 s of notice, Azure at least 30 s, GKE 30 s of which
pods get about 15 s. A signal is a notice, not a certainty: a cordon may be maintenance.
SpotRL treats every signal the same way (cut, then move the controller off the node),
because a cut is cheap and a lost step is not.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from spotrl_runtime.api import times

# Taint keys set by the common spot-interruption handlers. Patterns use fnmatch syntax.
WELL_KNOWN_TAINTS: tuple[tuple[str, str], ...] = (
    ("aws-node-termination-handler/*", "aws-node-termination-handler"),
    ("karpenter.sh/disrupted", "karpenter"),
    ("karpenter.sh/disruption", "karpenter"),
    ("cloud.google.com/impending-node-termination", "gke"),
    ("remediator.kubernetes.azure.com/unschedulable", "aks"),
    ("node.kubernetes.io/out-of-service", "out-of-service"),
)

# Notice providers that serve one cloud only: their deadline cap binds a job only in a cluster
# with nodes of that cloud (a node's cloud: :func:`node_cloud`).
PROVIDER_CLOUDS: Mapping[str, str] = {"gke": "gce", "aks": "azure"}

SignalKind = Literal["cordon", "taint", "node-deleted", "disruption-target", "node-not-ready"]


@dataclass(frozen=True)
class Signal:
    """One reason to believe `node` is about to go."""

    kind: SignalKind
    node: str
    detail: str
    """The taint key, the condition's reason, ... — shown to the user in Events."""
    since: datetime | None = field(default=None, compare=False)
    """When the notice began, where the object says (a NoExecute taint's timeAdded, a
    condition's lastTransitionTime, the deletion); only measured, never decided on."""

    @property
    def reason(self) -> str:
        return f"{self.kind}: {self.detail}" if self.detail else self.kind

    @property
    def provider(self) -> str:
        """Who sent the notice: a well-known handler's name for its taints, else the kind."""
        if self.kind == "taint":
            for pattern, provider in WELL_KNOWN_TAINTS:
                if fnmatch.fnmatchcase(self.detail, pattern):
                    return provider
        return self.kind


def taint_patterns(extra: Iterable[str] = ()) -> tuple[str, ...]:
    """Well-known taint key patterns plus the job's or the operator's own."""
    return tuple(p for p, _ in WELL_KNOWN_TAINTS) + tuple(extra)


def node_signals(node: Mapping[str, Any], extra_taint_keys: Iterable[str] = ()) -> list[Signal]:
    """Signals a Node object carries right now (cordon, notice taints, deletion, NotReady)."""
    meta = node.get("metadata") or {}
    spec = node.get("spec") or {}
    name = str(meta.get("name", ""))
    out: list[Signal] = []
    if meta.get("deletionTimestamp"):
        out.append(Signal("node-deleted", name, "deletionTimestamp set", _time(meta.get("deletionTimestamp"))))
    if spec.get("unschedulable"):
        out.append(Signal("cordon", name, "spec.unschedulable"))
    patterns = taint_patterns(extra_taint_keys)
    for taint in spec.get("taints") or []:
        key = str(taint.get("key", ""))
        if any(fnmatch.fnmatchcase(key, p) for p in patterns):
            out.append(Signal("taint", name, key, _time(taint.get("timeAdded"))))
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready" and cond.get("status") in ("False", "Unknown"):
            reason = str(cond.get("reason") or cond.get("status"))
            out.append(Signal("node-not-ready", name, reason, _time(cond.get("lastTransitionTime"))))
    return out


def node_cloud(node: Mapping[str, Any]) -> str | None:
    """The cloud a Node runs on: the scheme of its ``spec.providerID`` (``gce``, ``azure``,
    ``aws``, ``kind`` ...); None when it has none (bare metal, a test's node)."""
    provider_id = str((node.get("spec") or {}).get("providerID") or "")
    scheme, sep, _ = provider_id.partition("://")
    return scheme if sep and scheme else None


def _time(value: Any) -> datetime | None:
    try:
        return times.parse(value) if isinstance(value, str) else None
    except ValueError:
        return None


def pod_signals(pod: Mapping[str, Any]) -> list[Signal]:
    """The Pod condition DisruptionTarget (eviction, preemption, taint eviction, shutdown)."""
    node = str((pod.get("spec") or {}).get("nodeName") or "")
    out = []
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True":
            reason = str(cond.get("reason") or "")
            out.append(Signal("disruption-target", node, reason, _time(cond.get("lastTransitionTime"))))
    return out


def is_draining(node: Mapping[str, Any], extra_taint_keys: Iterable[str] = ()) -> bool:
    """A node no new controller should be placed on."""
    return bool(node_signals(node, extra_taint_keys))
