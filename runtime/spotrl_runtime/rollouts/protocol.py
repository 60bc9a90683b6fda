"""The environment protocol the turn loop calls: OpenEnv's per-turn one (``reset(seed,
episode_id)``, then ``step(action)`` until ``done``), an action being a tool call and an
observation what the policy reads next. The built-in environments
(:mod:`.environments`) and an OpenEnv server's session (:mod:`.openenv`) implement it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from spotrl_runtime.rollouts.tool_calls import ToolCall


@dataclass(frozen=True)
class Observation:
    """What one action got back."""

    text: str
    """The tool message's content, as the policy reads it."""
    reward: float | None = None
    """The environment's reward for the episode so far (None: the job's reward scores it)."""
    done: bool = False
    """The environment ended the episode."""
    error: bool = False
    """An error answer (a tool missing, raising, timing out, bad arguments): counted in the job's
    ``spotrl_tool_errors_total``; the policy reads it like any answer."""


class Environment(Protocol):
    """One episode's environment: reset once with the episode's seed, then stepped per call."""

    def reset(self, seed: int, episode_id: str) -> None: ...

    def step(self, call: ToolCall) -> Observation: ...

    def close(self) -> None: ...
