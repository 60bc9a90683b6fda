"""The per-token losses of a step, one small function per term. Pure tensor arithmetic, no I/O.

Every tensor here is flat over the micro-batch's trained tokens (``[tokens]``): the log-probs
of :mod:`~spotrl_runtime.training.logprobs` are already gathered at completion positions, so
there is no mask and no padding to guard. Three policies meet in a step (decoupled PPO's names):

- the *behaviour* policy generated the rows: the generator's log-probs, from weights that may be
  a version behind (``generation.lookahead``) and from vLLM's numerics;
- the *proximal* policy is the trainer's own at the start of the step (the detached log-probs of
  its first forward);
- the policy being trained, whose log-probs carry the gradient.

The policy-gradient term is PPO's clipped ratio against the proximal policy (with one optimizer
update per batch the ratio is 1 and the clip never fires), weighted per token by the importance
weight of the proximal policy against the behaviour policy (detached): the correction for stale
weights and for the generator's numerics, applied to every row, stale or not. By default it is
``min(p_proximal / p_behaviour, cap)`` per token (truncated IS); ``training.importanceSampling``
takes the ratio per sequence instead (the product over the rollout's tokens) and/or masks what
exceeds the cap instead of truncating it (masked IS, rejection).

With ``generation.topP < 1`` every log-prob here is under the top-p nucleus, renormalised
(:mod:`~spotrl_runtime.training.logprobs`), and a generated token may lie outside the trainer's
nucleus (-inf): the trainer's policy gives it probability 0, so its importance weight is 0. Such
a token is left out of the loss (no policy term, no KL term, no gradient: not even a NaN one)
and counted (``outside_nucleus``); it still counts in the step's token count, as any token whose
weight is 0, and the gap check compares it as it is (``p_trainer = 0``: a difference of the
generator's whole probability of it). A token outside only the reference's nucleus is left out
of the KL term alone (its k3 is infinite).

A new term is a function of these tensors and one line in :func:`token_loss_terms`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossConfig:
    """The loss's knobs (``spec.training``)."""

    clip_epsilon: float = 0.2
    clip_epsilon_high: float | None = None
    """Clip-higher (DAPO): the ratio's upper bound is ``1 + clip_epsilon_high``; None: ``clip_epsilon``."""
    dual_clip: float | None = 3.0
    """Dual-clip: a negative-advantage token's loss is at most ``dual_clip * |A|`` (None: off)."""
    is_cap: float | None = 2.0
    """The importance weight's cap; None leaves the weight out (every token weighs 1)."""
    kl_coef: float = 0.0
    is_level: str = "token"
    """``token``: each token's own ratio; ``sequence``: the rollout's, the product of its tokens'."""
    is_mode: str = "truncate"
    """``truncate``: a ratio above the cap weighs the cap; ``mask``: it weighs 0 (left out)."""
    kl_estimator: str = "k3"
    """The KL term's per-token estimator: ``k1``, ``k2`` or ``k3`` (:func:`kl_estimate`)."""


@dataclass(frozen=True)
class Tokens:
    """One micro-batch's trained tokens, flat."""

    logprobs: torch.Tensor
    """The trainer's, with gradient."""
    proximal: torch.Tensor
    """The trainer's at the start of the step, detached."""
    behaviour: torch.Tensor
    """The generator's."""
    advantages: torch.Tensor
    fresh: torch.Tensor
    """bool: generated with the very weights the step starts from (not ahead, with older ones)."""
    reference: torch.Tensor | None = None
    """The frozen reference policy's, for the KL term."""
    rows: torch.Tensor | None = None
    """Each token's row (rollout) in the micro-batch, 0-based: the sequence-level weight's sums."""
    scale: torch.Tensor | None = None
    """Each token's weight in the step's loss aggregation against a token of ``token-mean``
    (:func:`~spotrl_runtime.training.advantages.row_scales`); None: 1 for every token."""


