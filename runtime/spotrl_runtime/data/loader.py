"""The resumable prompt loader: torchdata's StatefulDataLoader over an endless epoch sampler.

Each ``next_batch()`` yields ``promptsPerStep`` prompts (one admission). The sampler walks
a seeded permutation of the dataset per epoch (a fresh one each epoch when ``shuffle``) and
runs on into the next epoch without a short batch, so every batch is whole and no row is
skipped at an epoch's end. Its position (epoch, offset) is all the loader state there is:
``state_dict()`` is small, JSON-serialisable, and resumes mid-epoch exactly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import BatchSampler

from spotrl_runtime.core.cut_format import LoaderPosition, loader_position
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.data.collate import PromptCollate
from spotrl_runtime.data.dataset import PromptDataset

__all__ = ["EpochSampler", "LoaderPosition", "PromptLoader", "epoch_order", "loader_position"]

_GOLDEN = 0x9E3779B97F4A7C15


def epoch_order(size: int, epoch: int, *, shuffle: bool, seed: int) -> list[int]:
    """The order rows are visited in one epoch: a seeded permutation, or 0..size-1."""
    if not shuffle:
        return list(range(size))
    g = torch.Generator()
    g.manual_seed((seed * _GOLDEN + epoch) % (2**63))
    return [int(i) for i in torch.randperm(size, generator=g)]


class _EpochIterator(Iterator[int]):
    """Yields row indexes forever; its state is (epoch, offset within the epoch's order)."""

    def __init__(self, sampler: EpochSampler):
        self.sampler = sampler
        self.epoch = 0
        self.offset = 0
        self._order: list[int] | None = None

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> int:
        s = self.sampler
        if self._order is None:
            self._order = epoch_order(s.size, self.epoch, shuffle=s.shuffle, seed=s.seed)
        idx = self._order[self.offset]
        self.offset += 1
        if self.offset == s.size:
            # Roll over now, so the saved position of an epoch's end reads (next epoch, 0).
            self.epoch += 1
            self.offset = 0
            self._order = None
        return idx

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "size": self.sampler.size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("size") != self.sampler.size:
            raise ValueError(
                f"loader state is for a dataset of {state.get('size')} rows, this one has {self.sampler.size}"
            )
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
        self._order = None


class EpochSampler(Sampler[int]):
    """An endless, seeded, epoch-by-epoch sampler whose iterator is Stateful for torchdata."""

    def __init__(self, size: int, *, shuffle: bool, seed: int):
        self.size = size
        self.shuffle = shuffle
        self.seed = seed

    def __iter__(self) -> Iterator[int]:
        return _EpochIterator(self)


class PromptLoader:
    """Batches of ``batch_size`` prompts from a dataset, resumable from ``state_dict()``.

    Rows are turned into prompts by ``collate`` (the one-row collate restore uses too).
    Single-process on purpose: rows are small, and the state then never depends on workers.
    """

    def __init__(
        self,
        dataset: PromptDataset,
        collate: PromptCollate,
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.dataset = dataset
        self.collate = collate
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        sampler = EpochSampler(len(dataset), shuffle=shuffle, seed=seed)
        self._loader = StatefulDataLoader(
            dataset,
            batch_sampler=BatchSampler(sampler, batch_size, drop_last=False),
            collate_fn=collate.batch,
            num_workers=0,
            # Its own generator: starting an iterator draws a seed, which from torch's global RNG
            # would move the trainer's (a dropout's draws, and a delta cut's redo, depend on it).
            generator=torch.Generator().manual_seed(seed),
        )
        self._iter: Iterator[list[Prompt]] | None = None

    def next_batch(self) -> list[Prompt]:
        """The next ``batch_size`` prompts (the sampler is endless, so this always succeeds)."""
        if self._iter is None:
            self._iter = iter(self._loader)
        return next(self._iter)

    def state_dict(self) -> dict[str, Any]:
        """The loader's position, JSON-serialisable."""
        return self._loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resumes from a saved position; the next batch is the one that would have come next."""
        self._loader.load_state_dict(state)
        self._iter = None
        # Apply the state now, so a bad state fails here rather than at the next batch.
        self._iter = iter(self._loader)

    def position(self) -> LoaderPosition:
        """Where the loader stands now."""
        return loader_position(self.state_dict())
