"""`spotrl run` as a user runs it: it learns, serves metrics, and takes a barrier over HTTP."""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from pathlib import Path

import pytest
from controller_runs import TINY_JOB, Runs, audit, newest_cut, stop, wait_for

from spotrl_e2e.procs import process_state

pytestmark = pytest.mark.slow


def test_a_short_run_learns(baseline: list[tuple[int, list[int]]], runs: Runs) -> None:
    rewards = [d["reward"] for d in audit(runs.base / "baseline")]
    assert len(rewards) == 16
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last >= first + 0.1, (first, last, rewards)
    # Each step's record keeps what RL users read every step (core/step_stats.py, the trainer's).
    docs = [json.loads(p.read_text()) for p in sorted((runs.base / "baseline" / "audit").glob("step-*/*.json"))]
    assert len(docs) == 16
    for d in docs:
        assert d["accuracy"] == pytest.approx(d["reward"], abs=1e-5), "0 or 1 rewards: accuracy is the mean"
        assert 0 < d["response_length_mean"] <= d["response_length_max"] <= 8  # maxNewTokens
        assert 0 <= d["response_clip_ratio"] <= 1
        assert d["grad_norm"] >= 0
        assert 0 < d["entropy"] < 4.0  # nats; below log(vocab) of the tiny policy's ~20 characters
        assert d["learning_rate"] == pytest.approx(0.0003)
        assert d["train_tokens_per_second"] > 0
        # Tokens of groups that finished since the step before: none, when every group of this
        # step had finished before the step before ended (lookahead); the run's sum is not 0.
        assert d["generation_tokens_per_second"] >= 0
        # The off-policy correction and the batching (training/losses.py, training/rows.py).
        assert 0 < d["is_weight_mean"] <= d["is_weight_max"] <= 2.0
        assert 0 <= d["is_capped_fraction"] < 1
        assert 0 <= d["padding_share"] < 1
        assert 0 <= d["frac_reward_zero_std"] <= 1
        assert d["reward_errors"] == 0
        # One worker: the mean over the workers is the idlest one's (core/step_stats.py).
        assert 0 <= d["generation_idle_share"] == d["generation_idle_share_max"] <= 1
    assert sum(d["generation_tokens_per_second"] for d in docs) > 0
    # The worker waits for the trainer some of each step (lookahead 1), and generates some.
    assert 0 < sum(d["generation_idle_share"] for d in docs) < len(docs), [d["generation_idle_share"] for d in docs]
    # lookahead 1: most rows were generated one version behind, and their gap is reported apart.
    assert [d for d in docs if "rollout_probs_diff_stale_mean" in d], "stale rows measured"
    # The tiny policy rambles past its answers at first (clipped at 8 tokens) and learns to stop.
    lengths = [d["response_length_mean"] for d in docs]
    assert sum(lengths[-4:]) < sum(lengths[:4]), lengths


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
    for name in ("accuracy", "response_length_mean", "response_clip_ratio", "grad_norm", "clip_fraction", "kl"):
        assert re.search(rf'^spotrl_{name}\{{job="tiny"\}} \S+$', metrics, re.M), name
    for name in ("generation_idle_share", "generation_idle_share_max"):
        share = re.search(rf'^spotrl_{name}\{{job="tiny"\}} (\S+)$', metrics, re.M)
        assert share is not None, name
        assert 0 <= float(share.group(1)) <= 1, name

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


def test_a_reward_that_raises_scores_the_completion_error_score_and_trains_the_rest(runs: Runs, tmp_path: Path) -> None:
    """reward.onError score (the default): a completion the reward raised on is scored
    errorScore, the rest of its group trains, nothing is dropped, and each step counts them."""
    code = tmp_path / "rewards"
    code.mkdir()
    (code / "picky_reward.py").write_text(
        "def score(prompt, completion):\n"
        "    if prompt.idx % 4 == 1 and completion.strip() != prompt.answer.strip():\n"
        "        raise ValueError(f'cannot score row {prompt.idx}')\n"
        "    return 1.0 if completion.strip() == prompt.answer.strip() else 0.0\n"
    )
    job = runs.job({"reward": {"importPath": "picky_reward:score", "errorScore": -1.0}, "training.totalSteps": 2})
    storage = tmp_path / "cuts"
    proc = runs.start(job, storage, PYTHONPATH=str(code))
    assert proc.wait(timeout=420) == 0, runs.log_of(proc)
    records = [json.loads(p.read_text()) for p in sorted((storage / "audit").glob("step-*/attempt-*.json"))]
    assert [r["step"] for r in records] == [0, 1]
    assert [d for r in records for d in r["dropped"]] == []
    assert sum(r["reward_errors"] for r in records) > 0
    trained = [i for r in records for i in r["idxs"]]
    assert [i for i in trained if i % 4 == 1], "the groups the reward failed on were trained"
    for r in records:  # every rollout scored 1, 0 or errorScore (-1): each step's mean says which
        rollouts = len(r["idxs"]) * TINY_JOB["spec"]["generation"]["groupSize"]
        assert r["reward"] == pytest.approx(r["accuracy"] - r["reward_errors"] / rollouts, abs=1e-5), r
    assert "the reward failed on" in runs.log_of(proc)


