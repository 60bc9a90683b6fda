"""From API objects to the World the lifecycle decides on: pods, node signals, lost nodes, PDB."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from spotrl_operator.fleet import Fleet
from spotrl_operator.observe import Snapshot, deleting_since, pod_view, trim_node, trim_pdb, trim_pod, world_of
from spotrl_operator.settings import Settings
from spotrl_runtime.api.rljob import SpecError
from spotrl_runtime.api.times import rfc3339

NOW = datetime(2026, 11, 30, 12, 0, 0, tzinfo=UTC)
SETTINGS = Settings(default_storage="s3://bucket/root", extra_taint_keys=("example.com/going-away",))


def job(**status: Any) -> dict[str, Any]:
    return {
        "apiVersion": "spotrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "j", "namespace": "ns", "uid": "u1", "generation": 4, "resourceVersion": "77"},
        "spec": {
            "policy": {"model": "builtin:tiny-arith"},
            "dataset": {"uri": "builtin:arithmetic"},
            "reward": {"name": "arithmetic_exact"},
            "training": {"totalSteps": 10},
            "preemption": {"extraTaintKeys": ["job.example/notice"]},
        },
        "status": {"kopf": {"progress": {}}, **status},
    }


def node(name: str, ready: str = "True", since: float | None = None, **spec: Any) -> dict[str, Any]:
    """``since``: seconds before NOW that Ready turned to ``ready`` (default: long ago)."""
    cond: dict[str, Any] = {"type": "Ready", "status": ready}
    since = 3600.0 if since is None and ready != "True" else since
    if since is not None:
        cond["lastTransitionTime"] = rfc3339(NOW - timedelta(seconds=since))
    return {
        "metadata": {"name": name, "labels": {"x": "y"}, "resourceVersion": "5"},
        "spec": spec,
        "status": {"conditions": [{"type": "MemoryPressure", "status": "False"}, cond]},
    }


def pod(name: str, attempt: int, node_name: str | None = "spot-a", **extra: Any) -> dict[str, Any]:
    meta = {
        "name": name,
        "namespace": "ns",
        "labels": {"spotrl.dev/job": "j", "spotrl.dev/role": "controller", "spotrl.dev/attempt": str(attempt)},
    }
    meta.update(extra.pop("meta", {}))
    return {"metadata": meta, "spec": {"nodeName": node_name}, "status": {"phase": "Running", **extra}}


def nodes(*items: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["metadata"]["name"]: trim_node(n) for n in items}


def test_a_quiet_cluster() -> None:
    w = world_of(
        Snapshot(job=job(attempt=1), pods=(pod("j-controller-1", 1),), nodes=nodes(node("spot-a"))), SETTINGS, NOW
    )
    assert w.generation == 4
    assert w.status.attempt == 1, "status.kopf is Kopf's, not the model's; it is left out"
    assert w.signals == ()
    assert w.unusable_nodes == frozenset()
    assert w.lost_nodes == frozenset()
    assert w.pdb_open is False, "no PDB counts as closed"
    (p,) = w.pods
    assert (p.name, p.attempt, p.phase, p.node, p.deleting_since) == ("j-controller-1", 1, "Running", "spot-a", None)


def test_signals_come_from_the_controller_node_with_the_operator_and_job_taint_keys() -> None:
    snap = Snapshot(
        job=job(),
        pods=(pod("j-controller-1", 1),),
        nodes=nodes(
            node("spot-a", taints=[{"key": "job.example/notice", "effect": "NoSchedule"}]),
            node("spot-b", taints=[{"key": "example.com/going-away", "effect": "NoSchedule"}]),
            node("ondemand-a", unschedulable=True),
        ),
    )
    w = world_of(snap, SETTINGS, NOW)
    assert [(s.kind, s.node, s.detail) for s in w.signals] == [("taint", "spot-a", "job.example/notice")]
    assert w.unusable_nodes == {"spot-a", "spot-b", "ondemand-a"}
    # Each of them keeps pods off by itself (NoSchedule taints, a cordon): nothing to name.
    assert w.avoid_nodes == frozenset()


def test_ready_unknown_past_the_grace_period_and_deleted_nodes_are_lost_ready_false_is_not() -> None:
    grace = SETTINGS.node_lost_seconds
    snap = Snapshot(
        job=job(),
        pods=(pod("j-controller-1", 1, "gone-node"),),
        nodes=nodes(
            node("spot-a", ready="Unknown", since=grace + 1), node("spot-b", ready="False", since=999), node("up")
        ),
    )
    w = world_of(snap, SETTINGS, NOW)
    assert w.lost_nodes == {"spot-a", "gone-node"}
    assert w.unusable_nodes == {"spot-a", "spot-b", "gone-node"}
    # Not ready and not yet tainted by the node controller: only a name keeps a pod off them.
    # A deleted node needs no name: nothing is scheduled onto it.
    assert w.avoid_nodes == {"spot-a", "spot-b"}
    assert ("node-deleted", "gone-node") in [(s.kind, s.node) for s in w.signals]


def test_disruption_target_exit_code_and_deletion_start() -> None:
    p = pod(
        "j-controller-2",
        2,
        conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}],
        containerStatuses=[{"name": "controller", "state": {"terminated": {"exitCode": 143}}}],
        meta={"deletionTimestamp": "2026-11-30T12:00:30Z", "deletionGracePeriodSeconds": 30},
    )
    v = pod_view(trim_pod(p))
    assert v.disruption == "EvictionByEvictionAPI"
    assert v.exit_code == 143
    assert v.deleting_since == NOW, "deletionTimestamp is the end of the grace period, not its start"
    assert deleting_since(pod("x", 1)) is None


def worker_pod(name: str, attempt: int, index: str, node_name: str | None = "spot-b", **extra: Any) -> dict[str, Any]:
    p = pod(name, attempt, node_name, **extra)
    p["metadata"]["labels"].update({"spotrl.dev/role": "worker", "spotrl.dev/worker-index": index})
    return p


def test_workers_are_told_apart_from_controllers_and_the_pdb_state_is_read() -> None:
    snap = Snapshot(
        job=job(),
        pods=(worker_pod("j-worker-1-0", 1, "0"), worker_pod("j-worker-1-1", 1, "x")),
        pdb={"spec": {"minAvailable": 0}},
    )
    w = world_of(snap, SETTINGS, NOW)
    assert w.pods == ()
    assert [(v.name, v.attempt, v.index) for v in w.workers] == [("j-worker-1-0", 1, 0), ("j-worker-1-1", 1, None)]
    assert w.pdb_open is True
    assert world_of(Snapshot(job=job(), pdb={"spec": {"minAvailable": 1}}), SETTINGS, NOW).pdb_open is False


def test_a_worker_node_raises_no_signal_but_can_be_lost() -> None:
    snap = Snapshot(
        job=job(rayHead={"address": "127.0.1.2:4000", "attempt": 1, "workers": 2}, workersReady=2),
        pods=(
            pod("j-controller-1", 1, "spot-a"),
            worker_pod("j-worker-1-0", 1, "0", "spot-b"),
            worker_pod("j-worker-1-1", 1, "1", "gone"),
        ),
        nodes=nodes(node("spot-a"), node("spot-b", ready="Unknown", unschedulable=True)),
    )
    w = world_of(snap, SETTINGS, NOW)
    assert w.signals == (), "a worker's node going away is no notice for the job"
    assert w.lost_nodes == {"spot-b", "gone"}
    assert w.status.ray_head is not None
    assert (w.status.ray_head.address, w.status.ray_head.attempt, w.status.workers_ready) == ("127.0.1.2:4000", 1, 2)


def trainer_pod(name: str, attempt: int, index: str, node_name: str | None = "spot-b", **extra: Any) -> dict[str, Any]:
    p = pod(name, attempt, node_name, **extra)
    p["metadata"]["labels"].update({"spotrl.dev/role": "trainer", "spotrl.dev/trainer-index": index})
    return p


def test_a_trainer_pods_node_raises_the_jobs_signals_and_its_disruption_is_on_its_view() -> None:
    evicted = [{"type": "DisruptionTarget", "status": "True", "reason": "DeletionByTaintManager"}]
    snap = Snapshot(
        job=job(),
        pods=(
            pod("j-controller-1", 1, "spot-a"),
            trainer_pod("j-trainer-1-0", 1, "0", "spot-b", conditions=evicted),
            trainer_pod("j-trainer-1-1", 1, "1", "spot-a"),
            trainer_pod("j-trainer-1-2", 1, "2", "gone"),
        ),
        nodes=nodes(node("spot-a", unschedulable=True), node("spot-b", taints=[{"key": "karpenter.sh/disrupted"}])),
    )
    w = world_of(snap, SETTINGS, NOW)
    assert w.pods[0].name == "j-controller-1"
    assert [(v.name, v.attempt, v.index, v.disruption) for v in w.trainers] == [
        ("j-trainer-1-0", 1, 0, "DeletionByTaintManager"),
        ("j-trainer-1-1", 1, 1, None),
        ("j-trainer-1-2", 1, 2, None),
    ]
    assert w.workers == ()
    # spot-a's cordon once though two of the job's pods run there; the trainer pod's
    # DisruptionTarget is not a signal of the job's (an older attempt's pod must not raise one).
    assert [(s.kind, s.node) for s in w.signals] == [
        ("cordon", "spot-a"),
        ("taint", "spot-b"),
        ("node-deleted", "gone"),
    ]
    assert w.lost_nodes == {"gone"}


def test_a_budget_that_holds_other_pods_than_the_job_wants_is_stale() -> None:
    trainers = job()
    trainers["spec"]["training"]["parallelism"] = {"strategy": "fsdp", "ranks": 2, "trainerPods": True}
    no_standby = {"key": "spotrl.dev/standby", "operator": "DoesNotExist"}
    controller_only = {
        "matchLabels": {"spotrl.dev/job": "j"},
        "matchExpressions": [{"key": "spotrl.dev/role", "operator": "In", "values": ["controller"]}, no_standby],
    }
    both = {
        "matchLabels": {"spotrl.dev/job": "j"},
        "matchExpressions": [
            {"key": "spotrl.dev/role", "operator": "In", "values": ["controller", "trainer"]},
            no_standby,
        ],
    }
    before_standbys = {"matchLabels": {"spotrl.dev/job": "j", "spotrl.dev/role": "controller"}}

    def world(doc: dict[str, Any], min_available: int, selector: dict[str, Any]) -> Any:
        pdb = trim_pdb(
            {"metadata": {"name": "j-controller"}, "spec": {"minAvailable": min_available, "selector": selector}}
        )
        return world_of(Snapshot(job=doc, pdb=pdb), SETTINGS, NOW)

    assert (world(job(), 1, controller_only).pdb_stale, world(job(), 1, controller_only).pdb_open) == (False, False)
    assert world(trainers, 3, both).pdb_stale is False
    assert world(trainers, 1, controller_only).pdb_stale is True, "made before the job had trainer pods"
    assert world(trainers, 2, both).pdb_stale is True, "ranks changed"
    assert world(job(), 3, both).pdb_stale is True
    assert world(job(), 1, before_standbys).pdb_stale is True, "an older operator's budget would hold a standby"
    assert (world(trainers, 0, controller_only).pdb_stale, world(trainers, 0, both).pdb_open) == (False, True)


def test_no_storage_anywhere_is_a_configuration_error_naming_the_field() -> None:
    w = world_of(Snapshot(job=job()), Settings(), NOW)
    assert w.config_error is not None
    assert "spec.checkpoint.storage" in w.config_error


def test_a_spec_the_model_rejects_raises_with_the_field() -> None:
    bad = job()
    bad["spec"]["training"]["totalSteps"] = 0
    with pytest.raises(SpecError, match=r"spec\.training\.totalSteps"):
        world_of(Snapshot(job=bad), SETTINGS, NOW)


def test_trimmed_objects_keep_only_what_is_read() -> None:
    t = trim_node(node("spot-a", taints=[{"key": "k", "effect": "NoSchedule"}]))
    assert t["status"]["conditions"] == [
        {"type": "Ready", "status": "True", "reason": None, "lastTransitionTime": None}
    ]
    assert "resourceVersion" not in t["metadata"], "a heartbeat must not look like a change"
    assert t["metadata"]["labels"] == {"x": "y"}, "the placement reads labels (nodeSelector, affinity)"
    assert trim_node(node("a", providerID="gce://p/z/n"))["spec"]["providerID"] == "gce://p/z/n", "its cloud"


def test_the_clouds_are_the_schemes_of_the_nodes_provider_ids() -> None:
    eks = nodes(
        node("spot-a", providerID="aws:///us-east-1a/i-0abc"),
        node("od-b", providerID="aws:///us-east-1b/i-0def"),
        node("bare-c"),  # no providerID: no cloud
        node("odd-d", providerID="i-0ghi"),  # no scheme: no cloud
    )
    w = world_of(Snapshot(job=job(attempt=1), pods=(pod("j-controller-1", 1),), nodes=eks), SETTINGS, NOW)
    assert w.clouds == {"aws"}
    gke = nodes(node("spot-a", providerID="gce://proj/us-central1-a/gke-pool-1"))
    fleet = Fleet()
    for name, n in gke.items():
        fleet.update(name, n, NOW)
    snap = Snapshot(job=job(attempt=1), pods=(pod("j-controller-1", 1),), nodes=gke, fleet=fleet.view())
    assert world_of(snap, SETTINGS, NOW).clouds == {"gce"}
    fleet.update("spot-a", None, NOW)
    assert fleet.view().clouds == frozenset(), "a cloud goes with its last node"


def test_a_node_unknown_for_less_than_the_grace_period_is_not_lost_yet() -> None:
    grace = SETTINGS.node_lost_seconds
    up = node("up")  # one node Ready: not every zone is down
    snap = Snapshot(job=job(), pods=(pod("j-controller-1", 1),), nodes=nodes(node("spot-a", "Unknown", grace - 5), up))
    w = world_of(snap, SETTINGS, NOW)
    assert w.lost_nodes == frozenset()
    assert "spot-a" in w.unusable_nodes  # no new pod goes there meanwhile
    assert world_of(snap, SETTINGS, NOW + timedelta(seconds=5)).lost_nodes == {"spot-a"}


def test_an_unreachable_taint_counts_from_when_it_was_added_and_out_of_service_at_once() -> None:
    grace = SETTINGS.node_lost_seconds
    long_ago = rfc3339(NOW - timedelta(seconds=grace + 1))
    just_now = rfc3339(NOW - timedelta(seconds=1))
    snap = Snapshot(
        job=job(),
        pods=(pod("j-controller-1", 1),),
        nodes=nodes(
            node(
                "spot-a",
                "False",  # NotReady, tainted unreachable: the taint's time decides
                taints=[{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": long_ago}],
            ),
            node(
                "spot-b",
                "False",
                taints=[{"key": "node.kubernetes.io/unreachable", "effect": "NoExecute", "timeAdded": just_now}],
            ),
            node("spot-c", taints=[{"key": "node.kubernetes.io/out-of-service", "effect": "NoExecute"}]),
            node("up"),
        ),
    )
    assert world_of(snap, SETTINGS, NOW).lost_nodes == {"spot-a", "spot-c"}


def test_with_most_nodes_unknown_at_once_none_is_lost_and_the_job_says_why() -> None:
    """60% of the nodes Unknown past the grace period: the control plane, not the nodes; only an
    out-of-service node (an administrator's word) is still lost."""
    grace = SETTINGS.node_lost_seconds
    unknown = [node(f"n{i}", "Unknown", grace * 10) for i in range(6)]
    healthy = [node(f"h{i}") for i in range(3)]
    oos = node("gone", taints=[{"key": "node.kubernetes.io/out-of-service", "effect": "NoExecute"}])
    snap = Snapshot(job=job(), pods=(pod("j-controller-1", 1, "n0"),), nodes=nodes(*unknown, *healthy, oos))
    w = world_of(snap, SETTINGS, NOW)
    assert w.lost_nodes == {"gone"}
    assert w.force_deletes_paused is not None
    assert "6 of the 10 nodes of zone (unlabelled) are not Ready (at least 55%)" in w.force_deletes_paused
    assert "n0" in w.force_deletes_paused
    # One node fewer unhealthy (5 of 10, at most 55%): the brake is off, the grace period decides.
    calmer = Snapshot(job=job(), pods=snap.pods, nodes=nodes(*unknown[:5], *healthy, node("n5"), oos))
    w2 = world_of(calmer, SETTINGS, NOW)
    assert w2.lost_nodes == {"n0", "n1", "n2", "n3", "n4", "gone"}
    assert w2.force_deletes_paused is None


def test_a_node_missing_from_the_cache_is_lost_only_once_confirmed_gone() -> None:
    snap = Snapshot(job=job(), pods=(pod("j-controller-1", 1, "brand-new"),), nodes=nodes(node("spot-a")))
    unconfirmed = world_of(Snapshot(**{**snap.__dict__, "gone": frozenset()}), SETTINGS, NOW)
    assert unconfirmed.lost_nodes == frozenset()
    assert unconfirmed.signals == ()
    confirmed = world_of(Snapshot(**{**snap.__dict__, "gone": frozenset({"brand-new"})}), SETTINGS, NOW)
    assert confirmed.lost_nodes == {"brand-new"}
    assert [(s.kind, s.node) for s in confirmed.signals] == [("node-deleted", "brand-new")]


def test_a_status_written_by_a_newer_version_is_read_not_refused() -> None:
    """Fields and values this version does not know, at every depth: the pass reads the rest."""
    newer = job(
        attempt=3,
        phase="Hibernating",
        futureField={"x": 1},
        barrier={"requestId": "r1", "state": "Requested", "reason": "cordon", "newKnob": True},
    )
    w = world_of(Snapshot(job=newer, pods=(pod("j-controller-3", 3),), nodes=nodes(node("spot-a"))), SETTINGS, NOW)
    assert w.status.attempt == 3
    assert w.status.phase is None
    assert w.status.barrier is not None
    assert w.status.barrier.request_id == "r1"


def test_the_jobs_objects_missing_or_another_uids_are_named() -> None:
    base = Snapshot(job=job(), pods=(pod("j-controller-1", 1),), nodes=nodes(node("spot-a")))
    mine = frozenset({("ServiceAccount", "u1"), ("Role", "u1"), ("RoleBinding", "u1"), ("NetworkPolicy", "u1")})
    pdb = trim_pdb({"metadata": {"ownerReferences": [{"kind": "RLJob", "uid": "u1", "controller": True}]}, "spec": {}})
    w = world_of(Snapshot(**{**base.__dict__, "children": mine | {("Service", "old-uid")}, "pdb": pdb}), SETTINGS, NOW)
    assert w.missing_children == ("Service",)
    w = world_of(Snapshot(**{**base.__dict__, "children": mine | {("Service", "u1")}}), SETTINGS, NOW)
    assert w.missing_children == ("PodDisruptionBudget",)
    assert w.pdb_stale is False
    assert world_of(base, SETTINGS, NOW).missing_children == (), "not watched: not checked"


def test_a_pod_or_budget_of_another_job_uid_is_not_the_jobs() -> None:
    """A deleted job's controller pod and budget, same names, still being collected."""
    theirs = {"ownerReferences": [{"kind": "RLJob", "uid": "old-uid", "controller": True}]}
    old_pdb = trim_pdb({"metadata": theirs, "spec": {"minAvailable": 0}})
    snap = Snapshot(job=job(), pods=(pod("j-controller-1", 1, meta=theirs),), nodes=nodes(node("spot-a")), pdb=old_pdb)
    w = world_of(snap, SETTINGS, NOW)
    assert w.pods == ()
    assert w.pdb_open is False


def test_a_pod_failed_by_the_kubelet_before_any_container_ran_is_rejected_not_crashed() -> None:
    admitted_not = pod(
        "j-controller-1", 1, phase="Failed", reason="UnexpectedAdmissionError", message="Allocate failed"
    )
    assert pod_view(admitted_not).rejected == "UnexpectedAdmissionError: Allocate failed"
    assert pod_view(trim_pod(admitted_not)).rejected == "UnexpectedAdmissionError: Allocate failed"
    ran = pod(
        "j-controller-1",
        1,
        phase="Failed",
        reason="Error",
        containerStatuses=[{"state": {"terminated": {"exitCode": 1}}}],
    )
    assert pod_view(ran).rejected is None
    assert pod_view(ran).exit_code == 1


class NodeLookups:
    """A narrow fake: GET a Node by name (None: 404; an exception: unreachable)."""

    def __init__(self, nodes: dict[str, Any]):
        self.nodes = nodes
        self.asked: list[str] = []

    def get_or_none(self, url: str) -> Any:
        name = url.rsplit("/", 1)[-1]
        self.asked.append(name)
        found = self.nodes.get(name)
        if isinstance(found, Exception):
            raise found
        return found


def test_nodes_missing_from_the_cache_are_looked_up_live() -> None:
    from spotrl_operator.fleet import view_of
    from spotrl_operator.observe import confirm_missing
    from spotrl_runtime.kube import KubeError

    cached = nodes(node("spot-a"))
    pods = (pod("j-controller-1", 1, "brand-new"), pod("j-worker-1-0", 1, "gone"), pod("j-worker-1-1", 1, "flaky"))
    snap = Snapshot(job=job(), pods=pods, nodes=cached, fleet=view_of(cached, NOW))
    kube = NodeLookups({"brand-new": node("brand-new"), "flaky": KubeError("GET", "x", 0, "Unreachable", "")})
    out = confirm_missing(kube, snap)  # type: ignore[arg-type]
    assert sorted(kube.asked) == ["brand-new", "flaky", "gone"], "only the missing ones, never spot-a"
    assert out.gone == {"gone"}, "a 404 is gone; an error confirms nothing"
    assert "brand-new" in out.nodes
    assert out.fleet is None, "a node the fleet lacks: this pass reads the nodes instead"
    assert world_of(out, SETTINGS, NOW).lost_nodes == {"gone"}
    quiet = confirm_missing(kube, Snapshot(job=job(), pods=(pod("j-controller-1", 1),), nodes=cached))  # type: ignore[arg-type]
    assert quiet.gone == frozenset()


def test_the_pass_after_a_grace_period_comes_on_time() -> None:
    from spotrl_operator.fleet import view_of
    from spotrl_operator.observe import seconds_until_lost

    grace = SETTINGS.node_lost_seconds
    cached = nodes(node("spot-a", "Unknown", since=grace - 12), node("spot-b", "Unknown", since=grace + 1), node("up"))
    snap = Snapshot(job=job(), pods=(pod("j-controller-1", 1, "spot-a"),), nodes=cached, fleet=view_of(cached, NOW))
    assert seconds_until_lost(snap, SETTINGS, NOW) == pytest.approx(12)
    healthy = Snapshot(job=job(), pods=(pod("j-controller-1", 1, "spot-c"),), nodes=cached, fleet=view_of(cached, NOW))
    assert seconds_until_lost(healthy, SETTINGS, NOW) is None


def zoned(name: str, zone: str, ready: str = "True", since: float | None = None) -> dict[str, Any]:
    n = node(name, ready, since)
    n["metadata"]["labels"] = {"topology.kubernetes.io/zone": zone}
    return n


def test_per_zone_a_partial_zone_holds_its_pods_and_a_zone_wholly_down_loses_them() -> None:
    """Zone x: 3 of 5 Unknown (60%): the job's controller there is held, and the job says which
    zone; zone y wholly Unknown while x has Ready nodes: its nodes are lost, though 6 of 8 nodes
    are unhealthy fleet-wide."""
    grace = SETTINGS.node_lost_seconds
    xs = [zoned(f"x{i}", "x", "Unknown" if i < 3 else "True", grace * 10) for i in range(5)]
    ys = [zoned(f"y{i}", "y", "Unknown", grace * 10) for i in range(3)]
    held = world_of(Snapshot(job=job(), pods=(pod("j-controller-1", 1, "x0"),), nodes=nodes(*xs, *ys)), SETTINGS, NOW)
    assert held.lost_nodes == {"y0", "y1", "y2"}
    assert held.force_deletes_paused is not None
    assert "3 of the 5 nodes of zone x are not Ready (at least 55%)" in held.force_deletes_paused
    gone = world_of(Snapshot(job=job(), pods=(pod("j-controller-1", 1, "y0"),), nodes=nodes(*xs, *ys)), SETTINGS, NOW)
    assert "y0" in gone.lost_nodes
    assert gone.force_deletes_paused is None


def test_the_grace_period_is_counted_on_the_api_servers_clock() -> None:
    """Unknown for 10 s by the API server's clock, which runs 10 minutes ahead of the operator's:
    by the operator's clock the condition is from the future; with the offset it is lost once
    the grace period has passed on the API server's clock."""
    grace = SETTINGS.node_lost_seconds
    ahead = timedelta(minutes=10)
    cached = nodes(node("spot-a", "Unknown", since=-ahead.total_seconds() + 10), node("up"))  # server's NOW+10min-10s
    snap = Snapshot(job=job(), pods=(pod("j-controller-1", 1, "spot-a"),), nodes=cached)
    assert world_of(snap, SETTINGS, NOW + timedelta(seconds=grace)).lost_nodes == frozenset()
    skewed = replace(snap, server_offset=ahead)
    assert world_of(skewed, SETTINGS, NOW).lost_nodes == frozenset()
    assert world_of(skewed, SETTINGS, NOW + timedelta(seconds=grace - 10)).lost_nodes == {"spot-a"}
