"""A step's work as rows, and how it is shared among trainer ranks. Pure: no torch, no I/O.

A step trains on the finished groups stamped for it. Each rollout of a group whose rewards
differ becomes a :class:`Row` (prompt, completion, generation-time log-probs, the group-relative
advantage). The loss of the step is a token mean over every row, so a row's gradient does not
depend on which process computes it: a group of ranks splits the rows (whole groups, balanced
by tokens, :func:`split_rows`), each rank divides its micro-batch sums by the *step's* token
count, and the ranks' gradients add up to the single process's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spotrl_runtime.core.types import FinishedGroup
from spotrl_runtime.training.grpo import contributes, group_advantages


@dataclass(frozen=True)
class Row:
    """One rollout as the trainer sees it."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]
    old_logprobs: tuple[float, ...]
    advantage: float
    weight_version: int = -1
    """The policy version that generated the completion (-1: a padding row)."""


@dataclass(frozen=True)
class StepRows:
    """A step's rows, grouped as their groups were (a group's rows stay on one rank)."""

    by_group: tuple[tuple[Row, ...], ...]
    rewards: tuple[float, ...]
    groups: int
    skipped: int
    """Groups that contribute nothing (fewer than 2 rollouts, or equal rewards)."""

    @property
    def rows(self) -> list[Row]:
        return [r for g in self.by_group for r in g]

    @property
    def tokens(self) -> int:
        """Completion tokens of the whole step: what every rank divides its loss sums by."""
        return sum(len(r.completion_ids) for g in self.by_group for r in g)


def step_rows(groups: Sequence[FinishedGroup]) -> StepRows:
    """The rows of a step: advantages per group; zero-variance groups and empty completions left out."""
    by_group: list[tuple[Row, ...]] = []
    skipped = 0
    for group in groups:
        group_rewards = [r.reward for r in group.rollouts]
        if len(group_rewards) < 2 or not contributes(group_rewards):
            skipped += 1
            continue
        rows = []
        for rollout, adv in zip(group.rollouts, group_advantages(group_rewards).tolist(), strict=True):
            if len(rollout.logprobs) != len(rollout.completion_token_ids):
                raise ValueError(
                    f"group {group.group_id} rollout {rollout.index}: {len(rollout.logprobs)} logprobs for "
                    f"{len(rollout.completion_token_ids)} completion tokens"
                )
            if rollout.completion_token_ids:
                rows.append(
                    Row(
                        rollout.prompt_token_ids,
                        rollout.completion_token_ids,
                        rollout.logprobs,
                        float(adv),
                        rollout.weight_version,
                    )
                )
        if rows:
            by_group.append(tuple(rows))
    rewards = tuple(r.reward for g in groups for r in g.rollouts)
    return StepRows(tuple(by_group), rewards, len(groups), skipped)


def split_rows(step: StepRows, ranks: int) -> list[list[Row]]:
    """Whole groups to ranks, the group with the most tokens first to the rank with the fewest
    so far (ties: the lowest rank). Deterministic: the same step always splits the same way."""
    if ranks < 1:
        raise ValueError(f"ranks must be at least 1, got {ranks}")
    shares: list[list[Row]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    order = sorted(range(len(step.by_group)), key=lambda i: (-sum(len(r.completion_ids) for r in step.by_group[i]), i))
    for i in order:
        rank = min(range(ranks), key=lambda k: (load[k], k))
        shares[rank].extend(step.by_group[i])
        load[rank] += sum(len(r.completion_ids) for r in step.by_group[i])
    return shares


def micro_batches(shares: Sequence[Sequence[Row]], micro_batch_size: int) -> int:
    """Forward/backward passes every rank runs: the most any rank's share needs."""
    return max((math.ceil(len(s) / micro_batch_size) for s in shares), default=0)


@dataclass
class LossSums:
    """Sums over trained tokens (a rank's, or the step's once the ranks' are added)."""

    loss: float = 0.0
    policy: float = 0.0
    kl: float = 0.0
    clipped: int = 0
    ratio: float = 0.0
    ratio_max: float = 0.0
    probs_diff: float = 0.0
    probs_diff_max: float = 0.0
    probs_diff_tokens: int = 0
    entropy: float = 0.0

    def add(self, terms: Any) -> None:
        """Adds one micro-batch's :class:`~spotrl_runtime.training.grpo.LossTerms`."""
        self.loss += float(terms.loss_sum.detach())
        self.policy += terms.policy_sum
        self.kl += terms.kl_sum
        self.clipped += terms.clipped_tokens
        self.ratio += terms.ratio_sum
        self.ratio_max = max(self.ratio_max, terms.ratio_max)
        self.probs_diff += terms.probs_diff_sum
        self.probs_diff_max = max(self.probs_diff_max, terms.probs_diff_max)
        self.probs_diff_tokens += terms.probs_diff_tokens
        self.entropy += terms.entropy_sum

    @classmethod
    def total(cls, parts: Sequence[LossSums]) -> LossSums:
        out = cls()
        for p in parts:
            out.loss += p.loss
            out.policy += p.policy
            out.kl += p.kl
            out.clipped += p.clipped
            out.ratio += p.ratio
            out.ratio_max = max(out.ratio_max, p.ratio_max)
            out.probs_diff += p.probs_diff
            out.probs_diff_max = max(out.probs_diff_max, p.probs_diff_max)
            out.probs_diff_tokens += p.probs_diff_tokens
            out.entropy += p.entropy
        return out


ROLLOUT_GAP_METRICS = ("rollout_probs_diff_mean", "rollout_probs_diff_max", "rollout_probs_diff_tokens")
"""The step metrics that compare the generator's log-probs with the trainer's (:func:`step_metrics`)."""


def step_metrics(step: StepRows, sums: LossSums) -> dict[str, float]:
    """The step's loss metrics (token means), the same for one process and for a group of ranks.

    ``rollout_probs_diff_mean``/``_max`` (veRL's names; NeMo-RL's ``token_mult_prob_error`` and
    TRL's ``sampling_logp_difference`` measure the same thing) compare the generator's
    probability of each trained token with the trainer's, over the rows generated with the
    weights the step started from; they are left out when no such row was trained (every
    group of the step was generated ahead, with older weights, or had equal rewards)."""
    tokens = step.tokens
    denom = max(tokens, 1)
    gap: dict[str, float] = {}
    if sums.probs_diff_tokens:
        values = (sums.probs_diff / sums.probs_diff_tokens, sums.probs_diff_max, float(sums.probs_diff_tokens))
        gap = dict(zip(ROLLOUT_GAP_METRICS, values, strict=True))
    return gap | {
        "reward_mean": sum(step.rewards) / len(step.rewards) if step.rewards else 0.0,
        "groups": float(step.groups),
        "groups_zero_variance": float(step.skipped),
        "rollouts": float(len(step.rewards)),
        "tokens": float(tokens),
        "loss": sums.loss / denom,
        "policy_loss": sums.policy / denom,
        "kl": sums.kl / denom,
        "entropy": sums.entropy / denom,
        "clip_fraction": sums.clipped / denom,
        "ratio_mean": sums.ratio / denom if tokens else 1.0,
        "ratio_max": sums.ratio_max,
    }
