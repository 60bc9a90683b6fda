"""The agent example (`examples/cpu-agent-calculator.yaml`) as a newcomer runs it: a policy that
may call a calculator before it answers, each sample an episode of turns on the real trainer,
Ray and transformers workers. Its held-out accuracy rises (sampled, `spotrl eval` before and
after: it learns to call the tool); the episodes it trained on hold their tools' answers as
observation spans, never trained; a SIGTERM and a resume train the same prompts as the
uninterrupted run; a SIGTERM while episodes are between turns keeps their finished turns in the
barrier cut, and the resume goes on from them (the calculator replays) instead of generating them
again."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from controller_runs import ROOT, Runs, accuracy_before_and_after, run_example, spotrl, stop, stream, wait_for

from spotrl_e2e.forgery import CutSurgery
from spotrl_runtime.core.cut_format import decode_rollouts

pytestmark = pytest.mark.slow

TEST_SPLIT = ROOT / "examples" / "data" / "calculator-problems" / "test.parquet"
HELD_OUT = 64
RISE = 0.12
"""Held-out accuracy (mean@4 over the first HELD_OUT test problems) must rise at least this much
over the example's 40 steps (measured: 0.465 before, 0.738 after)."""
RESUMED_TO = 10


def _cli(runs: Runs, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return spotrl(*args, timeout=timeout, env=runs.env(), cwd=runs.base)


@pytest.fixture(scope="module")
def example(runs: Runs) -> tuple[Path, Path, int]:
    """(job file, store, steps) of the example run once to its end, never stopped."""
    from spotrl_runtime.models.tiny_agent import tiny_agent_dir

    tiny_agent_dir()  # built once into the shared cache (the runs find it prebuilt)
    return run_example(runs, "cpu-agent-calculator.yaml", "agent-example")


def test_held_out_accuracy_rises_as_it_learns_to_call_the_tool(example: tuple[Path, Path, int], runs: Runs) -> None:
    before, after = accuracy_before_and_after(runs, example, "builtin:tiny-agent", TEST_SPLIT, HELD_OUT, HELD_OUT)
    assert after >= before + RISE, (before, after)


def test_spotrl_episodes_prints_a_steps_turns(example: tuple[Path, Path, int], runs: Runs) -> None:
    """A trained step's episodes, as a person debugging the environment reads them: the policy's
    calls, the calculator's answers in the template's markers, the final answer."""
    _, store, _ = example
    out = _cli(runs, "episodes", str(store), "--step", "3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("step 3 (attempt 0): 8 episodes")
    assert "-- environment\n\n<|im_start|>user\n<tool_response>\n" in out.stdout
    doc = json.loads(_cli(runs, "episodes", str(store), "--step", "3", "--json").stdout)
    called = [e for e in doc["episodes"] if len(e["turns"]) > 1]
    assert called, "some of the step's first episodes called the tool"
    for episode in called:
        roles = [t["role"] for t in episode["turns"]]
        assert roles == [("policy", "environment")[k % 2] for k in range(len(roles))], "they alternate"
        assert "<tool_call>" in episode["turns"][0]["text"]
    missing = _cli(runs, "episodes", str(store), "--step", "4000")
    assert missing.returncode == 1
    assert "holds no episodes of step 4000" in missing.stderr


@pytest.fixture(scope="module")
def interrupted(example: tuple[Path, Path, int], runs: Runs, tmp_path_factory: pytest.TempPathFactory) -> CutSurgery:
    """The barrier cut of the example stopped by SIGTERM while step 5 trains (its episodes run
    ahead meanwhile), after the run resumed from it to step RESUMED_TO."""
    marks = tmp_path_factory.mktemp("agent-marks")
    barrier, _ = _stopped_then_resumed(runs, example[0], runs.base / "agent-interrupted", marks, "train.step@5=4")
    return barrier


def _stopped_then_resumed(runs: Runs, job: Path, store: Path, marks: Path, point: str) -> tuple[CutSurgery, str]:
    """Runs ``job`` until failpoint ``point`` holds it, SIGTERMs it (3 s later: what was reported
    reaches the ledger meanwhile), then resumes it to RESUMED_TO: (its barrier cut, the resumed
    run's log)."""
    proc = runs.start(job, store, SPOTRL_FAILPOINTS=point, SPOTRL_FAILPOINT_DIR=str(marks))
    name = point.partition("@")[0]
    wait_for(lambda: (marks / name).exists(), 300, f"failpoint {name}", proc)
    time.sleep(3)
    assert stop(proc) == 143, runs.log_of(proc)
    cuts = sorted(p for p in (store / "cuts").iterdir() if (p / "manifest.json").exists())
    barrier = CutSurgery(cuts[-1])
    assert barrier.m["kind"] == "barrier", runs.log_of(proc)
    rc, log = runs.run(job, store, "--max-steps", str(RESUMED_TO))
    assert rc == 0, log
    assert f"resumed from cut {cuts[-1].name}" in log
    return barrier, log


def test_sigterm_and_resume_train_the_same_prompts(
    example: tuple[Path, Path, int], interrupted: CutSurgery, runs: Runs
) -> None:
    _, reference, _ = example
    assert stream(runs.base / "agent-interrupted") == stream(reference)[:RESUMED_TO]


def test_the_cut_holds_episodes_with_their_observations(interrupted: CutSurgery) -> None:
    """The barrier cut's finished episodes: some called the calculator, and each tool answer is
    a span of log-prob 0 holding the template's <tool_response>; the rest are the policy's."""
    from transformers import AutoTokenizer

    from spotrl_runtime.models.tiny_agent import tiny_agent_dir

    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_dir())
    rollouts = [r for group in decode_rollouts(interrupted.path("rollouts").read_bytes()).values() for r in group]
    episodes = [r for r in rollouts if r.observed]
    assert rollouts
    assert len(episodes) >= len(rollouts) // 4, "tiny-agent calls the tool in about half its answers"
    for r in episodes:
        assert "<tool_call>" in tokenizer.decode(list(r.completion_token_ids[: r.observed[0][0]]))
        for start, end in r.observed:
            assert "<tool_response>" in tokenizer.decode(list(r.completion_token_ids[start:end]))
            assert set(r.logprobs[start:end]) == {0.0}
        generated = [lp for k, lp in enumerate(r.logprobs) if not any(a <= k < b for a, b in r.observed)]
        assert all(lp <= 0 for lp in generated)
        assert sum(generated) < 0, "the generated tokens carry their log-probs"


@pytest.fixture(scope="module")
def mid_episode(
    example: tuple[Path, Path, int], runs: Runs, tmp_path_factory: pytest.TempPathFactory
) -> tuple[CutSurgery, str, Path]:
    """(barrier cut, resumed run's log, store) of the example stopped by SIGTERM while its worker
    is held with episodes between turns (after it reported 12 finished turns of training groups:
    a validation pass's turns are not kept), resumed to RESUMED_TO."""
    store = runs.base / "agent-mid-episode"
    marks = tmp_path_factory.mktemp("agent-turn-marks")
    # The worker's collect goes on while its thread is held: the turns it reported reach the ledger.
    barrier, log = _stopped_then_resumed(runs, example[0], store, marks, "worker.turns_reported@12+=120")
    return barrier, log, store


def test_a_barrier_between_turns_keeps_the_finished_turns_and_the_resume_goes_on_from_them(
    example: tuple[Path, Path, int], mid_episode: tuple[CutSurgery, str, Path], runs: Runs
) -> None:
    barrier, log, store = mid_episode
    doc = json.loads(barrier.path("episodes").read_bytes())
    ledger = {r["group_id"] for r in json.loads(barrier.path("ledger").read_bytes())["records"]}
    kept = doc["episodes"]
    assert kept, "the held worker's episodes had finished turns"
    assert {e["group_id"] for e in kept} <= ledger, "each belongs to a group in flight"
    assert all(len(e["actions"]) >= 1 and e["actions"][0]["calls"][0][0] == "calculator" for e in kept)
    turns = sum(len(e["actions"]) for e in kept)
    inspected = json.loads(_cli(runs, "ckpt", "inspect", str(barrier.cut), "--json").stdout)
    assert sum(e["turns"] for e in inspected["episodes"]) == turns

    resumed = [line for line in log.splitlines() if "finished turn(s) resumed" in line]
    assert sum(int(line.split(": ")[-1].split()[0]) for line in resumed) == turns, "every kept turn went on"
    assert all(" 0 episode(s) restarted" in line for line in resumed), "the calculator replays"
    summary = _cli(runs, "audit", str(store), "--summary")
    assert f"turnsRestored             {turns}" in summary.stdout, summary.stdout
    _, reference, _ = example
    assert stream(store) == stream(reference)[:RESUMED_TO], "the same prompts as the uninterrupted run"
