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
    length_normalizer: int = 1
    """``seq-mean-token-sum-norm``'s constant (``generation.maxNewTokens``)."""

    def __post_init__(self) -> None:
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"advantage estimator must be one of {', '.join(ESTIMATORS)}, got {self.estimator!r}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"loss aggregation must be one of {', '.join(AGGREGATIONS)}, got {self.aggregation!r}")
        if self.length_normalizer < 1:
            raise ValueError(f"length_normalizer must be at least 1, got {self.length_normalizer}")


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
      constant ``C`` (``length_normalizer``), averaged over rollouts: no length bias.

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
    return [total / (n * objective.length_normalizer)] * len(lengths)


def contributes(rewards: Sequence[float] | torch.Tensor) -> bool:
    """Whether a group's rewards differ at all (a zero-variance group contributes nothing)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    return bool((r != r[0]).any())
