"""End to end: trainer ranks in pods of their own (``spec.training.parallelism.trainerPods``).

The tiny job trains a LoRA adapter (``policy.lora``: the base frozen, the adapter's shards alone
in every cut) with two FSDP2 ranks (CPU, gloo), each in a trainer pod of its own that
joins the controller's Ray cluster as a node offering one rank's slot, the two pods on two
nodes. Then the node of one trainer pod (not the controller's) is drained mid-run: losing a
rank is a preemption of the trainer group, so the operator asks the controller for a barrier
cut (the ranks write their shards of it), the PodDisruptionBudget holds the drain until that
cut commits, and a fresh attempt (controller and trainer pods) away from the drained node
resumes from it. The job trains exactly the prompt stream of the same job never disturbed
(``spotrl audit``). Real parts only: API server, controllers, node agent or kubelet, S3
server, operator, `spotrl controller` and `spotrl worker --role trainer`.

Each trainer pod asks for 3 of a node's 4 CPUs, so no two share a node, and the controller
(1 CPU) fits beside one: three nodes run attempt 1, two run attempt 2.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from operator_harness import TARGET, Jobs, JobStorage, wait_until
from test_preemption import (
    AWS_NOTICE,
    assert_same_stream,
    assert_stopped_after,
    succeeded,
    tiny_job,
    training,
)

from spotrl_e2e.checks import assert_adapter_alone
from spotrl_e2e.procs import ray_processes_on
from spotrl_runtime.core.validation import INDEX_ROLE, SHARD_ROLE

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
NAME = "fsdp"


def trainer_job(storage: JobStorage) -> dict[str, Any]:
    job = tiny_job(NAME, storage, {})
    spec = job["spec"]
    spec["policy"]["lora"] = {"rank": 8}
    spec["training"]["parallelism"] = {
        "strategy": "fsdp",
        "ranks": 2,
        "gpusPerRank": 0,
        "cpusPerRank": 1,
        "trainerPods": True,
        "resources": {"cpu": "3", "memory": "2Gi"},
    }
    spec["training"]["resources"] = {"cpu": "1", "memory": "2Gi"}
    return job


def start(cluster: Any, jobs: Jobs, storage: JobStorage) -> None:
    if cluster.admin().get_or_none(f"/api/v1/namespaces/{jobs.ns}/secrets/s3") is None:
        cluster.admin().create(f"/api/v1/namespaces/{jobs.ns}/secrets", storage.secret())
    jobs.create(trainer_job(storage))


def trainer_pods(jobs: Jobs, attempt: int | None = None) -> list[dict[str, Any]]:
    return [
        p
        for p in jobs.pods(NAME)
        if p["metadata"]["labels"].get("spotrl.dev/role") == "trainer"
        and (attempt is None or p["metadata"]["labels"].get("spotrl.dev/attempt") == str(attempt))
    ]


def running_trainers(jobs: Jobs, attempt: int) -> list[dict[str, Any]]:
    """The attempt's two trainer pods once both run (their node and IP known)."""
    found: list[dict[str, Any]] = []

    def both() -> bool:
        found[:] = [p for p in trainer_pods(jobs, attempt) if (p.get("status") or {}).get("phase") == "Running"]
        return len(found) == 2

    wait_until(both, 120, f"the two trainer pods of attempt {attempt} running")
    return sorted(found, key=lambda p: p["metadata"]["name"])


def rank_pods(cluster: Any, jobs: Jobs, controller: str) -> list[str]:
    """The pod each rank's process runs in: the controller logs the ranks' pids, and a rank (a
    Ray worker process of the node it was placed on) has its pod's environment."""
    found: list[str] = []

    def logged() -> bool:
        log = cluster.pod_log(jobs.ns, controller, "controller")
        m = re.search(r"trainer group: \d+ FSDP2 ranks on \S+ \(pids \[([\d, ]+)\]\)", log)
        if m is None:
            return False
        found[:] = [_pod_of(int(pid)) for pid in m.group(1).split(",")]
        return True

    try:
        wait_until(logged, 120, f"{controller} to start its trainer group")
    except TimeoutError as err:
        raise AssertionError(f"{err}; the logs end:\n{logs(cluster, jobs)}") from None
    return found


