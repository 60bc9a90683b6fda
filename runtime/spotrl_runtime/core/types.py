"""Values that cross the boundaries between data, generation, the recovery core and training."""

from __future__ import annotations

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
