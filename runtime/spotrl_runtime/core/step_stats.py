"""What a step's rollouts say, under the names RL users read every step (pure logic).

veRL logs ``response_length/mean``, ``/max`` and ``/clip_ratio`` and ``critic/score/mean``;
TRL ``completions/mean_length``, ``completions/clipped_ratio``, ``reward_std``. SpotRL keeps
flat names (an audit record is one JSON object, a Prometheus metric one name):

- ``reward_mean``, ``reward_std``: over the step's rollouts;
- ``accuracy``: the fraction of rollouts a verifiable reward scored 1.0 or more (a correct
  answer: ``gsm8k``, ``math_verify``, ``arithmetic_exact``);
- ``response_length_mean``, ``response_length_max``: completion tokens;
- ``response_clip_ratio``: the fraction cut off at ``maxNewTokens`` (finish reason ``length``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from spotrl_runtime.core.types import FinishedGroup

STEP_STATS = (
    "reward_mean",
    "reward_std",
    "accuracy",
    "response_length_mean",
    "response_length_max",
    "response_clip_ratio",
)


def rollout_stats(groups: Sequence[FinishedGroup]) -> dict[str, float]:
    """:data:`STEP_STATS` over every rollout of ``groups`` (all zero for none)."""
    rollouts = [r for g in groups for r in g.rollouts]
    if not rollouts:
        return dict.fromkeys(STEP_STATS, 0.0)
    rewards = [r.reward for r in rollouts]
    lengths = [len(r.completion_token_ids) for r in rollouts]
    mean = sum(rewards) / len(rewards)
    return {
        "reward_mean": mean,
        "reward_std": math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards)),
        "accuracy": sum(1 for x in rewards if x >= 1.0) / len(rewards),
        "response_length_mean": sum(lengths) / len(lengths),
        "response_length_max": float(max(lengths)),
        "response_clip_ratio": sum(1 for r in rollouts if r.finish_reason == "length") / len(rollouts),
    }
