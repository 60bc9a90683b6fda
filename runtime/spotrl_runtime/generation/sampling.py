"""The sampling distribution: temperature, then top-p. Pure tensor functions, no I/O.

It is defined here once: the transformers backend samples from it, vLLM's sampler applies the
same mask (``logprobs_mode="processed_logprobs"`` returns log-probs under it), and the trainer
takes its log-probs under it too (:mod:`spotrl_runtime.training.logprobs`), so the importance
weight ``p_trainer / p_generator`` compares two probabilities of one distribution. With
``top_p < 1`` the full softmax would not be it: each token's log-prob would be low by the
log of its nucleus' mass, a bias of up to ``-log(top_p)`` in every weight.
"""

from __future__ import annotations

import torch


def sampling_logprobs(
    logits: torch.Tensor, temperature: float | torch.Tensor, top_p: float | torch.Tensor
) -> torch.Tensor:
    """Log-probabilities (fp32) of the distribution a sample is drawn from, one row per position.

    ``logits`` [R, V] (any float dtype) are divided by ``temperature``; then tokens outside the
    top-p nucleus (:func:`outside_nucleus`) get -inf and the rest are renormalised. With
    ``top_p == 1`` this is ``log_softmax(logits / temperature)``. ``temperature`` and ``top_p``
    are one number for every row or one per row ([R]). Differentiable in ``logits``; the nucleus
    itself, a set of tokens, carries no gradient.
    """
    scaled = logits.float() / _per_row(temperature)
    if _everywhere_one(top_p):
        return torch.log_softmax(scaled, dim=-1)
    # The nucleus from a log-softmax nothing keeps for the backward pass; then one log-softmax
    # over the nucleus alone (as vLLM's sampler: the masked logits' log-softmax).
    with torch.no_grad():
        outside = outside_nucleus(torch.log_softmax(scaled, dim=-1), top_p)
    return torch.log_softmax(scaled.masked_fill(outside, float("-inf")), dim=-1)


def outside_nucleus(logprobs: torch.Tensor, top_p: float | torch.Tensor) -> torch.Tensor:
    """bool [R, V]: the tokens outside each row's top-p nucleus, the smallest set of most likely
    tokens whose mass reaches ``top_p`` (the most likely token always stays). Tokens tied with
    the nucleus' least likely one stay too: a sort orders ties arbitrarily, and the trainer and
    the generator must draw the same line through them."""
    sorted_lp = logprobs.sort(dim=-1, descending=True).values
    sorted_p = sorted_lp.exp()
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    kept = (mass_before < _per_row(top_p)).sum(dim=-1, keepdim=True).clamp(min=1)
    return logprobs < sorted_lp.gather(-1, kept - 1)


def _per_row(value: float | torch.Tensor) -> float | torch.Tensor:
    """A number as it is, a per-row tensor [R] as a column [R, 1] that broadcasts over the vocabulary."""
    return value.unsqueeze(-1) if isinstance(value, torch.Tensor) else value


def _everywhere_one(top_p: float | torch.Tensor) -> bool:
    return bool((top_p >= 1).all()) if isinstance(top_p, torch.Tensor) else top_p >= 1
