"""The built-in verifiable rewards. Each is a :data:`~spotrl_runtime.rewards.RewardFn`."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from spotrl_runtime.core.types import Prompt

_INTEGER = re.compile(r"-?[0-9]+")
# A number as GSM8K writes answers and models write them back: a sign, a dollar sign,
# thousands separators, a decimal part ("-$1,234.50").
_NUMBER = r"-?\$?[0-9][0-9,]*(?:\.[0-9]+)?"
_MARKED = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def arithmetic_exact(prompt: Prompt, completion: str) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, is exactly the row's answer."""
    return 1.0 if completion.strip() == prompt.answer.strip() else 0.0


def format_only(prompt: Prompt, completion: str) -> float:
    """1.0 when the completion is shaped like an answer (an integer, surrounding whitespace
    ignored), whether or not it is right: a reward for learning the output format."""
    return 1.0 if _INTEGER.fullmatch(completion.strip()) else 0.0


def number_value(text: str) -> Decimal | None:
    """The value of a number as :data:`_NUMBER` matches it (``"$1,234.50"`` is 1234.5), or None."""
    try:
        return Decimal(text.replace("$", "").replace(",", ""))
    except InvalidOperation:
        return None


def gsm8k_gold(answer: str) -> Decimal | None:
    """The gold number of a GSM8K row: what follows its last ``####`` (the dataset's own answer
    field is the worked solution ending ``#### 72``), else the whole answer (``"72"``)."""
    marked = _MARKED.findall(answer)
    return number_value(marked[-1] if marked else answer.strip())


def gsm8k(prompt: Prompt, completion: str) -> float:
    """GSM8K's strict format: 1.0 when the completion's **last** ``#### <number>`` equals the
    row's answer as a number (``#### 1,000`` matches ``1000``, ``#### 7.0`` matches ``7``); 0.0
    when it differs or the completion has no ``####`` line."""
    marked = _MARKED.findall(completion)
    gold = gsm8k_gold(prompt.answer)
    return 1.0 if marked and gold is not None and number_value(marked[-1]) == gold else 0.0


def gsm8k_flexible(prompt: Prompt, completion: str) -> float:
    """GSM8K without the format: 1.0 when the **last number** anywhere in the completion equals
    the row's answer (for models not trained to write ``####``)."""
    numbers = _ANY_NUMBER.findall(completion)
    gold = gsm8k_gold(prompt.answer)
    return 1.0 if numbers and gold is not None and number_value(numbers[-1]) == gold else 0.0


def math_verify(prompt: Prompt, completion: str) -> float:
    """1.0 when math-verify finds the completion's answer equal to the row's: it reads
    ``\\boxed{}``, LaTeX and plain numbers and compares them symbolically (``\\boxed{1/2}``
    equals ``0.5``). Its own timeouts are off (they use SIGALRM, which only a main thread has):
    the reward's process is what times out (:mod:`~spotrl_runtime.rewards.runner`)."""
    from math_verify import parse, verify

    gold = parse(
        prompt.answer if "$" in prompt.answer or "\\" in prompt.answer else f"${prompt.answer}$", parsing_timeout=None
    )
    answer = parse(completion, parsing_timeout=None)
    return 1.0 if gold and answer and verify(gold, answer, timeout_seconds=None) else 0.0


BUILTIN_REWARDS = {
    "arithmetic_exact": arithmetic_exact,
    "format_only": format_only,
    "gsm8k": gsm8k,
    "gsm8k_flexible": gsm8k_flexible,
    "math_verify": math_verify,
}

BUILTIN_IMPORTS: dict[str, tuple[str, ...]] = {"math_verify": ("math_verify",)}
"""What a built-in reward imports on its first call, imported by the reward's process before it
says it is ready (:mod:`~spotrl_runtime.rewards.runner`): no call's timeout pays for it."""
