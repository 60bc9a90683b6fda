"""``builtin:tiny-arith``: the demo policy, built from code in this repository.

A Llama-architecture causal LM of a few hundred thousand parameters with the character
tokenizer of :mod:`.char_tokenizer`, pre-trained for a few seconds on the CPU on every
single-digit addition and subtraction (``"3+4="`` → ``"7<eos>"``). Pre-training leaves a flaw
on purpose: about half of its targets carry a stray digit after the answer (``"7 3"``), so the
model knows most sums but often rambles past them. ``arithmetic_exact`` then scores it well
below its knowledge, and RL has a habit to unlearn that shows within a few dozen steps.

The built model is an ordinary Hugging Face folder (config, safetensors, tokenizer), cached
under :func:`~.cache.model_cache_dir` in a folder named by a hash of its recipe, so each
machine builds it once and every process (trainer, generation workers, vLLM) loads the same files.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from spotrl_runtime.models.cache import build_once, model_cache_dir, save_model_folder
from spotrl_runtime.models.pretrain import build_seeded, cosine_lr, supervised_step, write_recipe

NAME = "tiny-arith"
# Bump when the build code changes in a way the recipe fields do not capture.
BUILD_CODE_VERSION = 3


@dataclass(frozen=True)
class TinyArithRecipe:
    """Everything that determines the built weights; its hash names the cache folder."""

    hidden_size: int = 64
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 2
    """Head size 32: a size every attention kernel (vLLM's included) supports."""
    max_positions: int = 64
    pretrain_steps: int = 400
    batch_size: int = 128
    learning_rate: float = 3e-3
    ramble: float = 0.5
    """Fraction of pre-training answers followed by a stray digit (``"7 3"``): the model learns
    the sums but rambles about half the time, so an exact-answer reward starts low and RL has
    one clear habit to unlearn."""
    seed: int = 1234

    def key(self) -> str:
        blob = json.dumps({"recipe": asdict(self), "code": BUILD_CODE_VERSION}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


DEFAULT_RECIPE = TinyArithRecipe()


def arithmetic_problems() -> list[tuple[str, str, str]]:
    """The pre-training corpus as (task name, prompt, answer): every single-digit ``a+b``, and
    every ``a-b`` with ``a >= b`` (the problems ``builtin:arithmetic`` asks)."""
    problems = []
    for a in range(10):
        for b in range(10):
            problems.append(("add", f"{a}+{b}=", str(a + b)))
            if a >= b:
                problems.append(("sub", f"{a}-{b}=", str(a - b)))
    return problems


def tiny_arith_dir(recipe: TinyArithRecipe = DEFAULT_RECIPE, cache_dir: Path | None = None) -> Path:
    """The local folder of the built model, building and caching it first if needed."""
    target = (cache_dir or model_cache_dir()) / f"{NAME}-{recipe.key()}"
    return build_once(target, lambda tmp: _build(recipe, tmp))


def _build(recipe: TinyArithRecipe, out_dir: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from spotrl_runtime.models.char_tokenizer import build_char_tokenizer

    started = time.monotonic()
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_layers,
        num_attention_heads=recipe.num_heads,
        num_key_value_heads=recipe.num_heads,
        max_position_embeddings=recipe.max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    model = build_seeded(
        LlamaForCausalLM, config, recipe.seed, 1, lambda m, generator: _pretrain(m, tokenizer, recipe, generator)
    )
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    save_model_folder(model, tokenizer, out_dir)
    write_recipe(out_dir, NAME, recipe, BUILD_CODE_VERSION, started)


def _pretrain(model: Any, tokenizer: Any, recipe: TinyArithRecipe, generator: Any) -> None:
    """Supervised training on the completion tokens; a ``ramble`` fraction of targets carries a
    stray digit after the answer (``"7 3"``), the habit RL is meant to remove."""
    import torch

    problems = arithmetic_problems()
    prompt_ids = [tokenizer(prompt)["input_ids"] for _, prompt, _ in problems]
    answer_ids = [tokenizer(answer, add_special_tokens=False)["input_ids"] for _, _, answer in problems]
    space = tokenizer(" ", add_special_tokens=False)["input_ids"]
    digits = [tokenizer(str(d), add_special_tokens=False)["input_ids"] for d in range(10)]
    eos = [tokenizer.eos_token_id]
    width = max(len(p) + len(a) for p, a in zip(prompt_ids, answer_ids, strict=True)) + len(space) + 1 + 1

    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.0)
    model.train()
    for step in range(recipe.pretrain_steps):
        rows = torch.randint(len(problems), (recipe.batch_size,), generator=generator).tolist()
        rambles = (torch.rand(recipe.batch_size, generator=generator) < recipe.ramble).tolist()
        strays = torch.randint(10, (recipe.batch_size,), generator=generator).tolist()
        pairs = [
            (prompt_ids[r], answer_ids[r] + (space + digits[stray] if ramble else []) + eos)
            for r, ramble, stray in zip(rows, rambles, strays, strict=True)
        ]
        lr = cosine_lr(recipe.learning_rate, step, recipe.pretrain_steps)
        supervised_step(model, optimizer, pairs, tokenizer.pad_token_id, lr, width)
