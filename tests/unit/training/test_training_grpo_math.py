"""GRPO's arithmetic on hand-built tensors: advantages, the clipped ratio, masking, KL."""

from __future__ import annotations

import math

import pytest
import torch

from spotrl_runtime.training.grpo import completion_logprobs, contributes, group_advantages, token_loss_terms


def test_advantages_are_reward_minus_mean_over_std() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std().item()  # Bessel: 0.5774
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-6)


def test_advantages_of_a_zero_variance_group_are_zero_and_it_does_not_contribute() -> None:
    assert group_advantages([0.7, 0.7, 0.7]).tolist() == [0.0, 0.0, 0.0]
    assert not contributes([0.7, 0.7, 0.7])
    assert contributes([0.7, 0.7, 0.6])


def test_advantages_need_two_rewards() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages([1.0])


def _terms(logp: list[list[float]], old: list[list[float]], adv: list[float], mask: list[list[int]], **kw):  # type: ignore[no-untyped-def]
    lp = torch.tensor(logp, requires_grad=True)
    terms = token_loss_terms(lp, torch.tensor(old), torch.tensor(adv), torch.tensor(mask), clip_epsilon=0.2, **kw)
    terms.loss_sum.backward()
    assert lp.grad is not None
    return terms, lp.grad


def test_ratio_one_gives_minus_advantage_per_token() -> None:
    terms, grad = _terms([[-1.0, -2.0]], [[-1.0, -2.0]], [0.5], [[1, 1]])
    assert terms.loss_sum.item() == pytest.approx(-1.0)  # two tokens of -A
    assert terms.tokens == 2
    assert terms.clipped_tokens == 0
    assert grad[0].tolist() == pytest.approx([-0.5, -0.5])  # d(-ρA)/dlogp = -ρA


def test_clip_stops_the_gradient_where_the_ratio_left_the_trust_region() -> None:
    up, down = math.log(1.5), math.log(0.5)
    # A > 0 and ρ = 1.5: clipped at 1.2, no gradient. A > 0 and ρ = 0.5: not clipped (min picks ρA).
    terms, grad = _terms([[up, down]], [[0.0, 0.0]], [1.0], [[1, 1]])
    assert terms.loss_sum.item() == pytest.approx(-1.2 - 0.5)
    assert grad[0, 0].item() == 0.0
    assert grad[0, 1].item() == pytest.approx(-0.5)
    assert terms.clipped_tokens == 1
    # A < 0 and ρ = 0.5: clipped at 0.8, no gradient. A < 0 and ρ = 1.5: not clipped.
    terms, grad = _terms([[down, up]], [[0.0, 0.0]], [-1.0], [[1, 1]])
    assert terms.loss_sum.item() == pytest.approx(0.8 + 1.5)
    assert grad[0, 0].item() == 0.0
    assert grad[0, 1].item() == pytest.approx(1.5)
    assert terms.clipped_tokens == 1
    assert terms.ratio_max == pytest.approx(1.5)


def test_masked_positions_contribute_nothing_even_if_they_hold_garbage() -> None:
    clean, _ = _terms([[-1.0, 0.0]], [[-1.2, 0.0]], [1.0], [[1, 0]])
    dirty, grad = _terms([[-1.0, 50.0]], [[-1.2, float("-inf")]], [1.0], [[1, 0]])
    assert dirty.loss_sum.item() == pytest.approx(clean.loss_sum.item())
    assert torch.isfinite(dirty.loss_sum)
    assert grad[0, 1].item() == 0.0
    assert dirty.tokens == 1


def test_k3_kl_to_the_reference() -> None:
    same, _ = _terms([[-1.0]], [[-1.0]], [0.0], [[1]], ref_logprobs=torch.tensor([[-1.0]]), kl_coef=1.0)
    assert same.kl_sum == pytest.approx(0.0)
    # delta = ref - logp = 0.5: exp(0.5) - 0.5 - 1
    terms, grad = _terms([[-1.5]], [[-1.5]], [0.0], [[1]], ref_logprobs=torch.tensor([[-1.0]]), kl_coef=2.0)
    assert terms.kl_sum == pytest.approx(math.exp(0.5) - 1.5)
    assert terms.loss_sum.item() == pytest.approx(2.0 * (math.exp(0.5) - 1.5))
    # d/dlogp of kl_coef * (e^(ref-logp) - (ref-logp) - 1) = kl_coef * (1 - e^(ref-logp)) < 0: pulls toward ref
    assert grad.item() == pytest.approx(2.0 * (1 - math.exp(0.5)))


def test_completion_logprobs_use_the_temperature() -> None:
    logits = torch.randn(2, 3, 7)
    targets = torch.randint(7, (2, 3))
    got = completion_logprobs(logits, targets, temperature=0.7)
    expected = torch.log_softmax(logits / 0.7, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(got, expected)


def test_truncated_importance_sampling_weights_own_rows_by_the_capped_probability_ratio() -> None:
    """Row 0 was generated with the trainer's weights by a generator that put p_gen = p_trainer / 1.5
    on its first token and p_trainer * 4 on its second; row 1 with older weights."""
    trainer_lp = [[math.log(0.3), math.log(0.2)], [math.log(0.3), math.log(0.2)]]
    generator_lp = [[math.log(0.2), math.log(0.8)], [math.log(0.2), math.log(0.8)]]
    same = torch.tensor([True, False])
    off, grad_off = _terms(trainer_lp, generator_lp, [1.0, 1.0], [[1, 1], [1, 1]], same_weights=same)
    on, grad = _terms(trainer_lp, generator_lp, [1.0, 1.0], [[1, 1], [1, 1]], same_weights=same, is_cap=1.2)
    # Own row: ρ = 1 (the trainer's log-probs are the old policy), each token weighted by
    # min(p_trainer / p_generator, 1.2): 1.5 capped to 1.2, and 0.25.
    assert grad[0].tolist() == pytest.approx([-1.2, -0.25])
    # Without the correction the clip had zeroed the first token's gradient (ρ = 1.5 > 1.2).
    assert grad_off[0].tolist() == pytest.approx([0.0, -0.25])
    # The row generated with older weights is trained as before.
    assert grad[1].tolist() == pytest.approx(grad_off[1].tolist())
    assert on.loss_sum.item() == pytest.approx(-(1.2 + 0.25) - (1.2 + 0.25))
    # The gap metric does not depend on the correction.
    assert on.probs_diff_max == pytest.approx(off.probs_diff_max) == pytest.approx(0.6)


def test_without_a_cap_the_loss_is_unchanged_by_same_weights() -> None:
    args = ([[-1.0, -2.0]], [[-1.3, -1.7]], [0.7], [[1, 1]])
    plain, grad_plain = _terms(*args)
    marked, grad_marked = _terms(*args, same_weights=torch.tensor([True]))
    assert marked.loss_sum.item() == plain.loss_sum.item()
    assert torch.equal(grad_marked, grad_plain)
