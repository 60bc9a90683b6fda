"""The ways a spot node goes away, as the control plane and the pods see them: a drain that
PodDisruptionBudgets hold, a graceful shutdown with a capped grace period, and an abrupt loss."""

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from spotrl_e2e.checks import pid_alive, wait_file
from spotrl_e2e.cluster import Cluster
from spotrl_e2e.kube import MERGE, path
from spotrl_e2e.manifests import SIGTERM_RECORDER, pdb, python_pod, read_events

pytestmark = pytest.mark.cluster
UNREACHABLE = "node.kubernetes.io/unreachable"


def start_recorder(cluster: Cluster, namespace: str, name: str, node: str, cleanup: str, grace: int) -> Path:
    """A pod on ``node`` that records SIGTERM; returns its events file once it runs."""
    pod = python_pod(name, SIGTERM_RECORDER, args=("/data", cleanup), node=node, grace_seconds=grace)
    cluster.admin().create(path("v1", "pods", namespace), pod)
    cluster.wait_pod(namespace, name, "Running", timeout=30)
    events = cluster.pod_dir(namespace, name) / "volumes" / "data" / "events"
    wait_file(events, "started")
    return events


def guard_with_pdb(cluster: Cluster, namespace: str, app: str) -> None:
    """A PDB that allows no disruption of ``app``, once the disruption controller says so."""
    cluster.admin().create(path("policy/v1", "poddisruptionbudgets", namespace), pdb(app, {"app": app}))
    cluster.admin().wait_for(
        path("policy/v1", "poddisruptionbudgets", namespace, app),
        lambda o: (
            (o or {}).get("status", {}).get("currentHealthy") == 1
            and (o or {}).get("status", {}).get("disruptionsAllowed") == 0
        ),
        30,
        f"PDB {app} observed by the disruption controller",
    )


def test_drain_waits_on_the_pdb_then_sigterm_and_grace(cluster: Cluster, namespace: str) -> None:
    events = start_recorder(cluster, namespace, "guarded", node="spot-a", cleanup="2", grace=20)
    guard_with_pdb(cluster, namespace, "guarded")

    # The Eviction API itself refuses: 429 while the budget allows no disruption.
    status, message = cluster.evict(namespace, "guarded")
    assert status == 429, message
    assert "disruption budget" in message

    drain = cluster.drain("spot-a", timeout=90)
    try:
        deadline = time.monotonic() + 30
        while "disruption budget" not in drain.output():
            assert drain.running(), f"kubectl drain ended early:\n{drain.output()}"
            assert time.monotonic() < deadline, f"kubectl drain never hit the PDB:\n{drain.output()}"
            time.sleep(0.3)
        assert cluster.node("spot-a")["spec"].get("unschedulable") is True
        pod = cluster.admin().get(path("v1", "pods", namespace, "guarded"))
        assert pod["status"]["phase"] == "Running"
        assert "deletionTimestamp" not in pod["metadata"]
        assert "sigterm" not in events.read_text()

        # The budget lets go (what the operator does once its barrier cut is committed).
        released = time.time()
        cluster.admin().patch(
            path("policy/v1", "poddisruptionbudgets", namespace, "guarded"), {"spec": {"minAvailable": 0}}, MERGE
        )
        assert drain.wait(60) == 0, drain.output()
    finally:
        drain.stop()
    assert "drained" in drain.output()
    assert cluster.admin().get_or_none(path("v1", "pods", namespace, "guarded")) is None
    seen = read_events(events.read_text())
    assert seen["sigterm"] >= released
    assert seen["done"] - seen["sigterm"] >= 1.9  # its 2 s of cleanup ran to the end


