"""Which unusable nodes a new pod must be kept off, and how that is written into its affinity."""

from __future__ import annotations

from typing import Any

import pytest

from spotrl_operator import placement, resources
from spotrl_operator.observe import trim_node
from spotrl_operator.resources import JobRef
from spotrl_operator.settings import Settings
from spotrl_runtime.api.rljob import Scheduling, parse_spec

BASE = {
    "policy": {"model": "builtin:tiny-arith"},
    "dataset": {"uri": "builtin:arithmetic"},
    "reward": {"name": "arithmetic_exact"},
    "training": {"totalSteps": 10},
}


def sched(**fields: Any) -> Scheduling:
    return Scheduling.model_validate(fields)


def node(
    name: str,
    labels: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
    unschedulable: bool = False,
    ready: str = "True",
) -> dict[str, Any]:
    return trim_node(
        {
            "metadata": {"name": name, "labels": labels or {}},
            "spec": {"unschedulable": unschedulable, "taints": taints or []},
            "status": {"conditions": [{"type": "Ready", "status": ready}]},
        }
    )


KARPENTER = {"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}
PREFER = {"key": "example.com/going-away", "effect": "PreferNoSchedule"}
TOLERATE_ALL = [{"operator": "Exists"}]


def nodes(*items: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["metadata"]["name"]: n for n in items}


def test_the_scheduler_already_keeps_pods_off_cordoned_and_tainted_nodes() -> None:
    cluster = nodes(node("a", unschedulable=True), node("b", taints=[KARPENTER]), node("c", ready="False"))
    assert placement.avoid_list(sched(), cluster, {"a", "b", "c"}) == ("c",), "only NotReady (no taint yet) is left"


def test_a_pod_that_tolerates_everything_must_be_kept_off_by_name() -> None:
    cluster = nodes(node("a", unschedulable=True), node("b", taints=[KARPENTER]), node("c", ready="False"))
    assert placement.avoid_list(sched(tolerations=TOLERATE_ALL), cluster, {"a", "b", "c"}) == ("a", "b", "c")


def test_tolerations_match_as_the_pod_api_says() -> None:
    t = sched(tolerations=[{"key": "karpenter.sh/disrupted", "operator": "Exists"}]).tolerations
    assert placement.tolerates(t, KARPENTER)
    assert not placement.tolerates(t, {"key": "other", "effect": "NoSchedule"})
    equal = sched(tolerations=[{"key": "k", "value": "v", "effect": "NoSchedule"}]).tolerations
    assert placement.tolerates(equal, {"key": "k", "value": "v", "effect": "NoSchedule"})
    assert not placement.tolerates(equal, {"key": "k", "value": "w", "effect": "NoSchedule"})
    assert not placement.tolerates(equal, {"key": "k", "value": "v", "effect": "NoExecute"})
    # A cordon is the unschedulable taint to the scheduler.
    cordon = sched(tolerations=[{"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}]).tolerations
    assert not placement.kept_off_by_scheduler(node("a", unschedulable=True), cordon)
    assert placement.kept_off_by_scheduler(node("a", unschedulable=True), ())


def test_prefer_no_schedule_and_admission_tolerated_taints_do_not_keep_a_pod_off() -> None:
    assert not placement.kept_off_by_scheduler(node("a", taints=[PREFER]), ())
    unreachable = {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}
    assert not placement.kept_off_by_scheduler(node("a", taints=[unreachable]), ())
    assert placement.kept_off_by_scheduler(node("a", taints=[{**unreachable, "effect": "NoSchedule"}]), ())


def test_only_nodes_the_jobs_own_placement_admits_are_listed() -> None:
    cluster = nodes(
        node("gpu-1", {"pool": "gpu", "zone": "a"}, taints=[PREFER]),
        node("gpu-2", {"pool": "gpu", "zone": "b"}, taints=[PREFER]),
        node("cpu-1", {"pool": "cpu"}, taints=[PREFER]),
    )
    unusable = set(cluster) | {"gone"}
    assert placement.avoid_list(sched(), cluster, unusable) == ("cpu-1", "gpu-1", "gpu-2"), "gone: not schedulable"
    assert placement.avoid_list(sched(nodeSelector={"pool": "gpu"}), cluster, unusable) == ("gpu-1", "gpu-2")
    zone_b = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["cpu-1"]}]},
                ]
            }
        }
    }
    assert placement.avoid_list(sched(affinity=zone_b), cluster, unusable) == ("cpu-1", "gpu-2")


@pytest.mark.parametrize(
    ("operator", "values", "label", "holds"),
    [
        ("In", ["a", "b"], "b", True),
        ("In", ["a"], None, False),
        ("NotIn", ["a"], None, True),
        ("NotIn", ["a"], "a", False),
        ("Exists", [], "", True),
        ("DoesNotExist", [], None, True),
        ("DoesNotExist", [], "x", False),
        ("Gt", ["3"], "4", True),
        ("Gt", ["3"], "3", False),
        ("Lt", ["3"], "2", True),
        ("Lt", ["3"], "two", False),
    ],
)
def test_node_selector_operators(operator: str, values: list[str], label: str | None, holds: bool) -> None:
    expr = {"key": "k", "operator": operator, "values": values}
    s = sched(
        affinity={
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [expr]}]}
            }
        }
    )
    labels = {} if label is None else {"k": label}
    assert placement.admits(s, "n", labels) is holds


def test_the_list_is_capped_so_a_pod_does_not_grow_with_the_cluster() -> None:
    cluster = nodes(*(node(f"n{i:04d}", taints=[PREFER]) for i in range(1000)))
    avoid = placement.avoid_list(sched(), cluster, set(cluster))
    assert len(avoid) == placement.MAX_AVOIDED
    assert avoid == tuple(sorted(avoid))


def test_the_avoid_list_is_anded_into_each_required_term_of_the_user() -> None:
    gpu = {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}
    named = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["x"]}]}
    s = sched(
        affinity={
            "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [gpu, named]}},
            "podAntiAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": "kubernetes.io/hostname"}]
            },
        }
    )
    out = placement.affinity(s, ["b", "a"])
    assert out is not None
    terms = out["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    off = [{"key": "metadata.name", "operator": "NotIn", "values": [n]} for n in ("a", "b")]
    assert [t["matchExpressions"] for t in terms] == [[{"key": "gpu", "operator": "Exists", "values": []}], []]
    assert [t["matchFields"] for t in terms] == [off, [*named["matchFields"], *off]]
    assert out["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"] == (
        "kubernetes.io/hostname"
    ), "the rest of the user's affinity is kept"
    assert placement.affinity(s, []) == s.affinity.model_dump(by_alias=True, exclude_none=True, mode="json")  # type: ignore[union-attr]
    assert placement.affinity(sched(), []) is None


def test_pods_carry_the_users_spread_scheduler_and_priority() -> None:
    spec = parse_spec(
        {
            **BASE,
            "scheduling": {
                "schedulerName": "kai-scheduler",
                "priorityClassName": "batch",
                "topologySpreadConstraints": [
                    {"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
                ],
            },
        }
    )
    pod = resources.controller_pod(JobRef("j", "ns", "u"), spec, Settings(default_storage="s3://b/p"), 1)["spec"]
    assert pod["schedulerName"] == "kai-scheduler"
    assert pod["priorityClassName"] == "batch"
    assert pod["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": "topology.kubernetes.io/zone",
            "whenUnsatisfiable": "DoNotSchedule",
            "matchLabelKeys": [],
        }
    ]
    assert "affinity" not in pod
