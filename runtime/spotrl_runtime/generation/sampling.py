"""The sampling distribution: temperature, then top-p. Pure tensor functions, no I/O."""

from __future__ import annotations

import torch


def sampling_logprobs(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the distribution a sample is drawn from, one row per sequence.

    ``logits`` [R, V] are divided by ``temperature`` [R]; then tokens outside the top-p nucleus
    (the smallest set of most likely tokens whose mass reaches ``top_p`` [R]) get -inf and the
    rest are renormalised. With ``top_p == 1`` this is ``log_softmax(logits / temperature)``.
    """
    logprobs = torch.log_softmax(logits.float() / temperature.unsqueeze(-1), dim=-1)
    if bool((top_p >= 1).all()):
        return logprobs
    sorted_lp, order = logprobs.sort(dim=-1, descending=True)
    sorted_p = sorted_lp.exp()
    mass_before = sorted_p.cumsum(dim=-1) - sorted_p
    # Drop a token once the tokens above it already hold top_p; the first token always stays.
    drop_sorted = mass_before >= top_p.unsqueeze(-1)
    drop_sorted[:, 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return torch.log_softmax(logprobs.masked_fill(drop, float("-inf")), dim=-1)
