"""Generation workers on Ray nodes of their own (what `spec.generation.workerPods` runs in
pods): the controller starts a Ray head on its address and waits; `spotrl worker` processes
join it, each on a loopback address of its own as pods on one host do. One worker node is
killed mid-run: its groups are redispatched to the other, a new worker node joins, and the
run finishes without a restore, on exactly the prompts of the run never disturbed."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from controller_runs import Runs, audit, stream, wait_for

from spotrl_e2e.procs import ray_processes_on

pytestmark = pytest.mark.slow
HEAD_IP = "127.0.77.1"


class WorkerNode:
    """`spotrl worker --address ...` bound to its own loopback address."""

    def __init__(self, runs: Runs, address: str, ip: str, **env: str):
        self.ip = ip
        self.log = runs.base / f"worker-{ip}.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "spotrl_runtime.cli",
                    "worker",
                    "--address",
                    address,
                    "--node-ip",
                    ip,
                    "--num-cpus",
                    "1",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**runs.env(), **env},
                start_new_session=True,  # as a pod: a process group of its own
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> int:
        """SIGTERM, as a pod being deleted gets it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)

    def lose(self) -> int:
        """SIGKILL to its whole process group, as a lost node's agent does to a pod."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        return self.proc.wait(timeout=60)


def test_worker_nodes_join_late_and_a_lost_one_costs_no_restore(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path
) -> None:
    storage = tmp_path / "cuts"
    marks = tmp_path / "marks"
    marks.mkdir()
    summary = tmp_path / "summary.json"
    job = runs.job({"generation.workers": 2, "generation.workerPods": True})
    proc = runs.start(
        job,
        storage,
        "--worker-nodes",
        "--host",
        HEAD_IP,
        "--summary-json",
        str(summary),
        # The dispatch of step 10 holds until the replacement has joined, so that a fast
        # machine cannot finish the run before it.
        SPOTRL_FAILPOINTS="dispatch.finish@10+=300",
        SPOTRL_FAILPOINT_DIR=str(marks),
    )
    workers: list[WorkerNode] = []
    try:
        wait_for(lambda: "spotrl worker --address" in runs.log_of(proc), 180, "the head's address", proc)
        (address,) = re.findall(r"spotrl worker --address (\S+)", runs.log_of(proc))
        assert address.startswith(f"{HEAD_IP}:"), address
        # Nothing trains before a worker joins: the pool waits for them.
        assert audit(storage, "--all") == []
        # The first worker node holds a batch it was given once it has the weights of step 5
        # or later: when it is lost, it certainly holds groups.
        held = tmp_path / "held"
        held.mkdir()
        # It joins first: the pool starts training with the first worker that answers, and
        # ten steps take a second or two, so a second worker could otherwise do them all.
        workers = [
            WorkerNode(
                runs,
                address,
                "127.0.77.2",
                SPOTRL_FAILPOINTS="worker.generate@5+=300",
                SPOTRL_FAILPOINT_DIR=str(held),
            )
        ]
        wait_for(lambda: "is up on node 127.0.77.2" in runs.log_of(proc), 120, "the first worker node up", proc)
        workers.append(WorkerNode(runs, address, "127.0.77.3"))
        wait_for(lambda: (held / "worker.generate").exists(), 300, "a batch on weights of step 5", proc)
        # Training starts once the first worker answers; the second may still be importing
        # torch (the pool does not wait for it), so each is awaited rather than assumed.
        for worker_id in ("gen-0", "gen-1"):
            wait_for(
                lambda w=worker_id: f"generation worker {w} is up on node 127.0.77." in runs.log_of(proc),
                120,
                f"{worker_id} to be up on a worker node",
                proc,
            )
        log = runs.log_of(proc)
        assert f"is up on node {HEAD_IP}" not in log, "a worker actor ran on the controller's node"

        # The worker node goes away abruptly (SIGKILL, as a lost pod): its Ray processes follow.
        lost = workers[0]
        assert ray_processes_on(lost.ip), "the worker node runs Ray processes"
        assert lost.lose() == -signal.SIGKILL
        wait_for(lambda: ray_processes_on(lost.ip) == [], 30, f"the Ray processes of {lost.ip} to die")
        replacement = WorkerNode(runs, address, "127.0.77.4")  # the replacement "pod" joins mid-run
        workers.append(replacement)
        wait_for(lambda: "Ray runtime started" in replacement.output(), 120, "the replacement to join", proc)
        (marks / "dispatch.finish.release").touch()

        rc = proc.wait(timeout=420)
        log = runs.log_of(proc)
        assert rc == 0, log[-4000:]
        s = json.loads(summary.read_text())
        assert s["resumed_from"] is None, "a lost worker costs no restore"
        assert s["stats"]["groups_lost_redispatched"] >= 1, s["stats"]
        assert {d["attempt"] for d in audit(storage, "--all")} == {0}
        assert stream(storage) == baseline
        assert re.search(r"generation worker gen-\d lost", log), log[-3000:]
        # Each worker that joined after the first sync (the second node, the replacement) was
        # given the trainer's current weights before its first group.
        joined = re.findall(r"generation worker\(s\) (gen-\d) get weight version (\d+) before their first group", log)
        assert len({w for w, _ in joined}) >= 1, log[-3000:]

        # SIGTERM stops a worker node cleanly: exit 143 and no Ray process of it left.
        survivor = workers[1]
        assert survivor.stop() == 143, survivor.output()[-3000:]
        wait_for(lambda: ray_processes_on(survivor.ip) == [], 15, f"the Ray processes of {survivor.ip} to stop")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for w in workers:
            if w.proc.poll() is None:
                w.stop()
        for w in workers:
            # Whatever state it ended in, no Ray process of a worker node survives it.
            wait_for(lambda w=w: ray_processes_on(w.ip) == [], 30, f"nothing left of {w.ip}")
        wait_for(lambda: ray_processes_on(HEAD_IP) == [], 30, f"nothing left of the head {HEAD_IP}")


def test_sigterm_while_waiting_for_worker_nodes_stops_at_once_without_a_cut(runs: Runs, tmp_path: Path) -> None:
    """Nothing happened since the start, so there is nothing to cut: the wait ends and the run
    exits 143 within moments, not at the end of its wait for workers."""
    storage = tmp_path / "cuts"
    job = runs.job({"generation.workers": 2, "generation.workerPods": True})
    proc = runs.start(job, storage, "--worker-nodes", "--host", "127.0.77.9")
    try:
        wait_for(lambda: "spotrl worker --address" in runs.log_of(proc), 180, "the head's address", proc)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=20)
        log = runs.log_of(proc)
        assert rc == 143, log[-3000:]
        assert "barrier" not in log, log[-3000:]
        assert not (storage / "cuts").exists() or not any((storage / "cuts").iterdir())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    wait_for(lambda: ray_processes_on("127.0.77.9") == [], 30, "nothing left of the head")
