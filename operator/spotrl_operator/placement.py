"""Where a job's new pod may go: the nodes to keep it off, and its affinity. Pure.

The operator keeps a fresh controller (and a replacement worker) off nodes that are about
to go. It does not list every such node of the cluster in every pod: a reclaim wave or a
node-pool upgrade makes that list grow with the cluster. :func:`avoid_list` keeps only the
nodes the scheduler could otherwise choose for this job's pods:

- nodes the job's ``nodeSelector`` and required node affinity admit (others it never picks);
- and whose trouble the scheduler does not already act on: a cordon, or a ``NoSchedule`` /
  ``NoExecute`` taint the pod does not tolerate, keeps the scheduler away by itself. What
  is left are nodes with a notice the pod tolerates (a job that tolerates everything), a
  ``PreferNoSchedule`` notice, or NotReady/being deleted before the node controller's taint.

:func:`affinity` writes that list into the pod in a form the API server accepts for any
length: one ``matchFields`` requirement per node (a node field selector takes exactly one
value for ``In``/``NotIn``), ANDed into each of the user's required node affinity terms.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from spotrl_runtime.api import rljob as api

Obj = dict[str, Any]

MAX_AVOIDED = 64
"""At most this many names go into one pod. Past it, a pod may land on a node with a notice;
the operator then asks that controller for a barrier, as for any notice (slower, never wrong)."""

UNSCHEDULABLE_TAINT = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
"""How the scheduler treats a cordon (``spec.unschedulable``): as this taint."""
# DefaultTolerationSeconds adds NoExecute tolerations for these to every pod at admission, so
# a NoExecute taint with these keys never keeps a pod off a node by itself.
ADMISSION_TOLERATED = frozenset({"node.kubernetes.io/not-ready", "node.kubernetes.io/unreachable"})


# --------------------------------------------------------------------- matching (as the scheduler does)


def tolerates(tolerations: Sequence[api.Toleration], taint: Mapping[str, Any]) -> bool:
    """Whether one of ``tolerations`` tolerates ``taint`` (the Pod API's rule)."""
    for t in tolerations:
        if t.effect and t.effect != taint.get("effect"):
            continue
        if t.key and t.key != taint.get("key"):
            continue
        if not t.key and t.operator != "Exists":
            continue
        if t.operator == "Exists" or (t.value or "") == (taint.get("value") or ""):
            return True
    return False


def kept_off_by_scheduler(node: Obj, tolerations: Sequence[api.Toleration]) -> bool:
    """The scheduler by itself never places a pod with ``tolerations`` on ``node``."""
    spec = node.get("spec") or {}
    if spec.get("unschedulable") and not tolerates(tolerations, UNSCHEDULABLE_TAINT):
        return True
    for taint in spec.get("taints") or []:
        if taint.get("effect") not in ("NoSchedule", "NoExecute"):
            continue
        if taint.get("effect") == "NoExecute" and taint.get("key") in ADMISSION_TOLERATED:
            continue
        if not tolerates(tolerations, taint):
            return True
    return False


def _requirement_holds(req: api.NodeSelectorRequirement, value: str | None) -> bool:
    op = req.operator
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op == "In":
        return value is not None and value in req.values
    if op == "NotIn":
        return value is None or value not in req.values
    try:  # Gt, Lt: integers on both sides, else no match
        have, want = int(value or ""), int(req.values[0])
    except (ValueError, IndexError):
        return False
    return have > want if op == "Gt" else have < want


def _term_holds(term: api.NodeSelectorTerm, name: str, labels: Mapping[str, str]) -> bool:
    if not term.match_expressions and not term.match_fields:
        return False  # an empty term selects no node
    fields = {"metadata.name": name}
    return all(_requirement_holds(r, labels.get(r.key)) for r in term.match_expressions) and all(
        _requirement_holds(r, fields.get(r.key)) for r in term.match_fields
    )


def admits(sched: api.Scheduling, name: str, labels: Mapping[str, str]) -> bool:
    """Whether the job's nodeSelector and required node affinity let its pods run on the node."""
    if any(labels.get(k) != v for k, v in sched.node_selector.items()):
        return False
    node_affinity = sched.affinity.node_affinity if sched.affinity else None
    required = node_affinity.required_during_scheduling_ignored_during_execution if node_affinity else None
    return required is None or any(_term_holds(t, name, labels) for t in required.node_selector_terms)


# --------------------------------------------------------------------- the avoid-list and the affinity


def avoid_list(sched: api.Scheduling, nodes: Mapping[str, Obj], unusable: Iterable[str]) -> tuple[str, ...]:
    """The unusable nodes the scheduler could still choose for the job's pods, sorted, at most
    :data:`MAX_AVOIDED` (``nodes``: Node objects by name, as :func:`observe.trim_node` keeps them)."""
    out = []
    for name in sorted(set(unusable)):
        node = nodes.get(name)
        if node is None:
            continue  # gone: nobody can schedule there
        labels = (node.get("metadata") or {}).get("labels") or {}
        if admits(sched, name, labels) and not kept_off_by_scheduler(node, sched.tolerations):
            out.append(name)
    return tuple(out[:MAX_AVOIDED])


def affinity(sched: api.Scheduling, avoid: Iterable[str]) -> Obj | None:
    """The pod's ``affinity``: the user's, with one ``metadata.name NotIn [node]`` field
    requirement per avoided node ANDed into every required node affinity term (or, without
    one, a required term of its own). None when there is nothing to say."""
    user: Obj = sched.affinity.model_dump(by_alias=True, exclude_none=True, mode="json") if sched.affinity else {}
    names = sorted(set(avoid))
    if not names:
        return user or None
    keep_off = [{"key": "metadata.name", "operator": "NotIn", "values": [n]} for n in names]
    node_affinity = dict(user.get("nodeAffinity") or {})
    required = node_affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    terms = required["nodeSelectorTerms"] if required else [{}]
    node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {
        "nodeSelectorTerms": [{**t, "matchFields": [*(t.get("matchFields") or []), *keep_off]} for t in terms]
    }
    return {**user, "nodeAffinity": node_affinity}
