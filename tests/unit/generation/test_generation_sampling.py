"""The sampling distribution: temperature, then the top-p nucleus."""

from __future__ import annotations

import math

import pytest
import torch

from spotrl_runtime.generation import sampling_logprobs


def test_top_p_one_is_the_tempered_softmax() -> None:
    logits = torch.randn(3, 11)
    temperature = torch.tensor([0.5, 1.0, 2.0])
    got = sampling_logprobs(logits, temperature, torch.ones(3))
    assert torch.allclose(got, torch.log_softmax(logits / temperature[:, None], -1))


def test_top_p_keeps_the_smallest_nucleus_and_renormalises() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3)
    got = sampling_logprobs(probs.log(), torch.ones(3), torch.tensor([0.7, 0.45, 0.96])).exp()
    assert got[0].tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])  # 0.5 + 0.3 reach 0.7
    assert got[1].tolist() == pytest.approx([1.0, 0.0, 0.0, 0.0])  # 0.5 alone reaches 0.45
    assert got[2].tolist() == pytest.approx([0.5, 0.3, 0.15, 0.05])  # needs all four


def test_top_p_keeps_at_least_the_most_likely_token() -> None:
    got = sampling_logprobs(torch.tensor([[0.0, 3.0, 1.0]]), torch.ones(1), torch.tensor([1e-6]))
    assert got[0, 1].item() == 0.0
    assert math.isinf(got[0, 0].item())
    assert math.isinf(got[0, 2].item())


def test_nucleus_is_taken_after_the_temperature() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    # At T=0.25 the top token alone holds > 0.95 of the mass; at T=4 it does not.
    cold = sampling_logprobs(logits, torch.tensor([0.25]), torch.tensor([0.95])).exp()
    hot = sampling_logprobs(logits, torch.tensor([4.0]), torch.tensor([0.95])).exp()
    assert cold[0].tolist() == pytest.approx([1.0, 0.0, 0.0])
    assert (hot[0] > 0).all()
