"""The per-token losses on hand-built tensors: the proximal ratio and its clips, the importance
weight, the KL term and the gap metrics."""

from __future__ import annotations

import math

import pytest
import torch

from spotrl_runtime.training.losses import LossConfig, Tokens, k3_kl, token_loss_terms


def _terms(
    logp: list[float],
    adv: list[float],
    *,
    proximal: list[float] | None = None,
    behaviour: list[float] | None = None,
    fresh: list[bool] | None = None,
    reference: list[float] | None = None,
    **config: object,
):  # type: ignore[no-untyped-def]
    lp = torch.tensor(logp, requires_grad=True)
    tokens = Tokens(
        logprobs=lp,
        proximal=torch.tensor(proximal if proximal is not None else logp),
        behaviour=torch.tensor(behaviour if behaviour is not None else logp),
        advantages=torch.tensor(adv),
        fresh=torch.tensor(fresh if fresh is not None else [True] * len(logp)),
        reference=torch.tensor(reference) if reference is not None else None,
    )
    terms = token_loss_terms(tokens, LossConfig(**config))  # type: ignore[arg-type]
    terms.loss_sum.backward()
    assert lp.grad is not None
    return terms, lp.grad


def test_one_update_per_batch_is_minus_the_advantage_per_token() -> None:
    terms, grad = _terms([-1.0, -2.0], [0.5, 0.5])
    assert terms.loss_sum.item() == pytest.approx(-1.0)
    assert terms.tokens == 2
    assert terms.clipped_tokens == 0
    assert grad.tolist() == pytest.approx([-0.5, -0.5])


def test_the_clip_against_the_proximal_policy_stops_the_gradient_outside_the_trust_region() -> None:
    up, down = math.log(1.5), math.log(0.5)
    # A > 0, ρ = 1.5: clipped at 1.2 (no gradient); ρ = 0.5: the min keeps ρA.
    terms, grad = _terms([up, down], [1.0, 1.0], proximal=[0.0, 0.0], behaviour=[0.0, 0.0])
    assert terms.loss_sum.item() == pytest.approx(-1.2 - 0.5)
    assert grad.tolist() == pytest.approx([0.0, -0.5])
    assert terms.clipped_tokens == 1
    # A < 0, ρ = 0.5: clipped at 0.8; ρ = 1.5: not clipped.
    terms, grad = _terms([down, up], [-1.0, -1.0], proximal=[0.0, 0.0], behaviour=[0.0, 0.0])
    assert terms.loss_sum.item() == pytest.approx(0.8 + 1.5)
    assert grad.tolist() == pytest.approx([0.0, 1.5])
    assert terms.ratio_max == pytest.approx(1.5)


def test_clip_higher_lets_a_positive_advantage_ratio_rise_further() -> None:
    up = math.log(1.25)
    plain, grad_plain = _terms([up], [1.0], proximal=[0.0], behaviour=[0.0])
    higher, grad_higher = _terms([up], [1.0], proximal=[0.0], behaviour=[0.0], clip_epsilon_high=0.28)
    assert grad_plain.item() == 0.0
    assert plain.clipped_tokens == 1
    assert grad_higher.item() == pytest.approx(-1.25)
    assert higher.clipped_tokens == 0


def test_dual_clip_bounds_a_negative_advantage_token_with_a_large_ratio() -> None:
    big = math.log(5.0)
    bounded, grad = _terms([big], [-1.0], proximal=[0.0], behaviour=[0.0])
    assert bounded.loss_sum.item() == pytest.approx(3.0)  # min(ρ|A| = 5, 3|A|)
    assert grad.item() == 0.0
    unbounded, grad_off = _terms([big], [-1.0], proximal=[0.0], behaviour=[0.0], dual_clip=None)
    assert unbounded.loss_sum.item() == pytest.approx(5.0)
    assert grad_off.item() == pytest.approx(5.0)


def test_the_importance_weight_is_the_capped_probability_ratio_and_carries_no_gradient() -> None:
    """p_trainer / p_generator = 1.5 on the first token (capped at 1.2) and 0.25 on the second,
    whether the row is fresh or stale: the correction applies to both."""
    trainer = [math.log(0.3), math.log(0.2)]
    generator = [math.log(0.2), math.log(0.8)]
    for fresh in ([True, True], [False, False]):
        terms, grad = _terms(trainer, [1.0, 1.0], behaviour=generator, fresh=fresh, is_cap=1.2)
        assert grad.tolist() == pytest.approx([-1.2, -0.25])
        assert terms.is_weight_max == pytest.approx(1.2)
        assert terms.is_weight_sum == pytest.approx(1.45)
        assert terms.is_capped == 1
    # Without the weight the same tokens train as if the generator were the trainer.
    _, grad = _terms(trainer, [1.0, 1.0], behaviour=generator, is_cap=None)
    assert grad.tolist() == pytest.approx([-1.0, -1.0])


def test_the_gap_is_measured_on_fresh_and_stale_tokens_apart() -> None:
    terms, _ = _terms(
        [math.log(0.3), math.log(0.3)],
        [1.0, 1.0],
        behaviour=[math.log(0.2), math.log(0.9)],
        fresh=[True, False],
    )
    assert terms.probs_diff_tokens == 1
    assert terms.probs_diff_max == pytest.approx(0.1)
    assert terms.stale_diff_tokens == 1
    assert terms.stale_diff_max == pytest.approx(0.6)


def test_k3_kl_to_the_reference() -> None:
    assert k3_kl(torch.tensor([-1.0]), torch.tensor([-1.0])).item() == 0.0
    # delta = ref - logp = 0.5: exp(0.5) - 0.5 - 1; its gradient pulls toward the reference.
    terms, grad = _terms([-1.5], [0.0], reference=[-1.0], kl_coef=2.0)
    assert terms.kl_sum == pytest.approx(math.exp(0.5) - 1.5)
    assert terms.loss_sum.item() == pytest.approx(2.0 * (math.exp(0.5) - 1.5))
    assert grad.item() == pytest.approx(2.0 * (1 - math.exp(0.5)))
