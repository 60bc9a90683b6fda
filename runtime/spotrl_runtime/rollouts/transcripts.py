"""An episode as its turns, for a person debugging an environment (pure: no I/O).

A trained step's first episodes are kept beside its audit record (``spotrl episodes``): the
prompt, then each turn, ``policy`` (what it generated, tool calls included) and ``environment``
(what the environment wrote back, the chat template's markers included), with the reward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from spotrl_runtime.core.types import FinishedGroup, Rollout

TRANSCRIPTS_PER_STEP = 8
"""Episodes kept per trained step: the first ones of its groups, in the step's order."""


def turns(rollout: Rollout, decode: Callable[[list[int]], str]) -> list[dict[str, str]]:
    """The rollout's completion as alternating ``policy`` and ``environment`` turns."""
    out = []
    at = 0
    ids = list(rollout.completion_token_ids)
    for start, end in (*rollout.observed, (len(ids), len(ids))):
        if start > at:
            out.append({"role": "policy", "text": decode(ids[at:start])})
        if end > start:
            out.append({"role": "environment", "text": decode(ids[start:end])})
        at = end
    return out


def transcripts(
    groups: Sequence[FinishedGroup], decode: Callable[[list[int]], str], limit: int = TRANSCRIPTS_PER_STEP
) -> list[dict[str, Any]]:
    """The first ``limit`` rollouts of ``groups`` (in order), each as its prompt and turns."""
    out: list[dict[str, Any]] = []
    for group in groups:
        for r in group.rollouts:
            if len(out) == limit:
                return out
            out.append(
                {
                    "group_id": r.group_id,
                    "index": r.index,
                    "prompt_idx": group.prompt.idx,
                    "prompt": decode(list(r.prompt_token_ids)),
                    "reward": r.reward,
                    "finish_reason": r.finish_reason,
                    "weight_version": r.weight_version,
                    "turns": turns(r, decode),
                }
            )
    return out
