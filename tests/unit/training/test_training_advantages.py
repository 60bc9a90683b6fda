"""The advantage estimators and the loss aggregations' row scales, against hand computations."""

from __future__ import annotations

import math

import pytest
import torch
from training_helpers import make_group

from spotrl_runtime.training.advantages import Objective, contributes, group_advantages, row_scales, whiten
from spotrl_runtime.training.rows import step_rows

REWARDS = [1.0, 0.0, 0.0, 1.0]


def test_grpo_advantages_are_reward_minus_mean_over_std() -> None:
    adv = group_advantages(REWARDS)
    std = math.sqrt(((0.5**2) * 4) / 3)  # Bessel: 0.5774
    expected = [0.5 / (std + 1e-6), -0.5 / (std + 1e-6), -0.5 / (std + 1e-6), 0.5 / (std + 1e-6)]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert adv.sum().item() == pytest.approx(0.0, abs=1e-6)


def test_grpo_without_std_normalisation_is_reward_minus_mean() -> None:
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], Objective(normalize_by_std=False))
    assert adv.tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25], abs=1e-7)


def test_rloo_is_reward_minus_the_mean_of_the_other_rewards() -> None:
    rewards = [1.0, 0.0, 0.5, 0.0]
    adv = group_advantages(rewards, Objective(estimator="rloo"))
    expected = [r - (sum(rewards) - r) / 3 for r in rewards]  # [0.8333, -0.5, 0.1667, -0.5]
    assert adv.tolist() == pytest.approx(expected, abs=1e-7)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce++-baseline"])
def test_a_zero_variance_group_has_zero_advantages_under_every_estimator(estimator: str) -> None:
    assert group_advantages([0.7, 0.7, 0.7], Objective(estimator=estimator)).tolist() == [0.0, 0.0, 0.0]
    assert not contributes([0.7, 0.7, 0.7])
    assert contributes([0.7, 0.7, 0.6])


def test_advantages_need_two_rewards() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages([1.0])


def test_whitening_weighs_each_advantage_by_its_tokens() -> None:
    advantages, tokens = [1.0, -1.0, 0.5], [1, 3, 2]
    per_token = [1.0, -1.0, -1.0, -1.0, 0.5, 0.5]
    mean = sum(per_token) / 6
    var = sum((x - mean) ** 2 for x in per_token) / 5
    expected = [(a - mean) / math.sqrt(var + 1e-8) for a in advantages]
    assert whiten(advantages, tokens) == pytest.approx(expected, rel=1e-6)
    whitened = torch.tensor(whiten(advantages, tokens), dtype=torch.float64).repeat_interleave(torch.tensor(tokens))
    assert whitened.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert whitened.std().item() == pytest.approx(1.0, abs=1e-6)


def test_reinforce_plus_plus_baseline_whitens_the_group_centred_rewards_over_the_whole_step() -> None:
    groups = [make_group("a", [1.0, 0.0, 0.0, 1.0]), make_group("b", [0.0, 0.0, 1.0, 0.0], seed=3)]
    plan = step_rows(groups, Objective(estimator="reinforce++-baseline"))
    centred = [r - sum(g) / 4 for g in ([1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0]) for r in g]
    tokens = [len(r.completion_token_ids) for g in groups for r in g.rollouts]
    assert [r.advantage for r in plan.rows] == pytest.approx(whiten(centred, tokens), rel=1e-6)
    grpo = step_rows(groups)
    assert [r.advantage for r in plan.rows] != pytest.approx([r.advantage for r in grpo.rows], rel=1e-3)


def test_row_scales_of_each_aggregation() -> None:
    lengths, rollouts = [2, 3], 4  # T = 5 trained tokens; 4 rollouts in the step, 2 of them untrained
    assert row_scales(lengths, rollouts, Objective()) == [1.0, 1.0]
    # each rollout's token mean, averaged over the 4 rollouts: a token of row i weighs 1 / (4 L_i),
    # which is 5 / (4 L_i) tokens of token-mean's 1/5
    assert row_scales(lengths, rollouts, Objective(aggregation="seq-mean-token-mean")) == pytest.approx([5 / 8, 5 / 12])
    # Dr. GRPO: each rollout's token sum over the constant 8, averaged over the 4 rollouts
    drgrpo = Objective(aggregation="seq-mean-token-sum-norm", length_normalizer=8)
    assert row_scales(lengths, rollouts, drgrpo) == pytest.approx([5 / 32, 5 / 32])


def test_step_rows_count_every_rollout_of_the_step_in_a_sequence_mean() -> None:
    """The rollouts of a group with equal rewards are not trained, but they are in N, so a step's
    sequence mean does not grow as more of its groups saturate."""
    groups = [make_group("a", [1.0, 0.0, 0.0, 1.0]), make_group("flat", [1.0, 1.0])]
    plan = step_rows(groups, Objective(aggregation="seq-mean-token-mean"))
    total = plan.tokens
    assert [r.scale for r in plan.rows] == pytest.approx([total / (6 * len(r.completion_ids)) for r in plan.rows])


def test_an_unknown_estimator_or_aggregation_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="advantage estimator"):
        Objective(estimator="ppo")
    with pytest.raises(ValueError, match="loss aggregation"):
        Objective(aggregation="seq-sum")
