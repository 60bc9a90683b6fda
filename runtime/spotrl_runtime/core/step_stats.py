"""What a step's rollouts say, under the names RL users read every step (pure logic).

veRL logs ``response_length/mean``, ``/max`` and ``/clip_ratio`` and ``critic/score/mean``;
TRL ``completions/mean_length``, ``completions/clipped_ratio``, ``reward_std``. SpotRL keeps
flat names (an audit record is one JSON object, a Prometheus metric one name):

- ``reward_mean``, ``reward_std``: over the step's rollouts;
- ``accuracy``: the fraction of rollouts a verifiable reward scored 1.0 or more (a correct
  answer: ``gsm8k``, ``math_verify``, ``arithmetic_exact``);
- ``response_length_mean``, ``response_length_max``: completion tokens (an episode's: its turns'
  and its observations');
- ``response_clip_ratio``: the fraction cut off at ``maxNewTokens`` (finish reason ``length``);
- ``turns_mean``, ``observation_tokens_mean``: with ``spec.environment``, an episode's turns and
  the tokens its environment wrote (1 and 0 for single-turn completions);
- ``frac_reward_zero_std`` (TRL's name): the fraction of groups whose rewards are all equal,
  which teach nothing (a group's advantages are its rewards against each other). At 1.0 the
  step trains nothing; :class:`LearningSignal` says so when it lasts.

And what the generation workers did meanwhile: ``generation_idle_share`` (the mean over the
workers) and ``generation_idle_share_max`` (the idlest worker), the share of the step's wall
time a worker was not generating: waiting for work (the lookahead gate closed), for a weight
load (its sender not there yet, or its bytes on the way), or dead and restarting. A
:class:`BusyClock` per worker records when it generated; :func:`idle_shares` reads them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from spotrl_runtime.core.types import FinishedGroup

STEP_STATS = (
    "reward_mean",
    "reward_std",
    "accuracy",
    "response_length_mean",
    "response_length_max",
    "response_clip_ratio",
    "frac_reward_zero_std",
    "turns_mean",
    "observation_tokens_mean",
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
        # An episode's turns are the policy's runs between its observations (it never ends on one).
        "turns_mean": sum(len(r.observed) + 1 for r in rollouts) / len(rollouts),
        "observation_tokens_mean": sum(b - a for r in rollouts for a, b in r.observed) / len(rollouts),
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


@dataclass
class BusyClock:
    """When one worker generated, from the times its pool saw it start and stop (the caller
    passes the clock: pure logic). Spans older than the oldest window still to be read are
    forgotten by :meth:`busy_seconds`, so a long run keeps a few spans per worker."""

    since: float | None = None
    """Busy since this time (None: idle now)."""
    spans: deque[tuple[float, float]] = field(default_factory=deque)
    """Finished busy spans ``(start, end)``, oldest first."""

    def mark(self, busy: bool, now: float) -> None:
        """The worker is (``busy``) or is not generating from ``now`` on."""
        if busy and self.since is None:
            self.since = now
        elif not busy and self.since is not None:
            if now > self.since:
                self.spans.append((self.since, now))
            self.since = None

    def busy_seconds(self, start: float, end: float) -> float:
        """Seconds it generated within ``[start, end]``; forgets what ended before ``start``."""
        while self.spans and self.spans[0][1] <= start:
            self.spans.popleft()
        spans: Iterable[tuple[float, float]] = self.spans
        if self.since is not None:
            spans = [*self.spans, (self.since, end)]
        return sum(max(0.0, min(b, end) - max(a, start)) for a, b in spans)


def idle_shares(busy_seconds: Iterable[float], seconds: float) -> tuple[float, float]:
    """``(mean, max)`` over the workers of the share of ``seconds`` (a step's wall time) each
    was not generating, given the seconds each was (each share in [0, 1]); ``(0, 0)`` for no
    worker or no time."""
    if seconds <= 0:
        return 0.0, 0.0
    shares = [min(1.0, max(0.0, 1.0 - b / seconds)) for b in busy_seconds]
    if not shares:
        return 0.0, 0.0
    return sum(shares) / len(shares), max(shares)