@dataclass(frozen=True)
class LossTerms:
    """Sums over one micro-batch's trained tokens (divide by the step's token count)."""

    loss_sum: torch.Tensor
    """Differentiable: the weighted policy-gradient term plus ``kl_coef`` times the KL term, each
    token scaled by the loss aggregation (:attr:`Tokens.scale`)."""
    policy_sum: float
    """The policy-gradient term over the tokens, unscaled (the step reports it as a token mean)."""
    kl_sum: float
    clipped_tokens: int
    tokens: int
    ratio_sum: float
    ratio_max: float
    is_weight_sum: float = 0.0
    is_weight_max: float = 0.0
    is_capped: int = 0
    probs_diff_sum: float = 0.0
    """Over fresh tokens: ``|p_trainer - p_generator|``, the generator's mismatch with the trainer
    (veRL's ``rollout_probs_diff``), which a weight sync that did not arrive turns large."""
    probs_diff_max: float = 0.0
    probs_diff_tokens: int = 0
    stale_diff_sum: float = 0.0
    """The same over stale tokens: the gap one version of staleness makes, plus the numerics."""
    stale_diff_max: float = 0.0
    stale_diff_tokens: int = 0
    entropy_sum: float = 0.0
    """The policy's entropy at each trained position, summed (nats; no gradient)."""
    outside_nucleus: int = 0
    """Tokens outside the trainer's top-p nucleus, left out of the loss."""


