"""What the built-in demo policies share: a seeded build, supervised pre-training on
(prompt, completion) pairs, and the recipe file that names how a folder was made.

A build is the same from run to run on one machine: the model is initialised under its own
seed (the caller's RNG untouched), batches are drawn from the build's own generator, and the
thread count is fixed while it trains.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

RECIPE_FILE = "spotrl-recipe.json"


def build_seeded(model_class: Any, config: Any, seed: int, threads: int, pretrain: Callable[[Any, Any], None]) -> Any:
    """``model_class(config)`` initialised under ``seed``, then ``pretrain(model, generator)``
    (a ``torch.Generator`` seeded with ``seed``) on ``threads`` threads; returned in eval mode."""
    import torch

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        generator = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_class(config)
        pretrain(model, generator)
    finally:
        torch.set_num_threads(previous_threads)
    model.eval()
    return model


def cosine_lr(base: float, step: int, total: int) -> float:
    """Cosine decay from ``base`` to zero over ``total`` steps."""
    return base * 0.5 * (1 + math.cos(math.pi * step / total))


def supervised_step(
    model: Any,
    optimizer: Any,
    pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
    pad_id: int,
    lr: float,
    width: int | None = None,
) -> None:
    """One optimizer step on a batch of (prompt ids, completion ids): right-padded to ``width``
    (default: the longest pair), the loss on the completion tokens only."""
    import torch

    width = width or max(len(p) + len(c) for p, c in pairs)
    input_ids = torch.full((len(pairs), width), pad_id)
    labels = torch.full((len(pairs), width), -100)
    attention = torch.zeros((len(pairs), width), dtype=torch.long)
    for i, (prompt, completion) in enumerate(pairs):
        seq = [*prompt, *completion]
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attention[i, : len(seq)] = 1
        labels[i, len(prompt) : len(seq)] = torch.tensor(completion)
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()


def write_recipe(out_dir: Path, name: str, recipe: Any, code_version: int, started: float) -> None:
    """``spotrl-recipe.json``: the model's name, recipe, build code version and build time."""
    doc = {"name": name, "recipe": asdict(recipe), "code": code_version, "build_seconds": time.monotonic() - started}
    (out_dir / RECIPE_FILE).write_text(json.dumps(doc, indent=2))
