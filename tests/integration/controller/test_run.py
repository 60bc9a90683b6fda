"""`spotrl run` as a user runs it: it learns, serves metrics, and takes a barrier over HTTP."""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from pathlib import Path

import pytest
from controller_runs import Runs, audit, newest_cut, stop, wait_for

from spotrl_e2e.procs import process_state

pytestmark = pytest.mark.slow


def test_a_short_run_learns(baseline: list[tuple[int, list[int]]], runs: Runs) -> None:
    rewards = [d["reward"] for d in audit(runs.base / "baseline")]
    assert len(rewards) == 16
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last >= first + 0.1, (first, last, rewards)


def test_metrics_and_a_barrier_over_http(runs: Runs, tmp_path: Path) -> None:
    storage = tmp_path / "cuts"
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = runs.start(
        runs.job({"training.totalSteps": 40}),
        storage,
        "--http-port",
        "0",
        SPOTRL_FAILPOINTS="train.step@3=0.1",
        SPOTRL_FAILPOINT_DIR=str(marks),
    )
    wait_for(lambda: (marks / "train.step").exists(), 300, "step 3", proc)
    address = re.search(r"controller endpoint: (http://\S+)", runs.log_of(proc))
    assert address is not None, runs.log_of(proc)
    base = address.group(1)

    metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    step = float(re.search(r'^spotrl_step\{job="tiny"\} (\S+)$', metrics, re.M).group(1))  # type: ignore[union-attr]
    assert step >= 3
    assert re.search(r'^spotrl_groups\{job="tiny",owner="ledger_admitted"\} ', metrics, re.M)
    assert 'spotrl_restore_groups_discarded_total{job="tiny"} 0.0' in metrics

    status = json.loads(urllib.request.urlopen(f"{base}/status", timeout=10).read())
    assert [w["alive"] for w in status["generation_workers"]] == [True] * len(status["generation_workers"]) != []

    req = urllib.request.Request(
        f"{base}/barrier", data=json.dumps({"reason": "test", "deadlineSeconds": 30}).encode(), method="POST"
    )
    cut = json.loads(urllib.request.urlopen(req, timeout=60).read())
    assert cut["kind"] == "barrier"
    cut_id, kind, cut_step = newest_cut(storage)
    assert (cut_id, kind, cut_step) == (cut["cut_id"], "barrier", cut["step"])

    # Parked: nothing more is trained, and SIGTERM needs no second cut.
    status = json.loads(urllib.request.urlopen(f"{base}/status", timeout=10).read())
    assert status["parked"] is True
    assert status["step"] == cut_step
    # A barrier is the controller's last word: its generation workers are paused at once (their
    # CPUs go to the cut, and nothing is torn down beside it), and killed when the run stops.
    workers = status["generation_workers"]
    assert [w["paused"] for w in workers] == [True] * len(workers)
    assert [process_state(w["pid"]) for w in workers] == ["T"] * len(workers), "stopped (SIGSTOP)"
    assert stop(proc, signal.SIGTERM) == 143
    gone = lambda: all(process_state(w["pid"]) in (None, "Z") for w in workers)  # noqa: E731
    wait_for(gone, 30, "the paused workers killed with the run")
    assert newest_cut(storage)[0] == cut_id
    assert max(d["step"] for d in audit(storage)) == cut_step - 1
