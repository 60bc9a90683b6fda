"""Rewards: built-in verifiable tasks and any ``fn(prompt, completion) -> float`` by import path."""

from spotrl_runtime.rewards.builtin import BUILTIN_REWARDS, arithmetic_exact, format_only
from spotrl_runtime.rewards.loading import RewardError, RewardFn, RewardFunction, import_reward, load_reward

__all__ = [
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardFn",
    "RewardFunction",
    "arithmetic_exact",
    "format_only",
    "import_reward",
    "load_reward",
]
