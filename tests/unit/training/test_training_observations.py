"""An episode's observations (tool output, an environment's reply) are context, never trained:
their tokens carry no loss, no log-probs of the policy and no weight in the step's token count."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from training_helpers import VOCAB, make_group, small_llama

from spotrl_runtime.core.types import FinishedGroup, Rollout
from spotrl_runtime.training import Trainer, TrainerConfig
from spotrl_runtime.training import logprobs as lp
from spotrl_runtime.training.rows import rollout_row, step_rows


def _observation(group_id: str, index: int) -> tuple[int, ...]:
    rng = random.Random(f"obs:{group_id}:{index}")
    return tuple(rng.randint(4, VOCAB - 1) for _ in range(rng.randint(2, 4)))


def _as_episodes(groups: list[FinishedGroup]) -> tuple[list[FinishedGroup], list[FinishedGroup]]:
    """Each rollout with an observation before its completion: once as the completion's first
    span (an episode's observation), once moved into its prompt. The two train alike."""
    episodes, moved = [], []
    for group in groups:
        with_span, in_prompt = [], []
        for r in group.rollouts:
            obs = _observation(group.group_id, r.index)
            with_span.append(
                dataclasses.replace(
                    r,
                    completion_token_ids=obs + r.completion_token_ids,
                    logprobs=(0.0,) * len(obs) + r.logprobs,
                    observed=((0, len(obs)),),
                )
            )
            in_prompt.append(dataclasses.replace(r, prompt_token_ids=r.prompt_token_ids + obs))
        episodes.append(dataclasses.replace(group, rollouts=tuple(with_span)))
        moved.append(dataclasses.replace(group, rollouts=tuple(in_prompt)))
    return episodes, moved


def _groups() -> list[FinishedGroup]:
    return [make_group("a", [1.0, 0.0, 0.5, 1.0]), make_group("b", [0.0, 1.0, 1.0, 0.25], seed=1)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_observation_trains_as_the_prompt_it_extends(dtype: str) -> None:
    """A step on rollouts whose completions open with an observation takes the weights where
    the same step with the observation moved into the prompt does: its tokens carry no loss."""
    episodes, moved = _as_episodes(_groups())
    config = TrainerConfig(learning_rate=1e-2, max_grad_norm=1e6, compute_dtype=dtype, mini_batches=2)
    with_spans, in_prompts = Trainer(small_llama(), config), Trainer(small_llama(), config)
    metrics = with_spans.train_step(episodes)
    plain = in_prompts.train_step(moved)
    assert metrics["tokens"] == plain["tokens"] == sum(len(r.logprobs) for g in _groups() for r in g.rollouts)
    tolerance = {"rtol": 1e-4, "atol": 1e-6} if dtype == "float32" else {"rtol": 2e-2, "atol": 2e-3}
    moved_by = 0.0
    initial = small_llama().state_dict()
    for (name, got), want in zip(with_spans.model.named_parameters(), in_prompts.model.parameters(), strict=True):
        torch.testing.assert_close(got, want, **tolerance, msg=name)
        moved_by = max(moved_by, float((got.detach() - initial[name]).abs().max()))
    assert moved_by > 1e-3, "the step moved the weights (else the comparison proves nothing)"


def test_observations_between_turns_are_left_out_of_the_trained_tokens() -> None:
    """Two spans inside a completion: the batch's trained tokens are the others, each scored with
    everything before it (the observations included) as its context."""
    model = small_llama()
    prompt, completion = (1, 5, 6), (7, 8, 9, 10, 11, 12, 13, 14)
    observed = ((2, 4), (5, 7))
    whole = lp.token_batch([(prompt, completion)], 0, "cpu")
    masked = lp.token_batch([(prompt, completion)], 0, "cpu", observed=[observed])
    generated = [0, 1, 4, 7]
    assert masked.targets.tolist() == [completion[k] for k in generated]
    with torch.no_grad():
        every, _ = lp.call(model, whole, 1.0)
        some, _ = lp.call(model, masked, 1.0)
    assert some.tolist() == pytest.approx([every[k].item() for k in generated], abs=1e-6)


def test_a_row_keeps_the_generated_tokens_log_probs_and_counts() -> None:
    r = Rollout("g", 0, (1, 2), (5, 6, 7, 8, 9), (-0.1, 0.0, 0.0, -0.4, -0.5), 1.0, 0, observed=((1, 3),))
    row = rollout_row(r)
    assert row.old_logprobs == (-0.1, -0.4, -0.5)
    assert row.trained == 3
    step = step_rows([FinishedGroup("g", _groups()[0].prompt, 0, (r, dataclasses.replace(r, index=1, reward=0.0)))])
    assert step.tokens == 6


@pytest.mark.parametrize(
    "observed",
    [((3, 2),), ((0, 2), (1, 4)), ((4, 6),), ((2, 2),)],
    ids=["reversed", "overlapping", "past-the-end", "empty"],
)
def test_a_span_that_is_not_inside_the_completion_is_refused_by_name(observed: tuple[tuple[int, int], ...]) -> None:
    r = Rollout("g7", 3, (1, 2), (5, 6, 7, 8, 9), (0.0,) * 5, 1.0, 0, observed=observed)
    with pytest.raises(ValueError, match="group g7 rollout 3: observation spans"):
        rollout_row(r)
