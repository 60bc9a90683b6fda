"""Rewards scored in their own process (rewards/runner.py): math-verify on the answers models
write, a pathological answer that would hang a step cut off at the timeout, a reward that
raises or returns no number recorded as a failure with its message, batched rewards, and no
process left behind."""

from __future__ import annotations

import os
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spotrl_runtime.api.rljob import Reward
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.rewards import RewardError
from spotrl_runtime.rewards.runner import RewardFailure, RewardRunner

pytestmark = pytest.mark.slow  # each runner starts a process


def _prompt(answer: str) -> Prompt:
    return Prompt(idx=0, task_name="math", text="...", answer=answer)


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An importable module of rewards that misbehave, on the path of this process and its children."""
    (tmp_path / "odd_rewards.py").write_text(
        textwrap.dedent(
            """
            import time

            def raises(prompt, completion):
                if completion == "boom":
                    raise ZeroDivisionError("the reward divided by zero")
                return 1.0

            def not_a_number(prompt, completion):
                return float("nan") if completion == "nan" else 0.5

            def sleeps(prompt, completion):
                time.sleep(float(completion))
                return 1.0

            def by_length(prompts, completions):
                return [float(len(c)) for c in completions]

            def short_list(prompts, completions):
                return [1.0]
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    return "odd_rewards"


@pytest.fixture
def runners() -> Iterator[list[RewardRunner]]:
    made: list[RewardRunner] = []
    yield made
    for r in made:
        r.close()


def test_math_verify_reads_boxed_latex_and_plain_answers(runners: list[RewardRunner]) -> None:
    runner = RewardRunner(Reward(name="math_verify"), timeout=20)
    runners.append(runner)
    assert runner.score(_prompt("1/2"), [r"so \boxed{0.5}", r"\boxed{\frac{1}{2}}", "0.5", r"\boxed{1}", ""]) == [
        1.0,
        1.0,
        1.0,
        0.0,
        0.0,
    ]
    assert runner.score(_prompt(r"\frac{3}{4}"), ["The answer is $0.75$.", "3/5"]) == [1.0, 0.0]
    assert runner.score(_prompt("1,000"), [r"\boxed{1000}"]) == [1.0]


def test_a_pathological_answer_times_out_and_the_next_call_is_scored(runners: list[RewardRunner]) -> None:
    runner = RewardRunner(Reward(name="math_verify"), timeout=2)
    runners.append(runner)
    first = runner._proc
    t0 = time.monotonic()
    scores = runner.score(_prompt("1"), [r"\boxed{9^{9^{9^{9^{9}}}}}", r"\boxed{1}"])
    assert time.monotonic() - t0 < 60
    assert scores == [RewardFailure("reward 'math_verify' timed out after 2 s")]
    assert runner.score(_prompt("1"), [r"\boxed{1}"]) == [1.0], "a fresh process scores the next group"
    assert not first.is_alive(), "the process that hung was killed"


def test_a_reward_that_raises_or_returns_no_number_fails_with_its_message(
    module: str, runners: list[RewardRunner]
) -> None:
    raises = RewardRunner(Reward(import_path=f"{module}:raises"), timeout=20)
    nan = RewardRunner(Reward(import_path=f"{module}:not_a_number"), timeout=20)
    runners += [raises, nan]
    assert raises.score(_prompt("1"), ["ok", "boom", "ok"]) == [
        1.0,
        RewardFailure(f"reward '{module}:raises' raised ZeroDivisionError: the reward divided by zero"),
    ], "scoring stops at the first failure: the group is dropped"
    assert raises.score(_prompt("1"), ["ok", "ok"]) == [1.0, 1.0], "and goes on with the next group"
    failure = RewardFailure(f"reward '{module}:raises' raised ZeroDivisionError: the reward divided by zero")
    assert raises.score(_prompt("1"), ["boom", "ok", "boom"], stop_at_failure=False) == [failure, 1.0, failure], (
        "with onError score every completion gets its own score or failure"
    )
    assert nan.score(_prompt("1"), ["x"]) == [0.5]
    (out,) = nan.score(_prompt("1"), ["nan", "x"])
    assert isinstance(out, RewardFailure)
    assert "must return a finite float" in out.message


def test_each_call_has_its_own_timeout(module: str, runners: list[RewardRunner]) -> None:
    runner = RewardRunner(Reward(import_path=f"{module}:sleeps"), timeout=1.5)
    runners.append(runner)
    assert runner.score(_prompt("1"), ["0.8", "0.8"]) == [1.0, 1.0], "two calls of 0.8 s, each under 1.5 s"
    assert runner.score(_prompt("1"), ["5", "0"]) == [RewardFailure(f"reward '{module}:sleeps' timed out after 1.5 s")]
    assert runner.score(_prompt("1"), ["0"]) == [1.0], "a fresh process scores the next group"


def test_a_batched_reward_scores_a_group_in_one_call(module: str, runners: list[RewardRunner]) -> None:
    runner = RewardRunner(Reward(import_path=f"{module}:by_length", batched=True), timeout=20, batched=True)
    short = RewardRunner(Reward(import_path=f"{module}:short_list", batched=True), timeout=20, batched=True)
    runners += [runner, short]
    assert runner.score(_prompt("1"), ["a", "abc", ""]) == [1.0, 3.0, 0.0]
    (out,) = short.score(_prompt("1"), ["a", "b"])
    assert isinstance(out, RewardFailure)
    assert "a list of 2 floats" in out.message


def test_a_reward_that_cannot_load_fails_the_start_not_the_first_step(module: str) -> None:
    with pytest.raises(RewardError, match="has no attribute 'missing'"):
        RewardRunner(Reward(import_path=f"{module}:missing"), timeout=5)
    with pytest.raises(RewardError, match="batched"):
        RewardRunner(Reward(name="gsm8k"), timeout=5, batched=True)


def test_close_leaves_no_process(module: str) -> None:
    runner = RewardRunner(Reward(import_path=f"{module}:raises"), timeout=5)
    assert runner.score(_prompt("1"), ["ok"]) == [1.0]
    proc = runner._proc
    runner.close()
    assert not proc.is_alive()
    assert runner._proc is None


def test_the_reward_process_is_not_in_the_controllers_process_group(module: str, runners: list[RewardRunner]) -> None:
    """A Ctrl-C or SIGTERM to the controller's group is the controller's (it takes a barrier cut)."""
    runner = RewardRunner(Reward(import_path=f"{module}:raises"), timeout=5)
    runners.append(runner)
    runner.score(_prompt("1"), ["ok"])
    assert os.getpgid(runner._proc.pid) != os.getpgid(0)