def logs(cluster: Any, jobs: Jobs, *pods: str) -> str:
    """The tails of the controller's log and of the trainer pods' (for a failure's message)."""
    out = []
    for name in pods or [p["metadata"]["name"] for p in jobs.pods(NAME)]:
        container = "controller" if "-controller-" in name else "trainer"
        try:
            out.append(f"--- {name}\n{cluster.pod_log(jobs.ns, name, container)[-3000:]}")
        except Exception as err:
            out.append(f"--- {name}: {err}")
    return "\n".join(out)


def _pod_of(pid: int) -> str:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError as err:
        return f"(pid {pid}: {err})"
    names = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"SPOTRL_POD_NAME=")]
    return names[0] if names else f"(pid {pid}: no pod)"


def assert_an_adapter_cut(storage: JobStorage, cut: str) -> None:
    """The barrier cut is a full cut of the adapter's shards (every rank's), with its identity."""
    client = storage.client()

    def read(key: str) -> bytes:
        return bytes(client.get_object(Bucket=storage.bucket, Key=f"{NAME}/cuts/{cut}/{key}")["Body"].read())

    manifest = json.loads(read("manifest.json"))
    assert (manifest["form"], manifest["trainer_format"]) == ("full", "dcp/v1"), manifest
    meta = json.loads(read(next(f["path"] for f in manifest["files"] if f["role"] == "trainer_meta")))
    assert meta["adapter"]["rank"] == 8, meta
    index = read(next(f["path"] for f in manifest["files"] if f["role"] == INDEX_ROLE))
    shards = [f for f in manifest["files"] if f["role"] == SHARD_ROLE]
    assert_adapter_alone(index, sum(f["size"] for f in shards), "builtin:tiny-arith", 8)


def check_trainer_pods(
    cluster: Any, jobs: Jobs, storage: JobStorage, st: dict[str, Any], attempt: int
) -> list[dict[str, Any]]:
    """The attempt's trainer pods as the operator made them, and the Ray head they joined."""
    head = st["rayHead"]
    assert (head["attempt"], head["trainers"], head.get("workers", 0)) == (attempt, 2, 0), head
    controller = cluster.admin().get(f"/api/v1/namespaces/{jobs.ns}/pods/{st['controllerPod']}")
    assert head["address"].startswith(f"{controller['status']['podIP']}:"), (head, controller["status"])
    pods = running_trainers(jobs, attempt)
    assert [p["metadata"]["name"] for p in pods] == [f"{NAME}-trainer-{attempt}-0", f"{NAME}-trainer-{attempt}-1"]
    assert len({p["spec"]["nodeName"] for p in pods}) == 2, "each trainer pod on a node of its own"
    for p in pods:
        assert p["spec"]["restartPolicy"] == "Never"
        assert p["spec"]["automountServiceAccountToken"] is False
        (c,) = p["spec"]["containers"]
        assert c["command"] == ["spotrl", "worker"]
        assert c["args"][:4] == ["--role", "trainer", "--address", head["address"]]
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["SPOTRL_STORAGE"] == storage.uri(NAME), "a rank writes its shards of each cut there"
        assert c["envFrom"] == [{"secretRef": {"name": "s3"}}], "and with the job's keys"
    pdb = cluster.admin().get(f"/apis/policy/v1/namespaces/{jobs.ns}/poddisruptionbudgets/{NAME}-controller")
    assert pdb["spec"]["minAvailable"] == 3, "closed: the controller and both trainer pods"
    # As the operator builds it: the selector the API server keeps is the one it compares with
    # (else it would find the budget stale and close it again on every pass).
    assert pdb["spec"]["selector"] == {
        "matchLabels": {"spotrl.dev/job": NAME},
        "matchExpressions": [
            {"key": "spotrl.dev/role", "operator": "In", "values": ["controller", "trainer"]},
            {"key": "spotrl.dev/standby", "operator": "DoesNotExist"},
        ],
    }
    if TARGET != "kind":
        ranks = rank_pods(cluster, jobs, st["controllerPod"])
        assert sorted(ranks) == [p["metadata"]["name"] for p in pods], "one rank in each trainer pod, none elsewhere"
    return pods


