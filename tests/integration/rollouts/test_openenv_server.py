"""The turn loop against a real OpenEnv environment server (``openenv-core``'s app and MCP
environment, served by uvicorn in a process and virtual environment of its own): each episode
holds one session whose state carries across its turns; a resumed episode's session is rebuilt
by replaying its action log against a fresh session, and goes on to the same episode; a tool the
server lacks is an observation; a server that is not there fails the group, naming it, within
the bound."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from spotrl_e2e.openenv_server import serving
from spotrl_e2e.procs import free_port
from spotrl_e2e.scripted_engine import ScriptedEngine, chat_tokenizer, run_group
from spotrl_runtime.core.types import EpisodeState
from spotrl_runtime.generation.types import GenerationRequest, GroupFailed, GroupGenerated, TurnsFinished
from spotrl_runtime.rollouts.environments import make_environment
from spotrl_runtime.rollouts.episodes import EpisodeBackend, EpisodeLimits, turn_seed

SERVER = Path(__file__).with_name("openenv_ledger_server.py")
CALLS = 3


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving(SERVER, tmp_path_factory.mktemp("openenv") / "server.log") as address:
        yield address


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return chat_tokenizer()


def _tool(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _adds(context: str, request: GenerationRequest) -> str:
    """Adds 2 to the ledger CALLS times, then answers with the last total it read."""
    answers = context.count("tool\n")
    if answers < CALLS:
        return _tool("add", amount=2)
    return "The answer is " + context.rsplit("tool\n", 1)[1].split("<|im_end|>")[0] + "."


def _backend(tokenizer: Any, url: str, script: Any = _adds, seconds: float = 30) -> EpisodeBackend:
    engine = ScriptedEngine(tokenizer, script)
    limits = EpisodeLimits(max_episode_tokens=1024, tool_seconds=seconds)
    return EpisodeBackend(engine, tokenizer, lambda: make_environment("openenv", url, seconds), limits, name="openenv")


def _request(tokenizer: Any, n: int = 2) -> GenerationRequest:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Add it up"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return GenerationRequest("g1", tuple(ids), n=n, max_new_tokens=64, seed=5)


def _episodes(
    tokenizer: Any, url: str, request: GenerationRequest, script: Any = _adds
) -> tuple[GroupGenerated, list[EpisodeState]]:
    """Runs ``request`` on a fresh turn loop against the server, closing the loop after."""
    backend = _backend(tokenizer, url, script)
    try:
        return run_group(backend, request)
    finally:
        backend.close()


def _totals(text: str) -> list[int]:
    return [int(part.split()[0].rstrip(".")) for part in text.split("total ")[1:]]


def test_each_episode_holds_one_session_whose_state_carries_across_turns(tokenizer: Any, url: str) -> None:
    group, states = _episodes(tokenizer, url, _request(tokenizer))
    for index, sample in enumerate(group.samples):
        start = turn_seed(5, index, 0) % 10  # the server resets its total to the seed's last digit
        assert _totals(sample.text) == [start + 2, start + 4, start + 6, start + 6], sample.text
        assert len(sample.observed) == CALLS
    assert sorted((s.index, s.turns) for s in states) == [(i, t) for i in (0, 1) for t in (1, 2, 3)]


def test_a_resumed_episode_replays_its_actions_into_a_fresh_session(tokenizer: Any, url: str) -> None:
    whole, states = _episodes(tokenizer, url, _request(tokenizer))
    state = next(s for s in states if s.index == 1 and s.turns == 2)
    resumed, _ = _episodes(tokenizer, url, replace(_request(tokenizer, n=1), indexes=(1,), resume=(state,)))
    assert resumed.samples == (whole.samples[1],), "the replayed session is where the episode left it"
    assert (resumed.episodes.turns_resumed, resumed.episodes.episodes_restarted) == (2, 0)


def test_a_tool_the_server_lacks_is_an_observation(tokenizer: Any, url: str) -> None:
    def script(context: str, request: GenerationRequest) -> str:
        return "Done." if "tool\n" in context else _tool("subtract", amount=1)

    group, _ = _episodes(tokenizer, url, _request(tokenizer, n=1), script)
    assert "error: Unknown tool: 'subtract'" in group.samples[0].text
    assert (group.episodes.tool_calls, group.episodes.tool_errors) == (1, 1)
    assert group.samples[0].text.rstrip().endswith("Done.")


def test_a_server_that_is_not_there_fails_the_group_within_the_bound(tokenizer: Any) -> None:
    """Not the policy's doing, so not an observation to train on: the group fails (the job retries
    or drops it), naming the server."""

    def script(context: str, request: GenerationRequest) -> str:
        return "Done." if "tool\n" in context else _tool("add", amount=1)

    address = f"http://127.0.0.1:{free_port()}"
    backend = _backend(tokenizer, address, script, seconds=2)
    started = time.monotonic()
    try:
        backend.start([_request(tokenizer, n=2)])
        outcomes: list[Any] = []
        while not outcomes and time.monotonic() - started < 30:
            outcomes = [o for o in backend.step() if not isinstance(o, TurnsFinished)]
    finally:
        backend.close()
    (failed,) = outcomes
    assert isinstance(failed, GroupFailed)
    assert "the environment did not start" in failed.error
    assert f"could not open a session at {address.replace('http', 'ws')}/ws" in failed.error
    assert backend.unfinished() == 0
