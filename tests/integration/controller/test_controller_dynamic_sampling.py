"""Dynamic sampling, run by the real controller (`spotrl run`, real torch, real Ray, cuts on disk).

The tiny arithmetic job with ``training.sampling.dynamic``: groups whose rollouts all scored the
same reward are filtered, with their reason, and refill rounds take their places. SIGKILLed
while a refill round is being sent, resumed, then SIGTERMed in another refill round (the
barrier cuts the round's groups in flight) and resumed again, the run trains the uninterrupted
run's stream to the same weights, and counts every filtered prompt once. The job takes the KL
penalty from its rewards (``training.kl.inReward``), so each step scores its rollouts first."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from controller_runs import Runs, assert_same_trainer_state, audit, audit_summary, newest_cut, stop, stream, wait_for

pytestmark = pytest.mark.slow

JOB = {
    "training.totalSteps": 8,
    "training.sampling": {"dynamic": {"maxRounds": 2}},
    "training.klCoef": 0.05,
    "training.kl": {"inReward": True},  # a scoring pass before each step, redone as exactly on resume
    "checkpoint.everySteps": 2,
}


def test_a_kill_and_a_stop_in_refill_rounds_end_with_the_uninterrupted_stream_and_weights(
    runs: Runs, tmp_path: Path
) -> None:
    job = runs.job(JOB)
    reference = runs.base / "dynamic-baseline"
    rc, log = runs.run(job, reference)
    assert rc == 0, log
    docs = audit(reference)
    filtered = [f for d in docs for f in d.get("filtered", [])]
    assert filtered, "the tiny policy leaves groups without signal: some were filtered"
    for f in filtered:
        assert f["reason"].startswith("zero-std: its 8 rewards were all "), f
    assert all(len(d["prompts"]) == 16 for d in docs), "every step trains promptsPerStep groups"
    assert docs[0]["reward_kl_penalty_mean"] == 0.0, "the policy starts as its reference"
    assert all(d["reward_kl_penalty_mean"] != 0.0 for d in docs[1:]), docs
    refilled = [d["step"] for d in docs if d["refill_rounds"]]
    assert refilled == [d["step"] for d in docs if d.get("filtered")], docs
    for step in refilled:
        assert f"dynamic sampling: step {step}'s refill round 1 generates" in log, log

    store = runs.base / "dynamic"
    # The tiny policy is seeded: the steps that refill are the same in every run of the job.
    assert len(refilled) >= 2, refilled
    assert refilled[0] >= 1, refilled
    for sig, step in ((signal.SIGKILL, refilled[0]), (signal.SIGTERM, refilled[1])):
        marks = tmp_path / f"marks-{step}"
        marks.mkdir()
        proc = runs.start(job, store, SPOTRL_FAILPOINTS=f"dispatch.refill@{step}=30", SPOTRL_FAILPOINT_DIR=str(marks))
        wait_for(lambda m=marks: (m / "dispatch.refill").exists(), 300, f"step {step}'s refill", proc)  # type: ignore[misc]
        assert stop(proc, sig) == (-9 if sig == signal.SIGKILL else 143), runs.log_of(proc)
    assert newest_cut(store)[1:] == ("barrier", refilled[1])

    rc, log = runs.run(job, store)
    assert rc == 0, log
    assert stream(store) == stream(reference)
    assert_same_trainer_state(store, reference)
    summary, whole = audit_summary(store), audit_summary(reference)
    assert summary["prompts_filtered"] == whole["prompts_filtered"] == len(filtered), summary
    assert (summary["prompts_lost"], summary["prompts_trained_twice"], summary["steps_missing"]) == (0, 0, 0)