def importance_weight(
    proximal: torch.Tensor, behaviour: torch.Tensor, config: LossConfig, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The detached importance weight per token and whether the cap acted on it: ``ratio =
    exp(proximal - behaviour)`` per token, or per sequence (``rows`` says which tokens are one
    rollout's: the exp of their summed log-ratios, every token of it the same), then truncated at
    the cap (``min(ratio, cap)``) or masked above it (``ratio``, or 0 past the cap). Ones, acting
    on none, when the cap is None. A sequence's product may overflow to inf: truncated it weighs
    the cap, masked 0, never a NaN."""
    cap = config.is_cap
    if cap is None:
        return torch.ones_like(proximal), torch.zeros_like(proximal, dtype=torch.bool)
    log_ratio = proximal.detach() - behaviour
    if config.is_level == "sequence":
        if rows is None:
            raise ValueError("a sequence-level importance weight needs each token's row (Tokens.rows)")
        sums = torch.zeros(int(rows.max()) + 1 if rows.numel() else 0, dtype=log_ratio.dtype, device=log_ratio.device)
        log_ratio = sums.index_add(0, rows, log_ratio)[rows]
    ratio = log_ratio.exp()
    if config.is_mode == "mask":
        over = ratio > cap
        return torch.where(over, 0.0, ratio), over
    return ratio.clamp(max=cap), ratio >= cap


def clipped_policy_loss(
    logprobs: torch.Tensor,
    proximal: torch.Tensor,
    advantages: torch.Tensor,
    config: LossConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's per-token loss ``max(-ρA, -clip(ρ, 1-ε, 1+ε_high)A)`` with ``ρ = exp(logp - proximal)``,
    and dual-clip's bound ``-c·A`` for ``A < 0``. Returns (loss, ρ, whether the clip fired)."""
    ratio = (logprobs - proximal).exp()
    high = config.clip_epsilon if config.clip_epsilon_high is None else config.clip_epsilon_high
    unclipped = -ratio * advantages
    clipped = -ratio.clamp(1 - config.clip_epsilon, 1 + high) * advantages
    loss = torch.maximum(unclipped, clipped)
    if config.dual_clip is not None:
        bound = -config.dual_clip * advantages
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return loss, ratio, clipped > unclipped


def k3_kl(logprobs: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy ‖ reference) per token: ``e^d - d - 1``, ``d = ref - logp``,
    clamped as veRL's ``low_var_kl`` is: ``d`` to [-20, 20] and the estimate to at most 10, so one
    token the policy has left far behind cannot overflow the step (``e^d`` of a large ``d``)."""
    delta = (reference - logprobs).clamp(-20.0, 20.0)
    return (delta.exp() - delta - 1).clamp(max=10.0)


def kl_estimate(logprobs: torch.Tensor, reference: torch.Tensor, estimator: str) -> torch.Tensor:
    """Schulman's estimators of KL(policy ‖ reference) per token, ``d = logp - ref``: ``k1`` is
    ``d`` (unbiased, can be negative), ``k2`` is ``d² / 2`` (low variance, biased), ``k3`` is
    :func:`k3_kl` (unbiased, low variance, never negative; the default)."""
    if estimator == "k1":
        return logprobs - reference
    if estimator == "k2":
        return 0.5 * (logprobs - reference).square()
    if estimator == "k3":
        return k3_kl(logprobs, reference)
    raise ValueError(f"unknown KL estimator {estimator!r}: k1, k2 or k3")


def kl_inside(logprobs: torch.Tensor, reference: torch.Tensor, estimator: str) -> torch.Tensor:
    """:func:`kl_estimate` per token, 0 at a token outside either policy's nucleus (its k3 would
    be infinite, and a NaN in a masked-out term is a NaN gradient)."""
    both = inside(logprobs, reference)
    return kl_estimate(torch.where(both, logprobs, 0.0), torch.where(both, reference, 0.0), estimator)


def probability_gap(logprobs: torch.Tensor, behaviour: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """``|p_trainer - p_generator|`` at the tokens ``where`` selects (no gradient)."""
    return (logprobs.detach().exp() - behaviour.exp()).abs()[where]


def inside(*logprobs: torch.Tensor) -> torch.Tensor:
    """bool: the tokens every one of ``logprobs`` gives a probability (inside each one's nucleus)."""
    finite = torch.ones_like(logprobs[0], dtype=torch.bool)
    for values in logprobs:
        finite &= torch.isfinite(values.detach())
    return finite


def token_loss_terms(tokens: Tokens, config: LossConfig) -> LossTerms:
    """The micro-batch's loss sum and its metrics' sums. Tokens outside the trainer's nucleus
    (-inf log-probs) weigh 0: replaced by 0 before any arithmetic, since a NaN in the forward
    pass of a masked-out term is a NaN gradient in its backward pass."""
    kept = inside(tokens.logprobs, tokens.proximal)
    logprobs = torch.where(kept, tokens.logprobs, 0.0)
    proximal = torch.where(kept, tokens.proximal, 0.0)
    # Outside the nucleus the log-ratio is 0, so a sequence's product is over its kept tokens.
    weight, capped = importance_weight(
        torch.where(kept, proximal, tokens.behaviour), tokens.behaviour, config, tokens.rows
    )
    weight = weight * kept
    policy, ratio, clipped = clipped_policy_loss(logprobs, proximal, tokens.advantages, config)
    policy = policy * weight
    scale = tokens.scale if tokens.scale is not None else torch.ones_like(policy)
    loss = (policy * scale).sum()
    kl_sum = 0.0
    if tokens.reference is not None and config.kl_coef > 0:
        kl = kl_inside(torch.where(kept, tokens.logprobs, -torch.inf), tokens.reference, config.kl_estimator)
        loss = loss + config.kl_coef * (kl * scale).sum()
        kl_sum = float(kl.detach().sum())
    fresh = probability_gap(tokens.proximal, tokens.behaviour, tokens.fresh)
    stale = probability_gap(tokens.proximal, tokens.behaviour, ~tokens.fresh)
    return LossTerms(
        loss_sum=loss,
        policy_sum=float(policy.detach().sum()),
        kl_sum=kl_sum,
        clipped_tokens=int(clipped.sum()),
        tokens=int(tokens.logprobs.numel()),
        ratio_sum=float(ratio.detach().sum()),
        ratio_max=_max(ratio.detach()),
        is_weight_sum=float(weight.sum()),
        is_weight_max=_max(weight),
        is_capped=int((capped & kept).sum()),
        probs_diff_sum=float(fresh.sum()),
        probs_diff_max=_max(fresh),
        probs_diff_tokens=int(fresh.numel()),
        stale_diff_sum=float(stale.sum()),
        stale_diff_max=_max(stale),
        stale_diff_tokens=int(stale.numel()),
        outside_nucleus=int((~kept).sum()),
    )


def _max(values: torch.Tensor) -> float:
    return float(values.max()) if values.numel() else 0.0
