"""The trainer's gradient under each advantage estimator and loss aggregation equals the gradient
of the same objective written out by hand, row by row (fp32 tightly, bf16 within its rounding)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from training_helpers import make_group, small_llama

from spotrl_runtime.core.types import FinishedGroup
from spotrl_runtime.training import Trainer, TrainerConfig, precision
from spotrl_runtime.training import logprobs as lp
from spotrl_runtime.training.advantages import Objective, contributes, group_advantages, whiten

TEMPERATURE = 0.8
MAX_NEW_TOKENS = 8


def _behaviour(j: int) -> float:
    """Below the trainer's log-probs and varying, so the importance weight varies too."""
    return -2.0 - 0.1 * j


def _groups() -> list[FinishedGroup]:
    """Four groups, one without variance; the completions of 5 tokens (the longest) were cut off."""
    behaviour = _behaviour
    groups = [
        make_group("a", [1.0, 0.0, 0.0, 1.0], logprob=behaviour),
        make_group("b", [0.0, 0.0, 1.0, 0.0], seed=1, logprob=behaviour),
        make_group("flat", [1.0, 1.0, 1.0, 1.0], seed=2),
        make_group("d", [0.5, 0.25, 0.0, 1.0], seed=3, logprob=behaviour),
    ]
    cut = {r.group_id + str(r.index) for g in groups for r in g.rollouts if len(r.completion_token_ids) == 5}
    assert cut, "some completion is cut off"
    return [
        dataclasses.replace(
            g,
            rollouts=tuple(
                dataclasses.replace(r, finish_reason="length" if r.group_id + str(r.index) in cut else "stop")
                for r in g.rollouts
            ),
        )
        for g in groups
    ]


def _hand_loss(model: torch.nn.Module, groups: list[FinishedGroup], objective: Objective, dtype: str) -> torch.Tensor:
    """The step's objective as veRL's ``agg_loss`` writes it, one rollout at a time: the policy term
    ``-A * w * ratio`` (ratio 1 at the step's start, w the capped importance weight), aggregated."""
    rows = []
    for g in groups:
        rewards = [r.reward for r in g.rollouts]
        if objective.soft_penalty is not None:  # DAPO: ((L_max - L_cache) - L) / L_cache past L_max - L_cache
            buffer, factor = objective.soft_penalty
            start = objective.max_new_tokens - buffer
            rewards = [r.reward + factor * min(0, start - len(r.completion_token_ids)) / buffer for r in g.rollouts]
        if contributes(rewards):
            rows += list(zip(g.rollouts, group_advantages(rewards, objective).tolist(), strict=True))
    if objective.overlong_filter:
        rows = [(r, a) for r, a in rows if r.finish_reason != "length"]
    if objective.estimator == "reinforce++-baseline":
        whitened = whiten([a for _, a in rows], [len(r.completion_token_ids) for r, _ in rows])
        rows = [(r, a) for (r, _), a in zip(rows, whitened, strict=True)]
    n = sum(len(g.rollouts) for g in groups)
    total = sum(len(r.completion_token_ids) for r, _ in rows)
    loss = torch.zeros(())
    for rollout, advantage in rows:
        batch = lp.token_batch([(rollout.prompt_token_ids, rollout.completion_token_ids)], 0, "cpu")
        with precision.autocast("cpu", precision.compute_dtype(dtype)):
            logp, _ = lp.call(model, batch, TEMPERATURE)
        weight = (logp.detach() - torch.tensor(rollout.logprobs)).exp().clamp(max=2.0)
        per_token = -advantage * weight * (logp - logp.detach()).exp()
        if objective.aggregation == "token-mean":
            loss = loss + per_token.sum() / total
        elif objective.aggregation == "seq-mean-token-mean":
            loss = loss + per_token.mean() / n
        else:
            loss = loss + per_token.sum() / (objective.max_new_tokens * n)
    return loss


CASES = {
    "grpo": Objective(max_new_tokens=MAX_NEW_TOKENS),
    "dr-grpo": Objective("grpo", False, "seq-mean-token-sum-norm", MAX_NEW_TOKENS),
    "grpo-seq-mean": Objective("grpo", True, "seq-mean-token-mean", MAX_NEW_TOKENS),
    "rloo": Objective("rloo", max_new_tokens=MAX_NEW_TOKENS),
    "reinforce++-baseline": Objective("reinforce++-baseline", max_new_tokens=MAX_NEW_TOKENS),
    "rloo-seq-mean": Objective("rloo", aggregation="seq-mean-token-mean", max_new_tokens=MAX_NEW_TOKENS),
    # the completions here have 1 to 5 tokens: with a limit of 5, those of 4 and 5 are penalised
    "dapo-overlong": Objective(max_new_tokens=5, overlong_filter=True, soft_penalty=(2, 1.0)),
    "overlong-filter-seq-mean": Objective(aggregation="seq-mean-token-mean", max_new_tokens=5, overlong_filter=True),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES)
def test_the_trainers_gradient_is_the_objective_written_out_by_hand(case: str, dtype: str) -> None:
    objective = CASES[case]
    config = TrainerConfig(micro_batch_size=3, temperature=TEMPERATURE, compute_dtype=dtype, objective=objective)
    trainer = Trainer(small_llama(), config)
    metrics = trainer.compute_gradients(_groups())
    got = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    hand = small_llama()
    loss = _hand_loss(hand, _groups(), objective, dtype)
    loss.backward()
    want = {n: p.grad for n, p in hand.named_parameters() if p.grad is not None}

    assert got
    assert got.keys() == want.keys()
    # fp32: the rows' passes differ only by padding; bf16: by its rounding of each pass
    rtol = 1e-5 if dtype == "float32" else 1e-2
    flat_got = torch.cat([g.flatten() for g in got.values()])
    flat_want = torch.cat([g.flatten() for g in want.values()])
    assert torch.linalg.vector_norm(flat_got - flat_want) <= rtol * torch.linalg.vector_norm(flat_want)
    assert metrics["loss"] == pytest.approx(float(loss.detach()), rel=rtol, abs=1e-7)


def test_each_aggregation_gives_a_different_gradient() -> None:
    """The three are not one in disguise on this step (its rows have different lengths)."""
    grads = []
    for aggregation in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        trainer = Trainer(
            small_llama(),
            TrainerConfig(temperature=TEMPERATURE, objective=Objective(aggregation=aggregation, max_new_tokens=8)),
        )
        trainer.compute_gradients(_groups())
        grads.append(torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None]))
    for i in range(3):
        for j in range(i + 1, 3):
            assert not torch.allclose(grads[i], grads[j], rtol=1e-2, atol=0), (i, j)
