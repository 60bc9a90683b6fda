"""Validation during training (``spec.validation``), with the real controller and Ray workers:
passes scored on the weights of every Nth step, beside a training stream they do not change,
and a barrier that neither waits for a pass in flight nor puts one in its cut."""

from __future__ import annotations

import contextlib
import io
import json
import signal
import time
from pathlib import Path

import pytest
from controller_runs import TINY_JOB, Runs, assert_same_trainer_state, newest_cut, stop, stream, wait_for

from spotrl_runtime.controller.audit_store import AuditStore
from spotrl_runtime.storage import open_storage

pytestmark = pytest.mark.slow

VALIDATION = {"dataset": "builtin:arithmetic", "everySteps": 4, "limit": 8}
VALIDATION_SPLIT = "test"
"""What ``spec.validation`` reads of builtin:arithmetic by default."""


def test_a_run_scores_its_held_out_split_every_n_steps_and_trains_the_same_stream(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    # Step 4's cut kept (keep 3 would delete it by the end): the weights its pass scored.
    rc, log = runs.run(runs.job({"validation": VALIDATION, "checkpoint.keep": 5}), store)
    assert rc == 0, log
    assert stream(store) == baseline, "validation groups changed what was trained"
    assert_same_trainer_state(store, runs.base / "baseline")
    passes = [r for r in AuditStore(open_storage(str(store))).documents() if "val_step" in r]
    steps = [int(r["val_step"]) for r in passes]
    assert steps == sorted(set(steps)), "a version was scored twice"
    assert set(steps) <= {0, 4, 8, 12}, "only the weights of every 4th step are scored"
    assert {0, 4} <= set(steps), log
    for r in passes:
        assert r["val_prompts"] == 8
        assert r["val_reward_failed"] == 0
    assert "validation of step 0: accuracy" in log
    # The pass of step 4 (always scored) scored step 4's weights: `spotrl eval` of step 4's cut
    # (greedy, the same rows, prompt format and reward) gives its very score, which the initial
    # weights' pass does not have (0.375 against 0.75 when measured): a pass on stale weights fails.
    by_step = {int(r["val_step"]): (r["val_accuracy"], r["val_reward"]) for r in passes}
    (cut,) = [m.parent for m in store.glob("cuts/*/manifest.json") if json.loads(m.read_text())["trainer_step"] == 4]
    model = tmp_path / "step-4"
    rc, out = _spotrl("ckpt", "export", str(cut), "--base", TINY_JOB["spec"]["policy"]["model"], "--out", str(model))
    assert rc == 0, out
    assert by_step[4] == _score(runs.job({"dataset.split": VALIDATION_SPLIT}), str(model)), by_step
    assert by_step[4] != by_step[0], f"step 4's weights score as the initial ones: no pass can be told apart {by_step}"


def _spotrl(*args: str) -> tuple[int, str]:
    """The CLI in this process (no interpreter to start, no torch to import again): (rc, stdout)."""
    from spotrl_runtime.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(list(args))
    return rc, out.getvalue()


def _score(job: Path, model: str) -> tuple[float, float]:
    """(accuracy, mean reward) of ``model`` on the first 8 held-out rows, greedy, rounded as a pass's."""
    rc, out = _spotrl("eval", "-f", str(job), "--model", model, "--limit", str(VALIDATION["limit"]), "--json")
    assert rc in (0, 1), out
    result = json.loads(out)
    return round(float(result["accuracy"]), 6), round(float(result["reward_mean"]), 6)


def test_a_barrier_during_a_validation_pass_commits_and_its_cut_holds_no_validation_group(
    runs: Runs, baseline: list[tuple[int, list[int]]], tmp_path: Path
) -> None:
    """The worker holds the first groups it starts on weights 4 (step 5's, and step 4's pass)
    for a minute; a SIGTERM's barrier commits at once all the same."""
    job = runs.job({"validation": VALIDATION})
    store, marks = tmp_path / "store", tmp_path / "marks"
    marks.mkdir()
    proc = runs.start(job, store, SPOTRL_FAILPOINTS="worker.generate@4+=60", SPOTRL_FAILPOINT_DIR=str(marks))
    wait_for(lambda: (marks / "worker.generate").exists(), 300, "the worker holding weights 4's groups", proc)
    started = time.monotonic()
    assert stop(proc, signal.SIGTERM) == 143, runs.log_of(proc)
    assert time.monotonic() - started < 30, "the barrier waited for the held validation pass"
    cut_id, kind, _ = newest_cut(store)
    assert kind == "barrier"
    storage = open_storage(str(store))
    (ledger,) = [o.key for o in storage.list(f"cuts/{cut_id}/") if o.key.endswith("ledger.json")]
    ids = [r["group_id"] for r in json.loads(storage.get_bytes(ledger))["records"]]
    assert ids, "the cut holds the training groups in flight"
    assert not [g for g in ids if g.startswith("val-")], "a validation group is in the cut"
    rc, log = runs.run(job, store)
    assert rc == 0, log
    assert f"resumed from cut {cut_id}" in log, log
    assert stream(store) == baseline
    assert_same_trainer_state(store, runs.base / "baseline")
