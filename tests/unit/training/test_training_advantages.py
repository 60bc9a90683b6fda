"""The advantage estimators and the loss aggregations' row scales, against hand computations."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from training_helpers import make_group

from spotrl_runtime.core.types import FinishedGroup
from spotrl_runtime.training.advantages import (
    Objective,
    contributes,
    group_advantages,
    overlong_penalty,
    row_scales,
    whiten,
)
from spotrl_runtime.training.rows import LossSums, Scored, score_rows, scored_by_group, step_metrics, step_rows

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
    drgrpo = Objective(aggregation="seq-mean-token-sum-norm", max_new_tokens=8)
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


def _rollouts_of_lengths(group: FinishedGroup, lengths: list[int], truncated: set[int] = frozenset()) -> FinishedGroup:
    """``group`` with completions of ``lengths`` tokens; those at ``truncated`` indexes cut off."""
    rollouts = tuple(
        dataclasses.replace(
            r,
            completion_token_ids=(5,) * n,
            logprobs=(-1.0,) * n,
            finish_reason="length" if i in truncated else "stop",
        )
        for i, (r, n) in enumerate(zip(group.rollouts, lengths, strict=True))
    )
    return dataclasses.replace(group, rollouts=rollouts)


def test_the_overlong_penalty_is_dapos_linear_ramp_over_the_buffer() -> None:
    dapo = Objective(max_new_tokens=16, soft_penalty=(4, 1.0))
    # 0 up to 16 - 4 = 12 tokens, then ((16 - 4) - L) / 4 down to -1 at 16
    assert [overlong_penalty(n, dapo) for n in (1, 12, 13, 14, 16)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(14, Objective(max_new_tokens=16, soft_penalty=(4, 0.5))) == -0.25
    assert overlong_penalty(16, Objective(max_new_tokens=16)) == 0.0


def test_the_soft_penalty_shapes_the_rewards_before_the_advantages() -> None:
    """A group of equal rewards has nothing to prefer, until the penalty tells its lengths apart."""
    group = _rollouts_of_lengths(make_group("g", [1.0, 1.0, 1.0, 1.0]), [2, 6, 7, 8])
    objective = Objective(max_new_tokens=8, soft_penalty=(4, 1.0))
    assert step_rows([group]).skipped == 1
    plan = step_rows([group], objective)
    shaped = [1.0, 1.0 - 0.5, 1.0 - 0.75, 1.0 - 1.0]  # starts after 8 - 4 = 4 tokens
    assert [r.advantage for r in plan.rows] == pytest.approx(group_advantages(shaped).tolist(), rel=1e-6)
    assert plan.rewards == (1.0, 1.0, 1.0, 1.0)  # reward_mean reports the rewards as scored
    assert plan.overlong == {"overlong_filtered": 0.0, "overlong_penalty_mean": pytest.approx(-2.25 / 4)}


def test_the_overlong_filter_leaves_cut_off_completions_out_of_the_loss_but_not_out_of_the_advantages() -> None:
    group = _rollouts_of_lengths(make_group("g", [1.0, 0.0, 0.0, 1.0]), [3, 8, 8, 2], truncated={1, 2})
    plan = step_rows([group], Objective(max_new_tokens=8, overlong_filter=True))
    everyone = group_advantages([1.0, 0.0, 0.0, 1.0]).tolist()
    assert [len(r.completion_ids) for r in plan.rows] == [3, 2]
    assert [r.advantage for r in plan.rows] == pytest.approx([everyone[0], everyone[3]], rel=1e-6)
    assert plan.tokens == 5
    assert plan.overlong == {"overlong_filtered": 2.0, "overlong_penalty_mean": 0.0}
    assert [len(r.completion_ids) for r in step_rows([group]).rows] == [3, 8, 8, 2]
    assert step_rows([group]).overlong is None


def test_an_overlong_buffer_not_below_the_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="overlong buffer"):
        Objective(max_new_tokens=8, soft_penalty=(8, 1.0))


def test_the_kl_in_the_reward_is_taken_from_each_reward_before_the_advantages() -> None:
    """A group of equal rewards has nothing to prefer, until the KL penalty tells its rollouts apart;
    the scoring pass's log-probs become the rows' proximal ones."""
    group = _rollouts_of_lengths(make_group("g", [1.0, 1.0, 1.0, 1.0]), [2, 3, 1, 2])
    scored = [
        [
            Scored(kl, tuple(-0.5 * (k + 1) for _ in range(n)))
            for k, (kl, n) in enumerate(zip([0.0, 2.0, 4.0, 1.0], [2, 3, 1, 2], strict=True))
        ]
    ]
    objective = Objective(reward_kl=0.5)
    with pytest.raises(ValueError, match="inReward"):
        step_rows([group], objective)
    assert step_rows([group], Objective(), scored).skipped == 1, "without reward_kl the scores change nothing"
    plan = step_rows([group], objective, scored)
    shaped = [1.0, 1.0 - 1.0, 1.0 - 2.0, 1.0 - 0.5]
    assert [r.advantage for r in plan.rows] == pytest.approx(group_advantages(shaped).tolist(), rel=1e-6)
    assert [r.proximal for r in plan.rows] == [s.logprobs for s in scored[0]]
    assert plan.rewards == (1.0, 1.0, 1.0, 1.0)  # reward_mean reports the rewards as scored
    assert plan.reward_kl == {"kl": pytest.approx(7.0 / 8), "reward_kl_penalty_mean": pytest.approx(0.5 * 7.0 / 4)}
    assert step_metrics(plan, LossSums(kl=123.0))["kl"] == pytest.approx(7.0 / 8), "the scoring pass's KL"


def test_scores_come_back_to_their_rollouts_and_an_empty_completion_scores_nothing() -> None:
    group = _rollouts_of_lengths(make_group("g", [1.0, 0.0, 1.0]), [2, 0, 1])
    rows = score_rows([group, group])
    assert [len(g) for g in rows] == [2, 2]
    values = [Scored(float(i), (float(i),) * len(r.completion_ids)) for i, r in enumerate(rows[0] + rows[1])]
    back = scored_by_group([group, group], values)
    assert [[s.kl for s in g] for g in back] == [[0.0, 0.0, 1.0], [2.0, 0.0, 3.0]]
    assert back[0][1].logprobs == ()
    with pytest.raises(ValueError, match="more scores"):
        scored_by_group([group], values)
