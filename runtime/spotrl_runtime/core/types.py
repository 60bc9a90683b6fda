"""Values that cross the boundaries between data, generation, the recovery core and training."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


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
class ToolTurn:
    """One turn's entry in an episode's action log: the tool calls the policy made (name and
    arguments as JSON, in order) and the sha256 of the observation the environment answered."""

    calls: tuple[tuple[str, str], ...]
    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"calls": [list(c) for c in self.calls], "digest": self.digest}

    @classmethod
    def from_json(cls, data: Any) -> ToolTurn:
        calls = data.get("calls") if isinstance(data, dict) else None
        digest = data.get("digest") if isinstance(data, dict) else None
        if (
            not isinstance(calls, list)
            or not all(isinstance(c, list) and len(c) == 2 and all(isinstance(x, str) for x in c) for c in calls)
            or not isinstance(digest, str)
            or len(digest) != 64
        ):
            raise ValueError("an action must be {calls: [[name, arguments], ...], digest: <sha256 hex>}")
        return cls(tuple((c[0], c[1]) for c in calls), digest)


@dataclass(frozen=True)
class EpisodeState:
    """An unfinished episode's finished turns: what the ledger keeps so that a resume continues
    the episode instead of generating them again (``docs/guides/agents.md``).

    ``completion_token_ids`` are the turns' tokens and the observations after them, as the
    episode's sample will hold them; ``actions`` the action log, one entry a finished turn.
    """

    group_id: str
    index: int
    """The rollout index (0 .. G-1) of the episode's sample."""
    completion_token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    observed: tuple[tuple[int, int], ...]
    actions: tuple[ToolTurn, ...]
    weight_version: int
    environment: str
    """The environment's name (``spec.environment.name``): another one never resumes it."""

    @property
    def turns(self) -> int:
        return len(self.actions)

    def to_json(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "index": self.index,
            "completion_token_ids": list(self.completion_token_ids),
            "logprobs": list(self.logprobs),
            "observed": [list(s) for s in self.observed],
            "actions": [a.to_json() for a in self.actions],
            "weight_version": self.weight_version,
            "environment": self.environment,
        }

    @classmethod
    def from_json(cls, data: Any) -> EpisodeState:
        """Parses and checks one episode; a ``ValueError`` names what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("an episode must be a JSON object")
        ids, logprobs = data.get("completion_token_ids"), data.get("logprobs")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("completion_token_ids must be a list of integers")
        if not isinstance(logprobs, list) or len(logprobs) != len(ids):
            raise ValueError(f"logprobs must be a list of {len(ids)} numbers, one a token")
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x <= 0 for x in logprobs):
            raise ValueError("logprobs must be numbers <= 0")
        observed = data.get("observed")
        actions = data.get("actions")
        if not isinstance(observed, list) or not all(isinstance(s, list) and len(s) == 2 for s in observed):
            raise ValueError("observed must be a list of [start, end] spans")
        if not isinstance(actions, list) or not actions or len(actions) != len(observed):
            raise ValueError("actions must hold one entry a finished turn, as many as the observation spans")
        index, version = _whole(data, "index"), _whole(data, "weight_version")
        environment = data.get("environment")
        if not isinstance(data.get("group_id"), str) or not isinstance(environment, str):
            raise ValueError("group_id and environment must be strings")
        spans = check_observed(observed, len(ids), f"episode {data['group_id']}/{index}")
        if spans[-1][1] != len(ids):
            raise ValueError("an episode's tokens must end with its last observation (its next turn starts there)")
        return cls(
            group_id=data["group_id"],
            index=index,
            completion_token_ids=tuple(ids),
            logprobs=tuple(float(x) for x in logprobs),
            observed=spans,
            actions=tuple(ToolTurn.from_json(a) for a in actions),
            weight_version=version,
            environment=environment,
        )


def _whole(data: dict[str, Any], key: str) -> int:
    value = data.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{key} must be an integer >= 0, got {value!r}")
    return value


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
