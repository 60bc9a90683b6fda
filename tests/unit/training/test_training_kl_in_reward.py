"""``training.kl.inReward``: the step's rollouts scored by the policy and the reference before
the first update, each reward less ``klCoef`` times its rollout's KL, and no KL term in the loss."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from training_helpers import make_group, small_llama

from spotrl_runtime.core.types import FinishedGroup
from spotrl_runtime.training import Trainer, TrainerConfig
from spotrl_runtime.training import logprobs as lp
from spotrl_runtime.training.advantages import Objective
from spotrl_runtime.training.losses import kl_estimate
from spotrl_runtime.training.rows import score_rows
from spotrl_runtime.training.trainer import StepInterruptedError

COEF = 0.5


def _groups() -> list[FinishedGroup]:
    return [
        make_group("a", [1.0, 0.0, 0.0, 1.0]),
        make_group("b", [1.0, 1.0, 1.0, 1.0], seed=1),  # equal rewards: only the KL tells them apart
        make_group("c", [0.5, 0.25, 0.0, 1.0], seed=2),
    ]


def _config(dtype: str = "float32", **kw: object) -> TrainerConfig:
    fields = {"learning_rate": 1e-2, "max_grad_norm": 1e6, "compute_dtype": dtype, "kl_estimator": "k1", **kw}
    return TrainerConfig(**fields)  # type: ignore[arg-type]


def _moved(trainer: Trainer, seed: int = 5) -> Trainer:
    """``trainer`` with its policy moved away from its reference (a copy taken when it was built)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=generator))
    return trainer


def _in_reward(dtype: str = "float32", **kw: object) -> Trainer:
    config = _config(dtype, kl_coef=COEF, objective=Objective(reward_kl=COEF), **kw)
    return _moved(Trainer(small_llama(), config))


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_each_rollout_scores_the_estimator_summed_over_its_completion(estimator: str) -> None:
    trainer = _in_reward(kl_estimator=estimator)
    rows = [r for g in score_rows(_groups()) for r in g]
    scores = trainer.score(rows)
    assert trainer.reference is not None
    for row, score in zip(rows, scores, strict=True):
        batch = lp.token_batch([(row.prompt_ids, row.completion_ids)], 0, "cpu")
        with torch.no_grad():
            mine, _ = lp.call(trainer.model, batch, 1.0)
            theirs, _ = lp.call(trainer.reference, batch, 1.0)
        assert score.logprobs == pytest.approx(mine.tolist(), abs=1e-5)
        assert score.kl == pytest.approx(float(kl_estimate(mine, theirs, estimator).sum()), abs=1e-5)
    assert max(abs(s.kl) for s in scores) > 0.05, "the policy was moved: its KL is not 0"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_step_is_a_kl_free_step_on_the_rewards_less_the_penalty(dtype: str) -> None:
    """The same step as a trainer without any KL takes on rewards shaped by hand: same weights."""
    shaped = _in_reward(dtype)
    scored = shaped.score_groups(_groups())
    metrics = shaped.train_step(_groups())
    assert shaped.config.loss.kl_coef == 0.0, "no KL term in the loss"

    by_hand = []
    for group, scores in zip(_groups(), scored, strict=True):
        rollouts = [
            dataclasses.replace(r, reward=r.reward - COEF * s.kl) for r, s in zip(group.rollouts, scores, strict=True)
        ]
        by_hand.append(dataclasses.replace(group, rollouts=tuple(rollouts)))
    plain = _moved(Trainer(small_llama(), _config(dtype)))
    assert plain.reference is None
    plain_metrics = plain.train_step(by_hand)

    assert metrics["groups_zero_variance"] == 0 < plain_metrics["tokens"]
    tokens = sum(len(s.logprobs) for g in scored for s in g)
    assert metrics["kl"] == pytest.approx(sum(s.kl for g in scored for s in g) / tokens, rel=1e-5)
    assert metrics["reward_kl_penalty_mean"] == pytest.approx(COEF * tokens * metrics["kl"] / 12, rel=1e-5)
    tolerance = {"rtol": 1e-4, "atol": 1e-6} if dtype == "float32" else {"rtol": 2e-2, "atol": 2e-3}
    moved = 0.0
    initial = _moved(Trainer(small_llama(), _config(dtype))).model.state_dict()
    for (name, got), want in zip(shaped.model.named_parameters(), plain.model.parameters(), strict=True):
        torch.testing.assert_close(got, want, **tolerance, msg=name)
        moved = max(moved, float((got.detach() - initial[name]).abs().max()))
    assert moved > 1e-3, "the step moved the weights (else the comparison proves nothing)"


def test_with_mini_batches_the_scoring_pass_is_the_proximal_one() -> None:
    trainer = _in_reward(mini_batches=2)

    def no_second_pass(*args: object, **kwargs: object) -> None:
        raise AssertionError("the proximal log-probs were taken again")

    trainer.proximal = no_second_pass  # type: ignore[method-assign]
    metrics = trainer.train_step(_groups())
    assert trainer.step == 1
    assert metrics["ratio_max"] > 1.0, "the second update's ratio is against the scoring pass"


def test_a_barrier_during_the_scoring_pass_changes_nothing() -> None:
    trainer = _in_reward()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(StepInterruptedError):
        trainer.train_step(_groups(), interrupted=lambda: True)
    assert trainer.step == 0
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p, before[name]), name
