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


# The trainer takes its log-probs under this same function (training/logprobs.py), one number
# for every position, from logits in the compute dtype: fp32, or bf16 under autocast.
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_top_p_one_is_the_log_softmax_of_the_fp32_logits_in_any_dtype(dtype: torch.dtype) -> None:
    logits = (3 * torch.randn(6, 500, generator=torch.Generator().manual_seed(0))).to(dtype)
    got = sampling_logprobs(logits, 0.7, 1.0)
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.log_softmax(logits.float() / 0.7, -1))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99])
def test_the_nucleus_is_the_smallest_set_reaching_top_p_and_sums_to_one(dtype: torch.dtype, top_p: float) -> None:
    logits = (2 * torch.randn(8, 1000, generator=torch.Generator().manual_seed(1))).to(dtype)
    full = torch.softmax(logits.float() / 0.9, -1)
    got = sampling_logprobs(logits, 0.9, top_p)
    kept = torch.isfinite(got)
    assert torch.allclose(got.exp().sum(-1), torch.ones(8), atol=1e-5)
    for row in range(8):
        inside = full[row][kept[row]]
        assert float(inside.sum()) >= top_p - 1e-5  # reaches top_p
        # smallest: without the least likely kept value (and its ties) it would not
        assert float(inside[inside > inside.min()].sum()) < top_p
        assert float(full[row][~kept[row]].max()) < float(inside.min())  # the most likely ones
        # inside, the renormalised distribution keeps the full one's ratios
        assert torch.allclose(got[row][kept[row]], (inside / inside.sum()).log(), atol=1e-5)


def test_a_token_outside_the_nucleus_gets_minus_infinity_and_no_gradient() -> None:
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0]], requires_grad=True)
    got = sampling_logprobs(logits, 1.0, 0.9)
    assert torch.isfinite(got[0, :2]).all()
    assert got[0, 2:].tolist() == [float("-inf")] * 2
    got[0, 0].backward()
    grad = logits.grad
    assert grad is not None
    assert torch.isfinite(grad).all()
    assert grad[0, 2:].tolist() == [0.0, 0.0], "the tokens outside take no part"
    assert float(grad[0, 1]) != 0.0, "the renormalisation over the nucleus is differentiable"


def test_tokens_tied_at_the_nucleus_edge_stay_together() -> None:
    """bf16 logits tie often; a sort orders ties arbitrarily, the nucleus does not split them."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 1.0, -3.0]])
    got = sampling_logprobs(logits, 1.0, 0.7)  # the top token holds 0.57: one of the 1.0s is needed
    assert torch.isfinite(got[0, :4]).all()
    assert math.isinf(got[0, 4].item())


def test_one_number_or_one_per_row_is_the_same() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2))
    assert torch.equal(
        sampling_logprobs(logits, 0.8, 0.9), sampling_logprobs(logits, torch.full((4,), 0.8), torch.full((4,), 0.9))
    )