def no_trainer_left(cluster: Any, jobs: Jobs, ips: set[str]) -> None:
    """The job is done: its trainer pods are deleted, and nothing of their Ray is left."""
    wait_until(lambda: trainer_pods(jobs) == [], 60, "the trainer pods to be deleted")
    if TARGET != "kind":
        deadline = time.monotonic() + 30
        while any(ray_processes_on(ip) for ip in ips) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert [p for ip in ips for p in ray_processes_on(ip)] == []


def test_a_drained_trainer_node_waits_for_the_barrier_cut_and_the_group_resumes_elsewhere(
    e2e_cluster: Any, e2e_jobs: Jobs, e2e_storage: JobStorage, reference: dict[int, Any]
) -> None:
    cluster, jobs = e2e_cluster, e2e_jobs
    start(cluster, jobs, e2e_storage)
    st = training(jobs, NAME, 2)
    pods = check_trainer_pods(cluster, jobs, e2e_storage, st, attempt=1)
    # Marked against a node autoscaler's consolidation; the notice below still drains them.
    assert all(p["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true" for p in pods)
    st = jobs.wait(NAME, lambda s: s.get("trainersReady") == 2, 60, "trainersReady 2")
    assert (st["trainersAttempt"], st["preemptions"], st["restarts"]) == (1, 0, 0)
    victim = next(p for p in pods if p["spec"]["nodeName"] != st["controllerNode"])
    node, pod = victim["spec"]["nodeName"], victim["metadata"]["name"]

    # The notice: the operator asks the controller for a barrier; the trainer pod's eviction
    # gets 429 until the cut commits (the PDB holds the trainer pods with the controller).
    cluster.taint(node, AWS_NOTICE, "true")
    code, message = cluster.evict(jobs.ns, pod)
    assert code == 429, f"the trainer pod was evicted before the cut committed: {code} {message}"
    drain = cluster.drain(node, timeout=300)
    try:
        cut, committed_at = jobs.barrier_commit(NAME, 120)
        (notice,) = [e["message"] for e in jobs.events(NAME) if e["reason"] == "PreemptionNotice"]
        assert f"on node {node} (trainer pod {pod})" in notice, notice
        st = jobs.status(NAME)
        assert int(st["lastCut"]["id"]) >= int(cut)
        assert_an_adapter_cut(e2e_storage, cut)  # read now: retention deletes it before the run ends
        assert drain.wait(300) == 0, drain.output()
    finally:
        drain.stop()
    assert_stopped_after(cluster, jobs.ns, pod, committed_at)

    # A fresh attempt, controller and trainer pods, none on the drained node, resumes from the cut.
    st = training(jobs, NAME, st["lastCut"]["step"] + 1, attempt=2)
    fresh = check_trainer_pods(cluster, jobs, e2e_storage, st, attempt=2)
    assert node not in {p["spec"]["nodeName"] for p in fresh} | {st["controllerNode"]}
    st = succeeded(jobs, NAME)
    assert (st["attempt"], st["preemptions"], st["restarts"]) == (2, 1, 0), json.dumps(st, indent=1)
    reasons = jobs.said(NAME, {"PreemptionNotice", "BarrierCommitted", "Resumed"})
    assert not reasons & {"BarrierMissed", "BarrierFailed", "ControllerCrashed", "TrainerLost"}, reasons
    log = cluster.pod_log(jobs.ns, st["controllerPod"], "controller")
    assert f"attempt 2 resumes from cut {cut}" in log, log[-3000:]
    assert_same_stream(reference, e2e_storage, NAME)
    no_trainer_left(cluster, jobs, {p["status"]["podIP"] for p in (*pods, *fresh)})
