"""Values that cross the boundaries between data, generation, the recovery core and training."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Prompt:
    """One dataset row after the one-row collate that dispatch and restore share.

    ``idx`` and ``task_name`` are the locator the ledger persists; everything else is
    rebuilt from ``dataset[idx]`` on restore.
    """

    idx: int
    task_name: str
    text: str
    answer: str = ""
    fingerprint: str = ""
    """sha256 of the row's content, to detect a row edited under the same idx."""
    turns: bool = False
    """``text`` holds the row's chat turns as JSON (a list of ``{"role", "content"}``), not one
    user message: a prompt field in the HF ``messages`` convention."""


@dataclass(frozen=True)
class Rollout:
    """One generated sample of a group, with what the trainer needs."""

    group_id: str
    index: int
    """0 .. G-1 within its group."""
    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Generation-time log-probability of each completion token."""
    reward: float
    weight_version: int
    """The policy version (trained steps) the sample was generated with."""
    text: str = ""
    finish_reason: str = ""
    observed: tuple[tuple[int, int], ...] = ()
    """Spans ``[start, end)`` of the completion that an environment wrote, not the policy (a
    multi-turn episode's observations); their ``logprobs`` are 0 and they are never trained."""


def check_observed(observed: Sequence[Sequence[int]], length: int, what: str) -> tuple[tuple[int, int], ...]:
    """``observed`` (:attr:`Rollout.observed`) as spans in order, each non-empty, apart and
    inside ``length`` completion tokens; else a ``ValueError`` naming ``what``."""
    spans = tuple((int(a), int(b)) for a, b in observed)
    bounds = [0, *(x for span in spans for x in span), length]
    if any(b < a for a, b in itertools.pairwise(bounds)) or any(a == b for a, b in spans):
        raise ValueError(
            f"{what}: observation spans {list(spans)[:8]} are not ordered, non-empty spans "
            f"within its {length} completion tokens"
        )
    return spans


def generated_offsets(length: int, observed: Sequence[tuple[int, int]]) -> list[int]:
    """The offsets of a completion of ``length`` tokens outside its ``observed`` spans, in order:
    the tokens the policy generated."""
    out: list[int] = []
    at = 0
    for start, end in (*observed, (length, length)):
        out.extend(range(at, start))
        at = end
    return out


@dataclass(frozen=True)
class FinishedGroup:
    """All G rollouts of one prompt, as the replay buffer holds them."""

    group_id: str
    prompt: Prompt
    target_step: int
    rollouts: tuple[Rollout, ...] = field(default_factory=tuple)


class RankLostError(RuntimeError):
    """A trainer rank died: the group's state is gone with it (restore from the last cut). Raised
    by the trainer group; a restore passes it on unchanged (it is not the cut's fault)."""
