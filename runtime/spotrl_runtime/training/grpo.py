"""GRPO's advantages: each rollout's reward against its group's. No I/O.

The per-token losses are in :mod:`spotrl_runtime.training.losses`.
"""

from __future__ import annotations

from collections.abc import Sequence

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
