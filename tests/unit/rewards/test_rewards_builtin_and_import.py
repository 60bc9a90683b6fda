"""Built-in rewards, and reward functions loaded by import path (with the errors a user sees)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from spotrl_runtime.api.rljob import Reward
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.rewards import RewardError, arithmetic_exact, format_only, import_reward, load_reward

SEVEN = Prompt(idx=3, task_name="add", text="3+4=", answer="7")


@pytest.mark.parametrize(
    ("completion", "reward"),
    [("7", 1.0), (" 7\n", 1.0), ("7 3", 0.0), ("07", 0.0), ("8", 0.0), ("", 0.0), ("7.0", 0.0)],
)
def test_arithmetic_exact(completion: str, reward: float) -> None:
    assert arithmetic_exact(SEVEN, completion) == reward


def test_arithmetic_exact_strips_the_answer_too() -> None:
    assert arithmetic_exact(Prompt(1, "sub", "9-2=", " 7 "), "7") == 1.0


@pytest.mark.parametrize(
    ("completion", "reward"), [("7", 1.0), (" 12 ", 1.0), ("-3", 1.0), ("8", 1.0), ("7 3", 0.0), ("", 0.0), ("x", 0.0)]
)
def test_format_only_rewards_the_shape_not_the_value(completion: str, reward: float) -> None:
    assert format_only(SEVEN, completion) == reward


def test_load_builtin_by_name() -> None:
    reward = load_reward(Reward(name="arithmetic_exact"))
    assert reward.name == "arithmetic_exact"
    assert reward(SEVEN, "7") == 1.0
    assert reward(SEVEN, "6") == 0.0
    assert load_reward(Reward(name="format_only"))(SEVEN, "6") == 1.0


@pytest.fixture
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A real module on sys.path with good and bad reward functions."""
    package = tmp_path / "my_rewards_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scores.py").write_text(
        textwrap.dedent(
            """
            def length_bonus(prompt, completion):
                return len(completion) / 10 + (1.0 if completion.strip() == prompt.answer else 0.0)

            def wants_three(prompt, completion, row):
                return 1.0

            def returns_text(prompt, completion):
                return "high"

            def returns_secret(prompt, completion):
                return ["AKIA-the-secret-key"]

            def returns_nan(prompt, completion):
                return float("nan")

            def returns_bool(prompt, completion):
                return True

            NOT_A_FUNCTION = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_pkg.scores"
    for name in [m for m in sys.modules if m.startswith("my_rewards_pkg")]:
        del sys.modules[name]


def test_import_path_loads_and_calls_the_function(reward_module: str) -> None:
    reward = load_reward(Reward(import_path=f"{reward_module}:length_bonus"))
    assert reward.name == f"{reward_module}:length_bonus"
    assert reward(SEVEN, "7") == pytest.approx(1.1)
    assert reward(SEVEN, "123") == pytest.approx(0.3)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("no_colon_here", "must look like 'package.module:function'"),
        ("pkg.mod:", "must look like"),
        ("pkg mod:fn", "must look like"),
        ("spotrl_no_such_module_xyz:fn", "cannot import module 'spotrl_no_such_module_xyz'.*PYTHONPATH"),
        ("{mod}:missing", "has no attribute 'missing'"),
        ("{mod}:NOT_A_FUNCTION", "is a int, not a function"),
        ("{mod}:wants_three", r"cannot be called as fn\(prompt, completion\)"),
    ],
)
def test_import_path_errors_name_the_field_and_the_fix(reward_module: str, path: str, message: str) -> None:
    with pytest.raises(RewardError, match=r"reward\.importPath") as err:
        import_reward(path.format(mod=reward_module))
    assert err.match(message)


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        ("returns_text", "returned a str, not a number; it must return a float"),
        ("returns_secret", "returned a list, not a number; it must return a float"),
        ("returns_nan", "returned nan; it must return a finite float"),
        ("returns_bool", "returned a bool, not a number; it must return a float"),
    ],
)
def test_a_reward_that_returns_no_number_is_an_error_naming_its_type_never_its_value(
    reward_module: str, fn: str, message: str
) -> None:
    """The error reaches the log, the audit and a dropped group's status: the value (anything
    the reward read) never does."""
    reward = import_reward(f"{reward_module}:{fn}")
    with pytest.raises(RewardError) as err:
        reward(SEVEN, "7")
    assert str(err.value) == f"reward '{reward_module}:{fn}' {message}"


def test_an_import_path_outside_the_allowed_prefixes_is_refused_before_it_is_imported(reward_module: str) -> None:
    allowed = ("spotrl_runtime.rewards", "my_rewards")
    with pytest.raises(RewardError) as err:
        import_reward(f"{reward_module}:length_bonus", allowed=allowed)
    assert str(err.value) == (
        f"spec.reward.importPath '{reward_module}:length_bonus': module '{reward_module}' is not allowed on this "
        "cluster (allowed module prefixes: spotrl_runtime.rewards, my_rewards); put the reward in a package under "
        "one of them, or ask the cluster's admin to add its prefix to the chart value rewards.allowedImportPrefixes"
    )
    assert reward_module not in sys.modules, "refused before the import"
    with pytest.raises(RewardError, match=r"none: built-in rewards by reward\.name only"):
        load_reward(Reward(import_path=f"{reward_module}:length_bonus"), allowed=())
    assert load_reward(Reward(name="gsm8k"), allowed=()).name == "gsm8k", "a built-in by name needs no prefix"
    assert import_reward(f"{reward_module}:length_bonus", allowed=("my_rewards_pkg",))(SEVEN, "7") == pytest.approx(1.1)


def test_a_module_that_fails_on_import_is_named_with_the_exception_type_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its message can hold what the module read (a key): the traceback, the error's cause, has it."""
    (tmp_path / "breaks_on_import.py").write_text("raise RuntimeError('AKIA-the-secret-key')\n")
    (tmp_path / "needs_a_dependency.py").write_text("import spotrl_no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError) as err:
        import_reward("breaks_on_import:score")
    assert str(err.value) == (
        "reward.importPath 'breaks_on_import:score': importing module 'breaks_on_import' raised RuntimeError "
        "(its traceback is in the log of the reward's process)"
    )
    assert isinstance(err.value.__cause__, RuntimeError)
    with pytest.raises(RewardError, match=r"no module named 'spotrl_no_such_dependency_xyz'.*PYTHONPATH"):
        import_reward("needs_a_dependency:score")


def test_exactly_one_of_name_or_import_path() -> None:
    class Both:
        name = "arithmetic_exact"
        import_path = "a.b:c"

    class Neither:
        name = None
        import_path = None

    for spec in (Both(), Neither()):
        with pytest.raises(RewardError, match="exactly one of name"):
            load_reward(spec)


def test_an_unknown_builtin_name_lists_the_known_ones() -> None:
    class Spec:
        name = "bleu"
        import_path = None

    with pytest.raises(RewardError, match="arithmetic_exact"):
        load_reward(Spec())
