"""What a step's rollouts say, under the names RL users read every step (pure logic).

veRL logs ``response_length/mean``, ``/max`` and ``/clip_ratio`` and ``critic/score/mean``;
TRL ``completions/mean_length``, ``completions/clipped_ratio``, ``reward_std``. SpotRL keeps
flat names (an audit record is one JSON object, a Prometheus metric one name):

- ``reward_mean``, ``reward_std``: over the step's rollouts;
- ``accuracy``: the fraction of rollouts a verifiable reward scored 1.0 or more (a correct
  answer: ``gsm8k``, ``math_verify``, ``arithmetic_exact``);
- ``response_length_mean``, ``response_length_max``: completion tokens;
- ``response_clip_ratio``: the fraction cut off at ``maxNewTokens`` (finish reason ``length``);
- ``frac_reward_zero_std`` (TRL's name): the fraction of groups whose rewards are all equal,
  which teach nothing (a group's advantages are its rewards against each other). At 1.0 the
  step trains nothing; :class:`LearningSignal` says so when it lasts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from spotrl_runtime.core.types import FinishedGroup

STEP_STATS = (
    "reward_mean",
    "reward_std",
    "accuracy",
    "response_length_mean",
    "response_length_max",
    "response_clip_ratio",
    "frac_reward_zero_std",
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
        "frac_reward_zero_std": sum(1 for g in groups if len({r.reward for r in g.rollouts}) <= 1) / len(groups),
    }


NO_SIGNAL_STEPS = 5
"""Steps in a row without a group whose rewards differ before a run says it learns nothing."""


@dataclass
class LearningSignal:
    """Counts the steps in a row whose every group had equal rewards (``frac_reward_zero_std``
    1.0: no gradient at all). A run on a dataset its policy cannot solve (every reward 0), or
    with a reward that reads the wrong field, trains nothing; this is how it says so."""

    patience: int = NO_SIGNAL_STEPS
    streak: int = 0

    def observe(self, frac_reward_zero_std: float) -> bool:
        """Records a step; True on the step at which the streak reaches ``patience``."""
        self.streak = self.streak + 1 if frac_reward_zero_std >= 1.0 else 0
        return self.streak == self.patience

    @property
    def lost(self) -> bool:
        return self.streak >= self.patience
