"""Glue between prompts, generation requests and scored rollouts (used by the controller)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from spotrl_runtime.core.types import FinishedGroup, Prompt, Rollout
from spotrl_runtime.generation.types import GenerationRequest, GroupGenerated


def encode_prompt(tokenizer: Any, prompt: Prompt) -> tuple[int, ...]:
    """The prompt's token ids, with the tokenizer's special tokens (e.g. bos) as it adds them."""
    return tuple(int(t) for t in tokenizer(prompt.text, add_special_tokens=True)["input_ids"])


def group_seed(run_seed: int, group_id: str, attempt: int = 0) -> int:
    """A sampling seed for one attempt at one group: stable across restarts, different per attempt."""
    digest = hashlib.sha256(f"{run_seed}:{group_id}:{attempt}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF


def make_request(
    group_id: str,
    prompt_token_ids: tuple[int, ...],
    generation: Any,
    *,
    run_seed: int = 0,
    attempt: int = 0,
) -> GenerationRequest:
    """A request for one group from ``RLJob.spec.generation`` (groupSize, maxNewTokens, temperature, topP)."""
    return GenerationRequest(
        group_id=group_id,
        prompt_token_ids=prompt_token_ids,
        n=generation.group_size,
        max_new_tokens=generation.max_new_tokens,
        temperature=generation.temperature,
        top_p=generation.top_p,
        seed=group_seed(run_seed, group_id, attempt),
    )


def score_group(
    generated: GroupGenerated,
    prompt: Prompt,
    rewards: Sequence[float],
    target_step: int,
) -> FinishedGroup:
    """The group as the replay buffer holds it, each sample with its reward (``rewards``: one
    per sample, in order; the controller scores them with a
    :class:`~spotrl_runtime.rewards.runner.RewardRunner`)."""
    if len(rewards) != len(generated.samples):
        raise ValueError(f"group {generated.group_id}: {len(rewards)} rewards for {len(generated.samples)} samples")
    rollouts = tuple(
        Rollout(
            group_id=generated.group_id,
            index=i,
            prompt_token_ids=generated.prompt_token_ids,
            completion_token_ids=sample.completion_token_ids,
            logprobs=sample.logprobs,
            reward=float(rewards[i]),
            weight_version=generated.weight_version,
            text=sample.text,
            finish_reason=sample.finish_reason,
        )
        for i, sample in enumerate(generated.samples)
    )
    return FinishedGroup(group_id=generated.group_id, prompt=prompt, target_step=target_step, rollouts=rollouts)
