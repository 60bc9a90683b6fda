"""Cuts taken while the trainer goes on: the trainer's tensors are lent to the cut by
reference, copied behind its back (periodic) or written live (barrier), and the trainer waits
only at its next optimizer step. Real torch (a small Llama, the real Trainer and AdamW),
real cuts on disk, restored through the whole validation chain."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from cut_scenarios import DATASET, EXAMPLE_B, Run, loader_for
from transformers import LlamaConfig, LlamaForCausalLM

from spotrl_runtime.api.times import Deadline
from spotrl_runtime.checkpoint import CutRequest
from spotrl_runtime.checkpoint import trainer_state as ts
from spotrl_runtime.checkpoint.restore import restore_cut
from spotrl_runtime.data import PromptCollate
from spotrl_runtime.storage import LocalStorage
from spotrl_runtime.training.trainer import Trainer, TrainerConfig


def small_trainer() -> Trainer:
    config = LlamaConfig(
        vocab_size=128,  # the scenario's rollouts are ASCII codes
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return Trainer(LlamaForCausalLM(config).eval(), TrainerConfig(learning_rate=0.05, micro_batch_size=4))


def advance(run: Run, trainer: Trainer, until_step: int) -> None:
    """Generation (scripted) and real GRPO steps until ``until_step`` steps are trained."""
    while run.owners.trainer_step < until_step:
        run.pump()
        for gid in run.targets():
            run.finish(gid)
        while run.owners.step_ready() and run.owners.trainer_step < until_step:
            groups = run.owners.begin_step()
            trainer.train_step(groups)
            run.owners.commit_step(weight_version=trainer.step)
            run.pump()


def state_of(trainer: Trainer) -> dict[str, Any]:
    """Clones of every tensor the cut must hold (weights, AdamW's moments and step counts)."""
    return {
        "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "optimizer": {
            i: {k: v.clone() for k, v in s.items()} for i, s in trainer.optimizer.state_dict()["state"].items()
        },
    }


def assert_same(restored: Any, expected: dict[str, Any]) -> None:
    assert restored.weights.keys() == expected["weights"].keys()
    for k, v in expected["weights"].items():
        assert torch.equal(restored.weights[k], v), f"weights {k} differ from the captured step's"
    state = restored.optimizer["state"]
    assert state.keys() == expected["optimizer"].keys()
    for i, moments in expected["optimizer"].items():
        for k, v in moments.items():
            assert torch.equal(state[i][k], v), f"optimizer state {i}.{k} differs from the captured step's"


def restore(storage: LocalStorage, cut_id: str) -> Any:
    return restore_cut(
        storage, dataset=DATASET, collate=PromptCollate(), source=loader_for(EXAMPLE_B, DATASET), cut_id=cut_id
    )


