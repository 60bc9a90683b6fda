"""The per-token losses on hand-built tensors: the proximal ratio and its clips, the importance
weight, the KL term and the gap metrics."""

from __future__ import annotations

import math

import pytest
import torch

from spotrl_runtime.training.losses import LossConfig, Tokens, k3_kl, kl_estimate, token_loss_terms


def _terms(
    logp: list[float],
    adv: list[float],
    *,
    proximal: list[float] | None = None,
    behaviour: list[float] | None = None,
    fresh: list[bool] | None = None,
    reference: list[float] | None = None,
    rows: list[int] | None = None,
    dtype: torch.dtype = torch.float32,
    **config: object,
):  # type: ignore[no-untyped-def]
    lp = torch.tensor(logp, dtype=dtype, requires_grad=True)
    tokens = Tokens(
        logprobs=lp,
        proximal=torch.tensor(proximal if proximal is not None else logp),
        behaviour=torch.tensor(behaviour if behaviour is not None else logp),
        advantages=torch.tensor(adv),
        fresh=torch.tensor(fresh if fresh is not None else [True] * len(logp)),
        reference=torch.tensor(reference) if reference is not None else None,
        rows=torch.tensor(rows) if rows is not None else None,
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


# ------------------------------------------------------------------ rollout correction

# Two rollouts: tokens 0-1 are row 0 (ratios 1.5 and 1.2: product 1.8), token 2 is row 1 (0.5).
TRAINER = [math.log(0.3), math.log(0.6), math.log(0.1)]
GENERATOR = [math.log(0.2), math.log(0.5), math.log(0.2)]
ROWS = [0, 0, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sequence_level_weight_is_the_rollouts_ratio_on_each_of_its_tokens(dtype: torch.dtype) -> None:
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    terms, grad = _terms(
        TRAINER, [1.0] * 3, behaviour=GENERATOR, rows=ROWS, dtype=dtype, is_cap=2.0, is_level="sequence"
    )
    assert grad.float().tolist() == pytest.approx([-1.8, -1.8, -0.5], rel=tol)
    assert terms.is_capped == 0
    capped, grad = _terms(TRAINER, [1.0] * 3, behaviour=GENERATOR, rows=ROWS, is_cap=1.6, is_level="sequence")
    assert grad.tolist() == pytest.approx([-1.6, -1.6, -0.5])
    assert capped.is_capped == 2, "both tokens of the capped rollout"
    # Per token, the same tokens weigh their own ratios.
    _, grad = _terms(TRAINER, [1.0] * 3, behaviour=GENERATOR, rows=ROWS, is_cap=2.0)
    assert grad.tolist() == pytest.approx([-1.5, -1.2, -0.5])


def test_masking_leaves_a_token_above_the_cap_out_of_the_loss_where_truncation_weighs_it_the_cap() -> None:
    truncated, grad_t = _terms(TRAINER, [1.0] * 3, behaviour=GENERATOR, is_cap=1.4)
    masked, grad_m = _terms(TRAINER, [1.0] * 3, behaviour=GENERATOR, is_cap=1.4, is_mode="mask")
    assert grad_t.tolist() == pytest.approx([-1.4, -1.2, -0.5])
    assert grad_m.tolist() == pytest.approx([0.0, -1.2, -0.5])
    assert truncated.is_capped == masked.is_capped == 1
    assert masked.is_weight_sum == pytest.approx(1.7)
    # Per sequence: the whole first rollout (1.8 > 1.6) is masked, the second kept.
    _, grad = _terms(
        TRAINER, [1.0] * 3, behaviour=GENERATOR, rows=ROWS, is_cap=1.6, is_level="sequence", is_mode="mask"
    )
    assert grad.tolist() == pytest.approx([0.0, 0.0, -0.5])


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_a_sequence_ratio_that_overflows_weighs_the_cap_or_nothing_and_never_a_nan(mode: str) -> None:
    n = 200  # 200 tokens each 2x likelier under the trainer: 2^200 overflows float32
    terms, grad = _terms(
        [math.log(0.5)] * n,
        [1.0] * n,
        behaviour=[math.log(0.25)] * n,
        rows=[0] * n,
        is_cap=2.0,
        is_level="sequence",
        is_mode=mode,
    )
    assert torch.isfinite(terms.loss_sum)
    assert torch.isfinite(grad).all()
    assert grad.tolist() == pytest.approx([-2.0 if mode == "truncate" else 0.0] * n)


def test_each_kl_estimator_against_its_formula_and_k3_is_clamped() -> None:
    logp, ref = torch.tensor([-1.5, -0.2]), torch.tensor([-1.0, -0.9])
    d = logp - ref
    assert kl_estimate(logp, ref, "k1").tolist() == pytest.approx(d.tolist())
    assert kl_estimate(logp, ref, "k2").tolist() == pytest.approx((0.5 * d * d).tolist())
    assert kl_estimate(logp, ref, "k3").tolist() == pytest.approx(((-d).exp() + d - 1).tolist())
    # A token the policy has all but left (p = e^-60 where the reference gave e^-1): k3 would be
    # e^59; clamped as veRL's low_var_kl, it is 10 and carries no gradient.
    far, grad = _terms([-60.0], [0.0], reference=[-1.0], kl_coef=1.0)
    assert far.kl_sum == pytest.approx(10.0)
    assert grad.item() == 0.0
    k1, grad = _terms([-1.5], [0.0], reference=[-1.0], kl_coef=2.0, kl_estimator="k1")
    assert k1.kl_sum == pytest.approx(-0.5)
    assert grad.item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_estimate(logp, ref, "k4")
