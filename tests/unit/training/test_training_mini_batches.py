"""PPO-style mini-batches and epochs: the proximal log-probs taken before the first update, each
mini-batch its own loss, the clip acting from the second update on, and a barrier that cannot
land between two updates of a step."""

from __future__ import annotations

import pytest
import torch
from training_helpers import make_group, small_llama

from spotrl_runtime.core.types import FinishedGroup
from spotrl_runtime.training import Trainer, TrainerConfig
from spotrl_runtime.training.trainer import StepInterruptedError


def _groups() -> list[FinishedGroup]:
    return [
        make_group("a", [1.0, 0.0, 0.0, 1.0]),
        make_group("b", [0.0, 0.0, 1.0, 0.0], seed=1),
        make_group("c", [0.5, 0.25, 0.0, 1.0], seed=2),
        make_group("d", [1.0, 0.0, 1.0, 1.0], seed=3),
    ]


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _adam_steps(trainer: Trainer) -> int:
    return int(max(float(s["step"]) for s in trainer.optimizer.state.values()))


def test_one_update_a_step_never_clips_and_several_do() -> None:
    """With one update the ratio is exactly 1 and the clip never acts; with mini-batches the later
    updates are taken against the proximal policy of the step's start, so a large step is clipped."""
    metrics = {}
    for mini_batches in (1, 4):
        config = TrainerConfig(learning_rate=0.05, max_grad_norm=1e6, mini_batches=mini_batches, epochs=2)
        trainer = Trainer(small_llama(), config)
        metrics[mini_batches] = trainer.train_step(_groups())
        assert trainer.step == 1, "the weight version moves once a step, whatever its updates"
        assert _adam_steps(trainer) == mini_batches * 2
    one = TrainerConfig(learning_rate=0.05, max_grad_norm=1e6)
    single = Trainer(small_llama(), one).train_step(_groups())
    assert single["clip_fraction"] == 0.0
    assert single["ratio_mean"] == 1.0
    assert metrics[4]["clip_fraction"] > 0
    assert metrics[4]["ratio_max"] > 1.2


def test_each_mini_batch_is_a_loss_of_its_own_and_the_first_update_is_its_gradient() -> None:
    """The first update of miniBatches 2 is the token-mean gradient of the first two groups alone."""
    seen: list[dict[str, torch.Tensor]] = []
    trainer = Trainer(small_llama(), TrainerConfig(max_grad_norm=1e6, mini_batches=2))
    step = trainer.optimizer.step

    def recording_step(*args: object, **kwargs: object) -> object:
        seen.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return step(*args, **kwargs)

    trainer.optimizer.step = recording_step  # type: ignore[method-assign]
    trainer.train_step(_groups())
    assert len(seen) == 2
    alone = Trainer(small_llama(), TrainerConfig())
    alone.compute_gradients(_groups()[:2])
    for name, grad in alone.model.named_parameters():
        if grad.grad is not None:
            torch.testing.assert_close(seen[0][name], grad.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert any(not torch.allclose(seen[0][n], seen[1][n]) for n in seen[0])


def test_a_barrier_before_the_first_update_changes_nothing_and_after_it_waits_for_the_step() -> None:
    config = TrainerConfig(learning_rate=1e-2, mini_batches=2, epochs=2)
    reference = Trainer(small_llama(), config)
    reference.train_step(_groups())

    stopped = Trainer(small_llama(), config)
    before = _params(stopped.model)
    with pytest.raises(StepInterruptedError):
        stopped.train_step(_groups(), interrupted=lambda: True)
    assert stopped.step == 0
    assert not stopped.optimizer.state, "no update was applied"
    for name, value in _params(stopped.model).items():
        assert torch.equal(value, before[name]), name

    late = Trainer(small_llama(), config)
    late.train_step(_groups(), interrupted=lambda: bool(late.optimizer.state))  # yes once an update is applied
    assert late.step == 1
    for name, value in _params(late.model).items():
        assert torch.equal(value, _params(reference.model)[name]), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_step_of_mini_batches_resumes_from_a_cut_bit_for_bit(dtype: str) -> None:
    config = TrainerConfig(learning_rate=1e-2, mini_batches=2, epochs=2, compute_dtype=dtype)
    reference = Trainer(small_llama(), config)
    for _ in range(3):
        last = reference.train_step(_groups())

    first = Trainer(small_llama(), config)
    first.train_step(_groups())
    state = first.state_dict()
    resumed = Trainer(small_llama(seed=9), config)
    resumed.load_state_dict(state)
    for _ in range(2):
        again = resumed.train_step(_groups())
    for name, value in _params(resumed.model).items():
        assert torch.equal(value, _params(reference.model)[name]), name
    assert again["loss"] == last["loss"]
    assert resumed.fingerprint(again) == reference.fingerprint(last)
    assert reference.fingerprint(last).layout == "miniBatches=2,epochs=2"


def test_more_mini_batches_than_groups_are_as_many_as_the_groups() -> None:
    trainer = Trainer(small_llama(), TrainerConfig(mini_batches=8))
    trainer.train_step(_groups()[:3])
    assert _adam_steps(trainer) == 3
