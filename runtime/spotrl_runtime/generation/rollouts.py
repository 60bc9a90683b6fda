"""Glue between prompts, generation requests and scored rollouts (used by the controller)."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

from spotrl_runtime.core.types import FinishedGroup, Prompt, Rollout
from spotrl_runtime.generation.types import GenerationRequest, GroupGenerated


class PromptFormatError(ValueError):
    """A prompt that ``spec.dataset.promptFormat`` cannot encode; the message names the field."""


def encode_prompt(
    tokenizer: Any, prompt: Prompt, *, chat: bool = False, system_prompt: str | None = None
) -> tuple[int, ...]:
    """The prompt's token ids as generation sees them (and restore's ``rollout_prompt_tokens``
    check rebuilds them). Raw: the text with the tokenizer's special tokens (e.g. bos) as it adds
    them. ``chat``: the tokenizer's chat template over the prompt's turns (its text as the user's
    message, or the row's own turns), ``system_prompt`` first unless the turns begin with a
    system turn, ending with the generation prompt; the template brings its special tokens."""
    if not chat:
        if prompt.turns:
            raise PromptFormatError(
                f"row idx {prompt.idx} holds chat turns; set spec.dataset.promptFormat: chat to render them"
            )
        return tuple(int(t) for t in tokenizer(prompt.text, add_special_tokens=True)["input_ids"])
    turns = json.loads(prompt.text) if prompt.turns else [{"role": "user", "content": prompt.text}]
    if system_prompt is not None and not (turns and turns[0].get("role") == "system"):
        turns = [{"role": "system", "content": system_prompt}, *turns]
    text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    return tuple(int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_encoder(tokenizer: Any, dataset: Any) -> Callable[[Prompt], tuple[int, ...]]:
    """:func:`encode_prompt` as ``dataset`` (``spec.dataset``) asks: the one encoder that
    generation and restore share. A chat format needs a tokenizer with a chat template."""
    chat = dataset.prompt_format == "chat"
    if chat and not getattr(tokenizer, "chat_template", None):
        raise PromptFormatError(
            "spec.dataset.promptFormat: chat, but the policy's tokenizer has no chat template "
            "(tokenizer_config.json's chat_template); use promptFormat raw for a base model"
        )
    return functools.partial(encode_prompt, tokenizer, chat=chat, system_prompt=dataset.system_prompt)


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
            observed=sample.observed,
        )
        for i, sample in enumerate(generated.samples)
    )
    return FinishedGroup(group_id=generated.group_id, prompt=prompt, target_step=target_step, rollouts=rollouts)
