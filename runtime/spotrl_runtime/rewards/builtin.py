"""The built-in verifiable rewards. Each is a :data:`~spotrl_runtime.rewards.RewardFn`."""

from __future__ import annotations

import re

from spotrl_runtime.core.types import Prompt

_INTEGER = re.compile(r"-?[0-9]+")


def arithmetic_exact(prompt: Prompt, completion: str) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, is exactly the row's answer."""
    return 1.0 if completion.strip() == prompt.answer.strip() else 0.0


def format_only(prompt: Prompt, completion: str) -> float:
    """1.0 when the completion is shaped like an answer (an integer, surrounding whitespace
    ignored), whether or not it is right: a reward for learning the output format."""
    return 1.0 if _INTEGER.fullmatch(completion.strip()) else 0.0


BUILTIN_REWARDS = {"arithmetic_exact": arithmetic_exact, "format_only": format_only}
