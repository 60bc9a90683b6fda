"""Each rollout's advantage from its group's rewards, and the step's loss aggregation. No I/O.

``spec.training.advantage`` picks the estimator (veRL's ``algorithm.adv_estimator``):

- ``grpo``: ``(r - mean) / (std + eps)`` within the group (std with Bessel's correction), or
  ``r - mean`` with ``normalizeByStd: false`` (Dr. GRPO; veRL's ``norm_adv_by_std_in_grpo``,
  TRL's ``scale_rewards: none``);
- ``rloo``: leave-one-out, ``r_i - mean of the others`` = ``(r_i - mean) * n / (n - 1)``;
- ``reinforce++-baseline``: ``r - mean`` within the group, then whitened over the step's
  trained tokens (a token-weighted mean and Bessel-corrected variance, as veRL's
  ``masked_whiten`` does over the batch): :func:`whiten`.

A group whose rewards are all equal has no preference to learn from under every estimator: it
is left out of the step (:func:`contributes`), before any whitening.

``spec.training.overlong`` (DAPO's): ``softPenalty`` adds :func:`overlong_penalty` to each
reward before the advantages (so a group of equal rewards whose lengths differ near the limit
has something to prefer); ``filter`` leaves each completion cut off at ``maxNewTokens`` out of
the loss after the advantages (its reward still counts in its group's mean and spread).

``spec.training.kl.inReward`` (veRL's ``use_kl_in_reward``): each reward less ``klCoef`` times
its rollout's KL to the reference, summed over its completion (``Objective.reward_kl``; the
trainer scores the rollouts first), before the advantages, as the overlong penalty is.

``spec.training.lossAggregation`` says how the step's per-token losses become one number
(veRL's ``loss_agg_mode``): :func:`row_scales` gives each trained row the weight of its tokens
against a token of ``token-mean``, so that every micro-batch still divides its loss sum by the
step's token count and a group of ranks still adds up to one process.

The per-token losses are in :mod:`spotrl_runtime.training.losses`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ADVANTAGE_EPS = 1e-6
WHITEN_EPS = 1e-8

ESTIMATORS = ("grpo", "rloo", "reinforce++-baseline")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class Objective:
    """What the step optimises beyond the per-token loss (``spec.training.advantage`` and
    ``lossAggregation``)."""

    estimator: str = "grpo"
    normalize_by_std: bool = True
    """``grpo`` only: divide by the group's standard deviation."""
    aggregation: str = "token-mean"
    max_new_tokens: int = 1
    """``generation.maxNewTokens``: ``seq-mean-token-sum-norm``'s constant, and where the overlong
    penalty ends."""
    overlong_filter: bool = False
    """Leave completions cut off at ``max_new_tokens`` out of the loss (``training.overlong.filter``)."""
    soft_penalty: tuple[int, float] | None = None
    """DAPO's overlong shaping, (buffer, factor) (``training.overlong.softPenalty``): :func:`overlong_penalty`."""
    reward_kl: float = 0.0
    """``training.klCoef`` with ``training.kl.inReward``: each reward less this times its rollout's
    KL to the reference (summed over its completion) before the advantages; 0: the KL, if any, is
    a term of the loss."""

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"advantage estimator must be one of {', '.join(ESTIMATORS)}, got {self.estimator!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"loss aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.soft_penalty is not None and not 1 <= self.soft_penalty[0] < self.max_new_tokens:
            raise ValueError(f"the overlong buffer must be in [1, {self.max_new_tokens}), got {self.soft_penalty[0]}")


DEFAULT_OBJECTIVE = Objective()
"""GRPO's advantage over the group's std, every trained token alike: what a spec that sets neither says."""


def group_advantages(
    rewards: Sequence[float] | torch.Tensor, objective: Objective = DEFAULT_OBJECTIVE, eps: float = ADVANTAGE_EPS
) -> torch.Tensor:
    """One group's advantages under ``objective``'s estimator (before any whitening over the step).

    A group whose rewards are all equal gets exactly zero advantages under every estimator.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64)
    n = r.numel()
    if n < 2:
        raise ValueError(f"a group needs at least 2 rewards for a relative advantage, got {n}")
    if not contributes(r):
        return torch.zeros_like(r, dtype=torch.float32)
    centred = r - r.mean()
    if objective.estimator == "rloo":
        return (centred * (n / (n - 1))).float()
    if objective.estimator == "grpo" and objective.normalize_by_std:
        return (centred / (r.std(unbiased=True) + eps)).float()
    return centred.float()


def whiten(advantages: Sequence[float], tokens: Sequence[int]) -> list[float]:
    """``(a - mean) / sqrt(var + 1e-8)`` over every trained token: row ``i``'s advantage counts
    ``tokens[i]`` times in the mean and in the variance (Bessel-corrected over the tokens).
    Fewer than two tokens: centred only."""
    a = torch.tensor(advantages, dtype=torch.float64)
    w = torch.tensor(tokens, dtype=torch.float64)
    total = w.sum()
    if total < 1:
        return [float(x) for x in a.float()]
    mean = (a * w).sum() / total
    if total < 2:
        return [float(x) for x in (a - mean).float()]
    var = (w * (a - mean) ** 2).sum() / (total - 1)
    return [float(x) for x in ((a - mean) / torch.sqrt(var + WHITEN_EPS)).float()]


def row_scales(lengths: Sequence[int], rollouts: int, objective: Objective) -> list[float]:
    """Each trained row's token weight against a token of ``token-mean`` (whose loss is the sum
    over the step's ``T = sum(lengths)`` trained tokens divided by ``T``):

    - ``token-mean``: 1 (every trained token alike);
    - ``seq-mean-token-mean``: ``T / (N * L_i)``: each rollout's token mean, averaged over rollouts;
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): ``T / (N * C)``: each rollout's token sum over a
      constant ``C`` (``max_new_tokens``), averaged over rollouts: no length bias.

    ``N`` is ``rollouts``: every rollout the step holds, those of groups with equal rewards (no
    gradient) included, as veRL's and TRL's batch means count them; so the normaliser does not
    grow as more groups saturate.
    """
    if objective.aggregation == "token-mean":
        return [1.0] * len(lengths)
    total = sum(lengths)
    n = max(rollouts, 1)
    if objective.aggregation == "seq-mean-token-mean":
        return [total / (n * length) for length in lengths]
    return [total / (n * objective.max_new_tokens)] * len(lengths)


def overlong_penalty(length: int, objective: Objective) -> float:
    """DAPO's soft overlong punishment of a completion of ``length`` tokens: 0 up to
    ``max_new_tokens - buffer``, then falling linearly to ``-factor`` at ``max_new_tokens``
    (0 without ``soft_penalty``)."""
    if objective.soft_penalty is None:
        return 0.0
    buffer, factor = objective.soft_penalty
    over = length - (objective.max_new_tokens - buffer)
    return -factor * min(over, buffer) / buffer if over > 0 else 0.0


def contributes(rewards: Sequence[float] | torch.Tensor) -> bool:
    """Whether a group's rewards differ at all (a zero-variance group contributes nothing)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    return bool((r != r[0]).any())
