"""A trainer rank keeps one capture of its shards, and never lets a periodic capture replace a
barrier's before it is written (one process, no process group: the rule is the rank's own)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from spotrl_runtime.training.fsdp import TrainerRank
from spotrl_runtime.training.group import CaptureRefusedError


def a_rank() -> TrainerRank:
    rank = TrainerRank(0, 1, "cpu")
    model = torch.nn.Linear(4, 3)
    rank.trainer = SimpleNamespace(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    return rank


def test_a_periodic_capture_after_a_barriers_is_refused_and_the_barriers_is_written(tmp_path: Path) -> None:
    rank = a_rank()
    barrier = rank.capture(last=True)
    with pytest.raises(CaptureRefusedError, match=f"rank 0 holds the barrier's capture {barrier}"):
        rank.capture()
    files = rank.save(barrier, str(tmp_path / "cuts"), "c1", None)
    assert files, "the barrier's capture was written"
    with pytest.raises(RuntimeError, match="no captured state"):
        rank.save(barrier, str(tmp_path / "cuts"), "c2", None)  # written once, then dropped
    rank.capture()  # once the barrier's is written, periodic captures are taken again


def test_a_newer_capture_replaces_an_unwritten_periodic_one() -> None:
    rank = a_rank()
    old = rank.capture()
    rank.capture()
    with pytest.raises(RuntimeError, match=f"no captured state {old}"):
        rank.save(old, "unused", "c1", None)


def test_a_second_barrier_replaces_the_first() -> None:
    """A barrier that failed (its deadline passed) and is asked for again captures anew."""
    rank = a_rank()
    first = rank.capture(last=True)
    second = rank.capture(last=True)
    with pytest.raises(RuntimeError, match=f"no captured state {first}"):
        rank.save(first, "unused", "c1", None)
    with pytest.raises(CaptureRefusedError, match=second):
        rank.capture()
