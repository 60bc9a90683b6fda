"""An OpenEnv environment server as an episode's environment (``spec.environment.name: openenv``).

OpenEnv (``openenv-core``) serves an environment over HTTP from its own container; a session
that keeps state across steps is a WebSocket at ``/ws``, one environment instance a connection
(its HTTP ``/reset`` and ``/step`` build a fresh instance per request, so they cannot run an
episode). We speak that protocol ourselves rather than import ``openenv-core``: a server's image
carries its own dependencies (OpenEnv's web UI pins libraries that clash with ours), and the
client is a few messages:

- ``{"type": "reset", "data": {"seed", "episode_id"}}`` and ``{"type": "step", "data": action}``,
  each answered by ``{"type": "observation", "data": {"observation", "reward", "done"}}`` or
  ``{"type": "error", "data": {"message", ...}}``; ``{"type": "close"}`` ends the session.
- An action is OpenEnv's ``CallToolAction`` (``{"type": "call_tool", "tool_name", "arguments"}``),
  which MCP environments (``MCPEnvironment``) route to their tools; the tool's text content is
  the observation, and a tool's error (unknown, raised, bad arguments) an error observation.

Every wait is bounded by ``seconds`` (the connection, each answer): a server that does not answer
makes the call raise, which the turn loop turns into an error observation.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from spotrl_runtime.rollouts.protocol import Observation
from spotrl_runtime.rollouts.tool_calls import ToolCall


class EnvironmentServerError(RuntimeError):
    """The server refused a message, answered something else, or did not answer in time."""


def session_url(url: str) -> str:
    """The WebSocket address of a server given as ``http(s)://host:port`` or ``ws(s)://...``
    (``/ws`` added when the address has no path)."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss", "ws": "ws", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.netloc:
        raise ValueError(f"spec.environment.url: {url!r} is not an http(s):// or ws(s):// address of a server")
    return urlunsplit((scheme, parts.netloc, parts.path.rstrip("/") or "/ws", parts.query, ""))


class OpenEnvSession:
    """One episode's session with an OpenEnv server: opened by :meth:`reset`."""

    def __init__(self, url: str, seconds: float) -> None:
        self.url = session_url(url)
        self.seconds = seconds
        self._socket: Any = None
        self._stack = contextlib.ExitStack()

    def reset(self, seed: int, episode_id: str) -> None:
        from websockets.sync.client import connect

        self.close()
        try:
            self._socket = self._stack.enter_context(
                connect(self.url, open_timeout=self.seconds, close_timeout=1, max_size=2**22)
            )
        except Exception as err:
            raise EnvironmentServerError(f"could not open a session at {self.url}: {err}") from None
        self._call({"type": "reset", "data": {"seed": seed, "episode_id": episode_id}})

    def step(self, call: ToolCall) -> Observation:
        action = {"type": "call_tool", "tool_name": call.name, "arguments": call.arguments}
        data = self._call({"type": "step", "data": action})
        reward, observation = data.get("reward"), data.get("observation")
        return Observation(
            observation_text(observation),
            reward=float(reward) if isinstance(reward, int | float) else None,
            done=data.get("done") is True,
            error=is_error(observation),
        )

    def close(self) -> None:
        socket, self._socket = self._socket, None
        if socket is None:
            return
        with contextlib.suppress(Exception):
            socket.send(json.dumps({"type": "close", "data": {}}))
        with contextlib.suppress(Exception):
            self._stack.close()

    def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        if self._socket is None:
            raise EnvironmentServerError("no session: the environment was not reset")
        try:
            self._socket.send(json.dumps(message))
            reply = json.loads(self._socket.recv(timeout=self.seconds))
        except TimeoutError:
            raise EnvironmentServerError(f"{self.url} did not answer within {self.seconds:g} s") from None
        except Exception as err:
            raise EnvironmentServerError(f"the session at {self.url} failed: {type(err).__name__}: {err}") from None
        data = reply.get("data") if isinstance(reply, dict) else None
        if not isinstance(data, dict):
            raise EnvironmentServerError(f"{self.url} answered {str(reply)[:200]}")
        if reply.get("type") == "error":
            raise EnvironmentServerError(f"{self.url} refused the {message['type']}: {data.get('message')}")
        return data


def is_error(observation: Any) -> bool:
    """An MCP tool's error: the tool missing or refusing its arguments (``error``), or raising
    (its result's ``is_error``)."""
    if not isinstance(observation, dict):
        return False
    result = observation.get("result")
    return bool(observation.get("error")) or (isinstance(result, dict) and result.get("is_error") is True)


def observation_text(observation: Any) -> str:
    """What the policy reads of an OpenEnv observation: an MCP tool's text content (or its error),
    else the observation as JSON."""
    if not isinstance(observation, dict):
        return json.dumps(observation)
    error = observation.get("error")
    if isinstance(error, dict) and error.get("message"):
        return f"error: {error['message']}"
    result = observation.get("result")
    if isinstance(result, dict):
        content = result.get("content") or ()
        texts = [c.get("text", "") for c in content if isinstance(c, dict) and c.get("type") == "text"]
        if texts:
            return "\n".join(texts)
        if "data" in result:
            return result["data"] if isinstance(result["data"], str) else json.dumps(result["data"])
    if "result" in observation:
        return result if isinstance(result, str) else json.dumps(result)
    return json.dumps(observation, sort_keys=True)
