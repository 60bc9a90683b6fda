"""The GSM8K rewards on the answers models actually write: reasoning before the mark,
thousands separators, dollar signs, several marks, none, and gold answers given as the
dataset's worked solutions."""

from __future__ import annotations

import pytest

from spotrl_runtime.api.rljob import Reward
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.rewards import load_reward
from spotrl_runtime.rewards.builtin import gsm8k, gsm8k_flexible, gsm8k_gold

Q = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many?"
GOLD_PLAIN = Prompt(idx=0, task_name="gsm8k", text=Q, answer="72")
GOLD_SOLUTION = Prompt(
    idx=0, task_name="gsm8k", text=Q, answer="Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n48+24 = 72\n#### 72"
)
THOUSAND = Prompt(idx=1, task_name="gsm8k", text="...", answer="#### 1000")
NEGATIVE = Prompt(idx=2, task_name="gsm8k", text="...", answer="-3.5")


@pytest.mark.parametrize("gold", [GOLD_PLAIN, GOLD_SOLUTION], ids=["plain", "worked-solution"])
@pytest.mark.parametrize(
    ("completion", "strict", "flexible"),
    [
        ("She sold 48 + 24 = 72 clips.\n#### 72", 1.0, 1.0),
        ("#### 72", 1.0, 1.0),
        ("####72", 1.0, 1.0),
        ("48/2 = 24, so 48 + 24 = 72 in all", 0.0, 1.0),  # no mark: strict scores it 0
        ("#### 71\nWait, I made a mistake.\n#### 72", 1.0, 1.0),  # the last mark counts
        ("#### 72\nso the total is 73", 1.0, 0.0),  # flexible reads the last number
        ("#### 72.0", 1.0, 1.0),  # equal as numbers
        ("#### $72", 1.0, 1.0),
        ("#### 7 2", 0.0, 0.0),
        ("#### seventy-two", 0.0, 0.0),  # no digits: nothing to compare
        ("", 0.0, 0.0),
    ],
)
def test_gsm8k_strict_and_flexible(gold: Prompt, completion: str, strict: float, flexible: float) -> None:
    assert gsm8k(gold, completion) == strict
    assert gsm8k_flexible(gold, completion) == flexible


@pytest.mark.parametrize(
    ("completion", "reward"),
    [("#### 1,000", 1.0), ("#### 1000", 1.0), ("#### $1,000.00", 1.0), ("#### 100", 0.0), ("#### 10,00", 1.0)],
)
def test_thousands_separators_are_not_digits(completion: str, reward: float) -> None:
    # "10,00" is 1000 once the separators go: GSM8K's scorers compare the digits, and so do we.
    assert gsm8k(THOUSAND, completion) == reward


def test_negative_and_decimal_answers() -> None:
    assert gsm8k(NEGATIVE, "so -3.5\n#### -3.5") == 1.0
    assert gsm8k(NEGATIVE, "#### 3.5") == 0.0
    assert gsm8k_flexible(NEGATIVE, "the change is -3.50") == 1.0


def test_the_gold_number_of_a_row() -> None:
    assert gsm8k_gold(GOLD_SOLUTION.answer) == 72
    assert gsm8k_gold(" 72 ") == 72
    assert gsm8k_gold("#### 1 #### 2") == 2
    assert gsm8k_gold("no number") is None
    assert gsm8k(Prompt(0, "gsm8k", "...", "no number"), "#### 0") == 0.0, "an answer without a number matches nothing"


@pytest.mark.parametrize("name", ["gsm8k", "gsm8k_flexible"])
def test_loaded_by_name_from_the_spec(name: str) -> None:
    reward = load_reward(Reward(name=name))
    assert reward.name == name
    assert reward(GOLD_SOLUTION, "reasoning... 48 + 24 = 72\n#### 72") == 1.0
