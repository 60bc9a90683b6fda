"""A small random Llama (built in milliseconds) and hand-made groups for trainer tests."""

from __future__ import annotations

import random
from collections.abc import Callable

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spotrl_runtime.core.types import FinishedGroup, Prompt, Rollout

VOCAB = 18


def small_llama(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def make_group(
    group_id: str,
    rewards: list[float],
    *,
    seed: int = 0,
    prompt_len: int | None = None,
    logprob: Callable[[int], float] = lambda i: -1.5,
) -> FinishedGroup:
    """A group of len(rewards) rollouts with varied prompt and completion lengths (ids 4..17)."""
    rng = random.Random(f"{group_id}:{seed}")
    plen = prompt_len or rng.randint(2, 6)
    prompt_ids = (1, *(rng.randint(4, VOCAB - 1) for _ in range(plen - 1)))
    rollouts = []
    for i, reward in enumerate(rewards):
        n = rng.randint(1, 5)
        ids = tuple(rng.randint(4, VOCAB - 1) for _ in range(n))
        rollouts.append(
            Rollout(
                group_id=group_id,
                index=i,
                prompt_token_ids=prompt_ids,
                completion_token_ids=ids,
                logprobs=tuple(logprob(j) for j in range(n)),
                reward=reward,
                weight_version=0,
            )
        )
    return FinishedGroup(group_id, Prompt(0, "add", "1+1=", "2"), 0, tuple(rollouts))
