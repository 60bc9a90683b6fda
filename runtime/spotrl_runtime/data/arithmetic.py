"""``builtin:arithmetic``: single-digit addition and subtraction, generated from code.

Each row is a pure function of ``(seed, idx)``, so the dataset needs no file and rebuilds
identically in any process: ``{"idx": 17, "task_name": "add", "prompt": "3+4=", "answer": "7"}``.
Subtractions never go below zero, so every answer is a small non-negative number that a
tiny model can learn. The task names are exactly ``add`` and ``sub``.
"""

from __future__ import annotations

import random

from spotrl_runtime.data.dataset import Row, check_index

DEFAULT_SIZE = 10_000


class ArithmeticDataset:
    """``size`` generated problems; the same ``seed`` gives the same rows everywhere."""

    def __init__(self, size: int = DEFAULT_SIZE, seed: int = 0):
        if size < 1:
            raise ValueError(f"builtin:arithmetic size must be at least 1, got {size}")
        self.size = size
        self.seed = seed
        self.uri = "builtin:arithmetic" if size == DEFAULT_SIZE else f"builtin:arithmetic?size={size}"

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> Row:
        check_index(self, idx)
        # random.Random seeded with an int is stable across Python versions and processes.
        rng = random.Random(self.seed * 1_000_003 + idx)
        a, b = rng.randrange(10), rng.randrange(10)
        if rng.random() < 0.5:
            return {"idx": idx, "task_name": "add", "prompt": f"{a}+{b}=", "answer": str(a + b)}
        a, b = max(a, b), min(a, b)
        return {"idx": idx, "task_name": "sub", "prompt": f"{a}-{b}=", "answer": str(a - b)}
