"""GRPO's arithmetic on tensors: group-relative advantages and the clipped token loss. No I/O.

The loss of a step is a token-level mean over every completion token the step trains on: the
caller sums :func:`token_loss_terms`'s per-token losses over micro-batches and divides each
micro-batch's sum by the step's total token count, so micro-batching never changes the gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

ADVANTAGE_EPS = 1e-6


def group_advantages(rewards: Sequence[float] | torch.Tensor, eps: float = ADVANTAGE_EPS) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` within one group (std with Bessel's correction).

    A group whose rewards are all equal has no preference to learn from: its advantages are
    exactly zero (and :func:`contributes` says to leave it out of the step).
    """
    r = torch.as_tensor(rewards, dtype=torch.float64)
    if r.numel() < 2:
        raise ValueError(f"a group needs at least 2 rewards for a relative advantage, got {r.numel()}")
    if not contributes(r):
        return torch.zeros_like(r, dtype=torch.float32)
    return ((r - r.mean()) / (r.std(unbiased=True) + eps)).float()


def contributes(rewards: Sequence[float] | torch.Tensor) -> bool:
    """Whether a group's rewards differ at all (a zero-variance group contributes nothing)."""
    r = torch.as_tensor(rewards, dtype=torch.float64)
    return bool((r != r[0]).any())


@dataclass(frozen=True)
class LossTerms:
    """Sums over the masked tokens of one micro-batch (divide by the step's token count)."""

    loss_sum: torch.Tensor
    """Differentiable: policy-gradient term plus ``kl_coef`` times the KL term."""
    policy_sum: float
    kl_sum: float
    clipped_tokens: int
    tokens: int
    ratio_sum: float
    ratio_max: float
    probs_diff_sum: float = 0.0
    """Sum over the tokens of rows generated with the weights that computed ``logprobs``: the
    absolute difference between the trainer's and the generator's probability of the token."""
    probs_diff_max: float = 0.0
    probs_diff_tokens: int = 0
    entropy_sum: float = 0.0
    """Sum over the masked tokens of the policy's entropy at that position (nats; no gradient)."""


def token_entropy_sum(logits: torch.Tensor, mask: torch.Tensor, temperature: float, chunk: int = 1024) -> float:
    """The policy's entropy ``-Σ p log p`` over the vocabulary at each masked position, summed
    (no gradient): the sampling distribution's spread, which RL users watch collapse. Computed
    ``chunk`` positions at a time, so the extra memory is ``chunk × vocab`` floats whatever the
    micro-batch."""
    with torch.no_grad():
        picked = logits[mask]
        total = 0.0
        for start in range(0, picked.shape[0], chunk):
            logp = torch.log_softmax(picked[start : start + chunk].float() / temperature, dim=-1)
            total += float(-(logp.exp() * logp).sum())
        return total


def token_loss_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_epsilon: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    same_weights: torch.Tensor | None = None,
    is_cap: float | None = None,
) -> LossTerms:
    """PPO-clipped policy loss (and optional k3 KL to a reference) summed over masked tokens.

    ``logprobs`` [B, T] are the current policy's (with grad), ``old_logprobs`` [B, T] the
    generation-time ones, ``advantages`` [B] one per sequence, ``mask`` [B, T] 1 on completion
    tokens. Per token: ``-min(ρA, clip(ρ, 1-ε, 1+ε)A)`` with ``ρ = exp(logp - old_logp)``, plus
    ``kl_coef * (exp(ref - logp) - (ref - logp) - 1)``.

    ``same_weights`` [B] marks the rows generated with the very weights that computed
    ``logprobs``: on those, ``|exp(logp) - exp(old_logp)|`` is the generator's mismatch with the
    trainer (veRL's ``rollout_probs_diff``), which a weight sync that did not arrive turns large.

    ``is_cap`` (truncated importance sampling, off when None): on the ``same_weights`` rows the
    trainer's own log-probs, not the generator's, are the old policy (ρ = 1, as in one update
    per batch), and each token's term is weighted by ``min(p_trainer / p_generator, is_cap)``,
    detached: the correction for a generator whose numerics differ from the trainer's (bf16
    vLLM against a float32 trainer) that does not let the clip zero those tokens' gradients.
    Rows generated with older weights keep the generator's log-probs as the old policy.
    """
    mask_f = mask.to(logprobs.dtype)
    adv = advantages.to(logprobs.dtype).unsqueeze(-1)
    behaviour, weight = old_logprobs, None
    if is_cap is not None and same_weights is not None:
        own = mask.bool() & same_weights.to(mask.device).bool().unsqueeze(-1)
        behaviour = torch.where(own, logprobs.detach(), old_logprobs)
        gap = torch.where(own, logprobs.detach() - old_logprobs, torch.zeros_like(logprobs))
        weight = gap.exp().clamp(max=is_cap)
    # Padding positions may hold anything (even -inf); zero them before exponentiating.
    log_ratio = torch.where(mask.bool(), logprobs - behaviour, torch.zeros_like(logprobs))
    ratio = log_ratio.exp()
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_epsilon, 1 + clip_epsilon) * adv
    policy_loss = -torch.minimum(unclipped, clipped)
    if weight is not None:
        policy_loss = policy_loss * weight
    loss = policy_loss
    kl_sum = 0.0
    if ref_logprobs is not None:
        delta = torch.where(mask.bool(), ref_logprobs - logprobs, torch.zeros_like(logprobs))
        kl = delta.exp() - delta - 1
        loss = loss + kl_coef * kl
        kl_sum = float((kl.detach() * mask_f).sum())
    was_clipped = (clipped < unclipped) & mask.bool()
    masked_ratio = ratio.detach()[mask.bool()]
    diffs = torch.zeros(0)
    if same_weights is not None:
        compared = mask.bool() & same_weights.to(mask.device).bool().unsqueeze(-1)
        diffs = (logprobs.detach().exp() - old_logprobs.exp()).abs()[compared]
    return LossTerms(
        loss_sum=(loss * mask_f).sum(),
        policy_sum=float((policy_loss.detach() * mask_f).sum()),
        kl_sum=kl_sum,
        clipped_tokens=int(was_clipped.sum()),
        tokens=int(mask.sum()),
        ratio_sum=float(masked_ratio.sum()) if masked_ratio.numel() else 0.0,
        ratio_max=float(masked_ratio.max()) if masked_ratio.numel() else 0.0,
        probs_diff_sum=float(diffs.sum()) if diffs.numel() else 0.0,
        probs_diff_max=float(diffs.max()) if diffs.numel() else 0.0,
        probs_diff_tokens=int(diffs.numel()),
    )


def completion_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probability of each target under ``log_softmax(logits / temperature)``.

    ``logits`` [B, T, V] predict ``targets`` [B, T] (already shifted by one). Computed in float32.
    """
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