def test_graceful_shutdown_caps_the_grace_period_and_ignores_pdbs(cluster: Cluster, namespace: str) -> None:
    # The pod asks for 60 s and ignores SIGTERM; the node gives it 4 s (GKE's spot nodes: 15 s).
    events = start_recorder(cluster, namespace, "stubborn", node="spot-b", cleanup="forever", grace=60)
    guard_with_pdb(cluster, namespace, "stubborn")
    (pid,) = cluster.pod_pids(namespace, "stubborn").values()

    t0 = time.monotonic()
    cluster.graceful_shutdown("spot-b", grace_seconds=4)
    took = time.monotonic() - t0
    assert 3.5 <= took < 15, f"graceful shutdown took {took:.1f} s with a 4 s cap"
    assert not pid_alive(pid)
    assert "sigterm" in events.read_text()

    pod = cluster.admin().get(path("v1", "pods", namespace, "stubborn"))
    status = pod["status"]
    assert status["phase"] == "Failed"
    assert status["reason"] == "Terminated"
    assert "node shutdown" in status["message"]
    (container,) = status["containerStatuses"]
    assert container["state"]["terminated"]["exitCode"] == 137  # SIGKILL after the capped grace
    disruption = next(c for c in status["conditions"] if c["type"] == "DisruptionTarget")
    assert disruption["status"] == "True"
    assert disruption["reason"] == "TerminationByKubelet"
    node = cluster.node("spot-b")
    assert cluster.node_ready(node) in ("False", "Unknown")


def test_abrupt_node_loss_leads_to_not_ready_and_eviction(cluster: Cluster, namespace: str) -> None:
    # A short grace period: the check below waits until it has run out.
    pod = python_pod(
        "doomed", "import time\nwhile True: time.sleep(1)", node="spot-a", restart_policy="Always", grace_seconds=2
    )
    cluster.admin().create(path("v1", "pods", namespace), pod)
    cluster.wait_pod(namespace, "doomed", "Running", timeout=30)
    (pid,) = cluster.pod_pids(namespace, "doomed").values()
    assert pid_alive(pid)

    lost_at = time.monotonic()
    cluster.lose_node("spot-a")
    assert not pid_alive(pid)

    # The node controller notices the stale Lease after the grace period (10 s here) ...
    node = cluster.wait_node_condition("spot-a", "Unknown", timeout=40)
    assert time.monotonic() - lost_at >= 5
    taints = {(t["key"], t["effect"]) for t in node["spec"].get("taints", [])}
    assert (UNREACHABLE, "NoExecute") in taints or _gets_unreachable_taint(cluster)

    # ... and the taint manager evicts the pod once its toleration (5 s here) runs out.
    def evicted(p: dict | None) -> bool:
        return p is not None and "deletionTimestamp" in p["metadata"]

    gone = cluster.wait_pod(namespace, "doomed", evicted, timeout=40)
    assert gone is not None
    disruption = next(c for c in gone["status"]["conditions"] if c["type"] == "DisruptionTarget")
    assert disruption["reason"] == "DeletionByTaintManager"
    # Nobody is left on the node to confirm the deletion: the pod stays Terminating, past the
    # end of its grace period (its deletionTimestamp), when a live node would have removed it ...
    assert gone["status"]["phase"] == "Running"
    ends = datetime.fromisoformat(gone["metadata"]["deletionTimestamp"]) + timedelta(seconds=2)
    time.sleep(max(0.0, (ends - datetime.now(UTC)).total_seconds()))
    assert cluster.admin().get_or_none(path("v1", "pods", namespace, "doomed")) is not None

    # ... until the machine comes back: the node finishes the evicted pod and is Ready again.
    cluster.restore_node("spot-a")
    cluster.wait_pod(namespace, "doomed", lambda p: p is None, timeout=30)
    assert cluster.node_ready(cluster.node("spot-a")) == "True"


def _gets_unreachable_taint(cluster: Cluster) -> bool:
    node = cluster.admin().wait_for(
        "/api/v1/nodes/spot-a",
        lambda n: any(
            t["key"] == "node.kubernetes.io/unreachable" for t in (n or {}).get("spec", {}).get("taints", [])
        ),
        20,
        "unreachable taint on spot-a",
    )
    return node is not None