@pytest.fixture
def slow_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The background copy starts 2 s late: a trainer that did not wait for it would have
    changed its weights and moments before they were copied."""
    original = ts.copy_into

    def late(obj: Any, buffers: Any, path: tuple[str, ...] = ()) -> Any:
        if len(path) == 1:
            time.sleep(2.0)
        return original(obj, buffers, path)

    monkeypatch.setattr(ts, "copy_into", late)


@pytest.mark.alone
def test_a_periodic_cut_taken_while_training_goes_on_restores_exactly_the_captured_step(
    tmp_path: Path, slow_copy: None
) -> None:
    storage = LocalStorage(tmp_path / "cuts")
    run = Run.new(EXAMPLE_B, DATASET, storage)
    trainer = small_trainer()
    advance(run, trainer, 2)
    expected = state_of(trainer)
    t0 = time.perf_counter()
    snapshot = run.owners.capture(lambda: trainer.snapshot({"model": "small"}))
    assert time.perf_counter() - t0 < 1.0, "the capture copies nothing under the lock (the copy takes 2 s)"

    advance(run, trainer, 4)  # two more steps, while the copy is still to be made
    assert trainer.cut_wait_seconds > 0.5, "the first optimizer step after the capture waited for the copy"
    moved = state_of(trainer)
    assert not all(torch.equal(moved["weights"][k], v) for k, v in expected["weights"].items()), "training went on"

    assert run.writer is not None
    cut = run.writer.write_snapshot(snapshot, CutRequest.periodic("while training"))
    restored = restore(storage, cut.cut_id)
    assert restored.owners.trainer_step == 2
    assert restored.trainer is not None
    assert restored.trainer.meta["trainer_step"] == 2
    assert_same(restored.trainer, expected)


def test_a_barrier_writes_the_live_tensors_and_the_trainer_waits_for_it(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "cuts")
    run = Run.new(EXAMPLE_B, DATASET, storage)
    trainer = small_trainer()
    advance(run, trainer, 2)
    expected = state_of(trainer)
    snapshot = run.owners.capture(lambda: trainer.snapshot({"model": "small"}, last=True))
    assert isinstance(snapshot.extra, ts.LentTrainerState)
    assert snapshot.extra.resolve().weights["model.embed_tokens.weight"] is not None

    # A step that should not happen after a barrier, but if it did it must not tear the cut.
    stepper = threading.Thread(target=advance, args=(run, trainer, 3))
    stepper.start()
    time.sleep(1.0)
    assert stepper.is_alive(), "the optimizer step waits while the barrier holds the live tensors"
    assert all(torch.equal(v, expected["weights"][k]) for k, v in trainer.model.state_dict().items())

    assert run.writer is not None
    cut = run.writer.write_snapshot(snapshot, CutRequest.barrier(Deadline.after(60), "test"))
    stepper.join(30)
    assert not stepper.is_alive(), "the trainer goes on once the cut's files are written"
    restored = restore(storage, cut.cut_id)
    assert restored.owners.trainer_step == 2
    assert_same(restored.trainer, expected)


def test_a_barrier_during_a_periodic_write_commits_every_trained_step(tmp_path: Path, slow_copy: None) -> None:
    storage = LocalStorage(tmp_path / "cuts")
    run = Run.new(EXAMPLE_B, DATASET, storage)
    trainer = small_trainer()
    writer = run.writer
    assert writer is not None
    advance(run, trainer, 2)
    periodic_files_written, go_on = threading.Event(), threading.Event()

    def hold_periodic(phase: str, step: int) -> None:
        if phase == "files_written" and not periodic_files_written.is_set():
            periodic_files_written.set()
            assert go_on.wait(60)

    writer.progress = hold_periodic
    snapshot = run.owners.capture(lambda: trainer.snapshot({"model": "small"}))
    results: dict[str, Any] = {}
    periodic = threading.Thread(
        target=lambda: results.setdefault("periodic", writer.write_snapshot(snapshot, CutRequest.periodic()))
    )
    periodic.start()
    assert periodic_files_written.wait(60)
    advance(run, trainer, 3)  # training goes on while the periodic cut is being written
    expected = state_of(trainer)

    barrier = threading.Thread(
        target=lambda: results.setdefault(
            "barrier",
            writer.write(
                run.owners,
                CutRequest.barrier(Deadline.after(60), "SIGTERM"),
                lambda: trainer.snapshot({"model": "small"}, last=True),
            ),
        )
    )
    barrier.start()
    time.sleep(0.3)
    assert barrier.is_alive(), "one cut at a time: the barrier waits for the periodic write"
    go_on.set()
    periodic.join(30)
    barrier.join(30)
    assert results["periodic"].manifest.trainer_step == 2
    cut = results["barrier"]
    assert cut.manifest.kind == "barrier"
    assert cut.manifest.trainer_step == 3
    assert int(cut.cut_id.split("-")[-1]) > int(results["periodic"].cut_id.split("-")[-1])
    restored = restore(storage, cut.cut_id)
    assert restored.owners.trainer_step == 3, "the barrier holds every trained step"
    assert_same(restored.trainer, expected)
