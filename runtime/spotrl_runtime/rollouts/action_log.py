"""An episode's action log: what it sent its environment, and how a resume restores the
environment from it.

Each finished turn adds one :class:`~spotrl_runtime.core.types.ToolTurn`: the calls the turn made
and the digest of what the environment answered. A resume resets a fresh environment with the
episode's seed and sends it the same calls, turn by turn; every answer must have the recorded
digest, else the environment did not replay and the episode starts again from turn 0
(``rollouts.md``, guarantees 2 and 3). A turn whose call could not be parsed sent nothing: its
answer came from the parser, and replay skips it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

from spotrl_runtime.core.types import ToolTurn
from spotrl_runtime.rollouts.protocol import Environment, Observation
from spotrl_runtime.rollouts.tool_calls import ParsedTurn, ToolCall


def act(environment: Environment, parsed: ParsedTurn) -> list[Observation]:
    """The environment's answers to a turn's calls, in order; a call that raises answers with
    its error (a tool's crash is an observation)."""
    if parsed.malformed:
        return [Observation(f"error: {parsed.malformed}", error=True)]
    out = []
    for call in parsed.calls:
        try:
            out.append(environment.step(call))
        except Exception as err:
            out.append(Observation(f"error: {call.name} raised {type(err).__name__}: {str(err)[:300]}", error=True))
        if out[-1].done:
            break
    return out


def digest(observations: Sequence[Observation]) -> str:
    """The sha256 of what a turn's calls got back (each answer's text and whether it ended the
    episode), as the environment returned it."""
    payload = json.dumps([[o.text, o.done] for o in observations], ensure_ascii=False)
    return hashlib.sha256(payload.encode()).hexdigest()


def tool_turn(parsed: ParsedTurn, observations: Sequence[Observation]) -> ToolTurn:
    """The action log's entry for a turn that sent ``parsed`` and got ``observations``."""
    calls = () if parsed.malformed else parsed.calls
    return ToolTurn(
        calls=tuple((c.name, json.dumps(c.arguments, sort_keys=True, ensure_ascii=False)) for c in calls),
        digest=digest(observations),
    )


def replay(environment: Environment, actions: Sequence[ToolTurn]) -> bool:
    """Sends a freshly reset ``environment`` the episode's ``actions``; True when every answer
    matches its digest (the environment is then where the episode left it)."""
    for turn in actions:
        if not turn.calls:
            continue  # a malformed call: the parser answered, the environment saw nothing
        try:
            calls = tuple(ToolCall(name, json.loads(arguments)) for name, arguments in turn.calls)
        except ValueError:
            return False  # not what this code records: not the action log it claims to be
        if digest(act(environment, ParsedTurn(calls=calls))) != turn.digest:
            return False
    return True
