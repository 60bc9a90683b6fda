"""Deterministic 'generation' for core tests: each rollout is a pure function of its group and index."""

from __future__ import annotations

from spotrl_runtime.core.owners import Dispatch, Owners, RecoveryConfig
from spotrl_runtime.core.types import Rollout
from spotrl_runtime.data import ArithmeticDataset, PromptCollate
from spotrl_runtime.data.loader import PromptLoader


def rollout(d: Dispatch, index: int) -> Rollout:
    """Rollout ``index`` of the dispatched group: tokens from the prompt, a reward from the answer."""
    prompt_ids = tuple(ord(c) for c in d.prompt.text)
    completion = tuple(ord(c) for c in f"{d.prompt.answer}#{index}")
    return Rollout(
        group_id=d.group_id,
        index=index,
        prompt_token_ids=prompt_ids,
        completion_token_ids=completion,
        logprobs=tuple(-0.1 * (k + 1) / (index + 1) for k in range(len(completion))),
        reward=float(index % 2),
        weight_version=d.weight_version,
        text=f"{d.prompt.answer}#{index}",
        finish_reason="stop",
    )


def rollouts(d: Dispatch) -> list[Rollout]:
    """Every rollout the dispatch asks for."""
    return [rollout(d, i) for i in d.rollout_indexes]


def new_owners(config: RecoveryConfig, *, size: int = 1000, shuffle: bool = False, seed: int = 0) -> Owners:
    """Owners over a real loader on builtin:arithmetic."""
    loader = PromptLoader(
        ArithmeticDataset(size=size), PromptCollate(), batch_size=config.prompts_per_step, shuffle=shuffle, seed=seed
    )
    return Owners(config, loader)