def test_a_run_whose_rewards_never_differ_says_it_learns_nothing(runs: Runs, tmp_path: Path) -> None:
    """Every rollout scored 0 (a dataset the policy cannot solve): after 5 steps in a row without
    a group whose rewards differ, the run log says so, once, and each step's record counts them."""
    code = tmp_path / "rewards"
    code.mkdir()
    (code / "hopeless.py").write_text("def score(prompt, completion):\n    return 0.0\n")
    job = runs.job({"reward": {"importPath": "hopeless:score"}, "training.totalSteps": 6})
    storage = tmp_path / "cuts"
    rc, log = runs.run(job, storage, PYTHONPATH=str(code))
    assert rc == 0, log
    records = [json.loads(p.read_text()) for p in sorted((storage / "audit").glob("step-*/attempt-*.json"))]
    assert [d["frac_reward_zero_std"] for d in records] == [1.0] * 6
    assert [d["steps_without_signal"] for d in records] == [1, 2, 3, 4, 5, 6]
    assert [d["grad_norm"] for d in records] == [0.0] * 6, "nothing was trained"
    assert log.count("no learning signal: in each of the last 5 steps") == 1, log


def test_a_reward_that_raises_or_hangs_drops_its_groups_with_the_reason(runs: Runs, tmp_path: Path) -> None:
    """reward.onError drop: a user's reward that raises on some rows and hangs on others (as
    math-verify can on a pathological answer): each such group is dropped, its reason in the step's audit record;
    spares take their places, the run trains to its end, and the reward's process goes with it."""
    code = tmp_path / "rewards"
    code.mkdir()
    (code / "flaky_reward.py").write_text(
        "import time\n"
        "def score(prompt, completion):\n"
        "    if prompt.idx % 8 == 1:\n"
        "        raise ValueError(f'cannot score row {prompt.idx}')\n"
        "    if prompt.idx % 16 == 5:\n"
        "        time.sleep(600)\n"
        "    return 1.0 if completion.strip() == prompt.answer.strip() else 0.0\n"
    )
    job = runs.job(
        {
            "reward": {"importPath": "flaky_reward:score", "timeoutSeconds": 1, "onError": "drop", "workers": 2},
            "training.totalSteps": 2,
            "preemption.onDroppedPrompt": "replace",
            "preemption.sparePoolBatches": 2,
        }
    )
    storage = tmp_path / "cuts"
    proc = runs.start(job, storage, PYTHONPATH=str(code))
    assert proc.wait(timeout=420) == 0, runs.log_of(proc)
    runs.assert_nothing_left(proc)

    records = [json.loads(p.read_text()) for p in sorted((storage / "audit").glob("step-*/attempt-*.json"))]
    assert [r["step"] for r in records] == [0, 1]
    dropped = [d for r in records for d in r["dropped"]]
    raised = {d["idx"] for d in dropped if d["reason"].endswith("'flaky_reward:score' raised ValueError")}
    timed_out = {d["idx"] for d in dropped if "'flaky_reward:score' timed out after 1 s" in d["reason"]}
    assert raised
    assert timed_out
    assert raised | timed_out == {d["idx"] for d in dropped}, dropped
    assert all(i % 8 == 1 for i in raised)
    assert all(i % 16 == 5 for i in timed_out)
    assert all(d["reason"].startswith("reward failed on rollout 0: ") for d in dropped)
    trained = [i for r in records for i in r["idxs"]]
    assert len(trained) == 2 * 16, "spares took the dropped groups' places"
    assert not [i for i in trained if i % 8 == 1 or i % 16 == 5], "no group with a failed reward was trained"
    assert "dropping group" in runs.log_of(proc)
    assert "cannot score row" not in json.dumps(records), "the exception's message is in the pod's log only"
