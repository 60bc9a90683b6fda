"""An OpenEnv environment server for the tests, run in a virtual environment of its own with
``openenv-core`` (its web UI's dependencies clash with ours, as a user's server image would not):
``python openenv_ledger_server.py PORT``. An MCP environment with one stateful tool: ``add``
adds to a running total (reset to the seed's last digit) and answers with the new total, so an
episode's later answers depend on its earlier calls, and a restored environment must replay them."""

from __future__ import annotations

import sys
from typing import Any

import uvicorn
from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Observation, State


class LedgerEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # one session an episode, many episodes at once

    def __init__(self) -> None:
        mcp = FastMCP("ledger")
        self.total = 0
        self._state = State(episode_id=None, step_count=0)

        @mcp.tool
        def add(amount: int) -> str:
            """Adds ``amount`` to the running total; returns the total."""
            self.total += int(amount)
            return f"total {self.total}"

        super().__init__(mcp)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        self.total = (seed or 0) % 10
        self._state = State(episode_id=episode_id, step_count=0)
        return Observation(done=False, reward=None, metadata={"total": self.total})

    def _step_impl(self, action: Any, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=None, metadata={"error": f"unknown action {type(action).__name__}"})

    @property
    def state(self) -> State:
        return self._state


app = create_fastapi_app(LedgerEnvironment, CallToolAction, CallToolObservation, max_concurrent_envs=64)

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
