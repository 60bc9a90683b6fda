"""Which Node and Pod states count as a preemption notice."""

from __future__ import annotations

from spotrl_operator.signals import Signal, is_draining, node_signals, pod_signals


def node(**spec: object) -> dict:
    return {"metadata": {"name": "n1"}, "spec": spec, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def test_a_healthy_node_has_no_signal() -> None:
    assert node_signals(node()) == []
    assert not is_draining(node())


def test_cordon() -> None:
    assert node_signals(node(unschedulable=True)) == [Signal("cordon", "n1", "spec.unschedulable")]


def test_well_known_spot_handler_taints() -> None:
    for key in (
        "aws-node-termination-handler/spot-itn",
        "aws-node-termination-handler/rebalance-recommendation",
        "karpenter.sh/disrupted",
        "cloud.google.com/impending-node-termination",
        "remediator.kubernetes.azure.com/unschedulable",
    ):
        sigs = node_signals(node(taints=[{"key": key, "effect": "NoSchedule"}]))
        assert sigs == [Signal("taint", "n1", key)], key


def test_unrelated_taints_are_ignored_and_extra_keys_count() -> None:
    n = node(
        taints=[
            {"key": "nvidia.com/gpu", "effect": "NoSchedule"},
            {"key": "example.com/reclaim", "effect": "NoExecute"},
        ]
    )
    assert node_signals(n) == []
    assert node_signals(n, ["example.com/*"]) == [Signal("taint", "n1", "example.com/reclaim")]


def test_deletion_and_not_ready() -> None:
    n = node()
    n["metadata"]["deletionTimestamp"] = "2026-11-30T00:00:00Z"
    n["status"]["conditions"] = [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"}]
    assert [s.kind for s in node_signals(n)] == ["node-deleted", "node-not-ready"]


def test_disruption_target_on_a_pod() -> None:
    pod = {
        "spec": {"nodeName": "n2"},
        "status": {"conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]},
    }
    assert pod_signals(pod) == [Signal("disruption-target", "n2", "EvictionByEvictionAPI")]
    pod["status"]["conditions"][0]["status"] = "False"
    assert pod_signals(pod) == []
