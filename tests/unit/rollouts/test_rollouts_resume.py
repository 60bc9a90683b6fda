"""Turn-level durability in the turn loop: every finished turn is reported with its action log;
a request that carries an episode's state continues it from its last finished turn with the
seeds it had and an environment restored by replay; an environment that does not replay (or
another one, or a forged log) restarts the episode from turn 0, counted."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import pytest

from spotrl_e2e.scripted_engine import ScriptedEngine, call, run_group
from spotrl_runtime.core.types import EpisodeState, ToolTurn
from spotrl_runtime.generation.types import GenerationRequest, GroupGenerated, TurnsFinished
from spotrl_runtime.rollouts.action_log import digest
from spotrl_runtime.rollouts.chat import ObservationRenderer
from spotrl_runtime.rollouts.environments import Calculator
from spotrl_runtime.rollouts.episodes import EpisodeBackend, EpisodeLimits, turn_seed
from spotrl_runtime.rollouts.protocol import Observation
from spotrl_runtime.rollouts.tool_calls import ToolCall

CALLS = 3


def _request(tokenizer: Any, n: int = 2) -> GenerationRequest:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Tom has 3 apples"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    return GenerationRequest("g1", tuple(ids), n=n, max_new_tokens=64, seed=11)


def _three_calls(context: str, request: GenerationRequest) -> str:
    """Calls the calculator CALLS times (each on what it got), then answers; the seed of each
    turn is in its text, so a turn generated with another seed shows."""
    answers = context.count("tool\n")
    if answers < CALLS:
        got = context.rsplit("tool\n", 1)[1].split("<|im_end|>")[0] if answers else "3"
        return f"seed {request.seed % 97} " + call(f"{got}+1")
    return "The answer is " + context.rsplit("tool\n", 1)[1].split("<|im_end|>")[0] + "."


def _backend(tokenizer: Any, environment: Any = Calculator, name: str = "builtin:calculator") -> EpisodeBackend:
    engine = ScriptedEngine(tokenizer, _three_calls)
    return EpisodeBackend(engine, tokenizer, environment, EpisodeLimits(max_episode_tokens=1024), name=name)


def test_every_finished_turn_is_reported_with_its_action_log(chat_tokenizer: Any) -> None:
    group, states = run_group(_backend(chat_tokenizer), _request(chat_tokenizer))
    assert [(s.index, s.turns) for s in states] == [(0, 1), (1, 1), (0, 2), (1, 2), (0, 3), (1, 3)]
    assert (group.episodes.tool_calls, group.episodes.tool_errors) == (2 * CALLS, 0)
    assert group.episodes.environment_seconds > 0
    renderer = ObservationRenderer(chat_tokenizer)
    for state in states:
        sample = group.samples[state.index]
        assert sample.completion_token_ids[: len(state.completion_token_ids)] == state.completion_token_ids
        assert state.observed == sample.observed[: state.turns]
        assert state.observed[-1][1] == len(state.completion_token_ids), "a state ends with its observation"
        assert state.weight_version == 3
        assert state.environment == "builtin:calculator"
    last = states[-2]
    assert [a.calls for a in last.actions] == [
        (("calculator", '{"expression": "3+1"}'),),
        (("calculator", '{"expression": "4+1"}'),),
        (("calculator", '{"expression": "5+1"}'),),
    ]
    assert last.actions[1].digest == digest([Observation("5")])
    tail = last.completion_token_ids[last.observed[-1][0] :]
    assert tail == tuple(renderer.render([{"role": "tool", "content": "6"}]))


@pytest.mark.parametrize("turns", [1, 2, 3])
def test_a_resumed_episode_is_the_episode_that_would_have_run(chat_tokenizer: Any, turns: int) -> None:
    whole, states = run_group(_backend(chat_tokenizer), _request(chat_tokenizer))
    state = next(s for s in states if s.index == 1 and s.turns == turns)
    backend = _backend(chat_tokenizer)
    engine = backend.inner
    assert isinstance(engine, ScriptedEngine)
    resumed, _ = run_group(backend, replace(_request(chat_tokenizer, n=1), indexes=(1,), resume=(state,)))
    assert resumed.samples == (whole.samples[1],), "the same tokens, log-probs, spans and text"
    assert (resumed.episodes.turns_resumed, resumed.episodes.episodes_restarted) == (turns, 0)
    first = engine.requests[0]
    assert first.seed == turn_seed(11, 1, turns), "it goes on with the seed its next turn had"
    assert first.prompt_token_ids == whole.prompt_token_ids + state.completion_token_ids
    assert len(engine.requests) == CALLS + 1 - turns, "no finished turn is generated again"


def test_a_group_with_a_finished_rollout_and_a_resumed_episode(chat_tokenizer: Any) -> None:
    """A group sent again for rollouts 1 and 3: 3 resumes, 1 starts with its own seeds."""
    whole, states = run_group(_backend(chat_tokenizer), _request(chat_tokenizer, n=4))
    state = next(s for s in states if s.index == 3 and s.turns == 2)
    backend = _backend(chat_tokenizer)
    again = replace(_request(chat_tokenizer, n=2), indexes=(1, 3), resume=(state,))
    resumed, _ = run_group(backend, again)
    assert resumed.samples[1] == whole.samples[3]
    assert len(resumed.samples) == 2
    assert resumed.episodes.turns_resumed == 2
    assert isinstance(backend.inner, ScriptedEngine)
    fresh = backend.inner.requests[0]
    assert (fresh.n, fresh.indexes) == (1, (1,)), "only the episode without finished turns starts at turn 0"


class _Drifting(Calculator):
    """A calculator whose answers change with each instance: it does not replay."""

    instances = itertools.count()

    def reset(self, seed: int, episode_id: str) -> None:
        super().reset(seed, episode_id)
        self.offset = next(self.instances)

    def step(self, call: ToolCall) -> Observation:
        answer = super().step(call)
        return replace(answer, text=f"{answer.text} (run {self.offset})")


def _restarted(chat_tokenizer: Any, state: EpisodeState, backend: EpisodeBackend) -> GroupGenerated:
    resumed, _ = run_group(backend, replace(_request(chat_tokenizer, n=1), indexes=(0,), resume=(state,)))
    assert (resumed.episodes.turns_resumed, resumed.episodes.episodes_restarted) == (0, 1)
    assert isinstance(backend.inner, ScriptedEngine)
    first = backend.inner.requests[0]
    assert first.prompt_token_ids == _request(chat_tokenizer).prompt_token_ids, "from turn 0"
    turns = len(resumed.samples[0].observed) + 1
    assert len(backend.inner.requests) == turns, "every turn of it generated again"
    return resumed


def test_an_environment_that_does_not_replay_restarts_its_episode_from_turn_0(chat_tokenizer: Any) -> None:
    _, states = run_group(_backend(chat_tokenizer, _Drifting), _request(chat_tokenizer))
    _restarted(chat_tokenizer, states[-2], _backend(chat_tokenizer, _Drifting))


def test_a_forged_or_foreign_action_log_restarts_its_episode(chat_tokenizer: Any) -> None:
    _, states = run_group(_backend(chat_tokenizer), _request(chat_tokenizer))
    state = next(s for s in states if s.index == 0 and s.turns == 2)
    forged = replace(state, actions=(state.actions[0], ToolTurn(state.actions[1].calls, digest([Observation("7")]))))
    _restarted(chat_tokenizer, forged, _backend(chat_tokenizer))
    _restarted(chat_tokenizer, replace(state, environment="builtin:other"), _backend(chat_tokenizer))


def test_a_replay_that_hangs_is_bounded(chat_tokenizer: Any) -> None:
    import threading

    release = threading.Event()

    class Stuck(Calculator):
        def step(self, call: ToolCall) -> Observation:
            release.wait(30)
            return super().step(call)

    _, states = run_group(_backend(chat_tokenizer), _request(chat_tokenizer))
    engine = ScriptedEngine(chat_tokenizer, lambda context, request: "The answer is 7.")
    backend = EpisodeBackend(engine, chat_tokenizer, Stuck, EpisodeLimits(tool_seconds=0.2), name="builtin:calculator")
    try:
        state = next(s for s in states if s.index == 0 and s.turns == 1)
        resumed, _ = run_group(backend, replace(_request(chat_tokenizer, n=1), indexes=(0,), resume=(state,)))
        assert resumed.episodes.episodes_restarted == 1
    finally:
        release.set()
        backend.close()


def test_a_request_refuses_an_episode_that_is_not_one_of_its_samples(chat_tokenizer: Any) -> None:
    _, states = run_group(_backend(chat_tokenizer), _request(chat_tokenizer))
    with pytest.raises(ValueError, match="not one of its samples"):
        replace(_request(chat_tokenizer, n=1), indexes=(1,), resume=(states[0],))
    with pytest.raises(ValueError, match="indexes for"):
        replace(_request(chat_tokenizer, n=2), indexes=(1,))


def test_a_worker_streams_the_turns_beside_its_groups(chat_tokenizer: Any) -> None:
    """Through a generation worker: each finished turn comes back from ``collect``, stamped with
    the worker, before its group; a turn is not an outcome (the worker's count of unfinished
    groups, which a weight load waits on, ends at 0)."""
    import time

    from spotrl_runtime.generation import BackendSpec
    from spotrl_runtime.generation.worker import GenerationWorker

    worker = GenerationWorker(BackendSpec(kind="transformers", model="scripted"), "w7", _backend(chat_tokenizer))
    try:
        worker.submit(0, [_request(chat_tokenizer)])
        got: list[Any] = []
        deadline = time.monotonic() + 60
        while not any(isinstance(o, GroupGenerated) for o in got):
            assert time.monotonic() < deadline, got
            got.extend(worker.collect(timeout=0.5))
        turns = [o for o in got if isinstance(o, TurnsFinished)]
        assert len(turns) == 2 * CALLS
        assert {o.worker for o in got} == {"w7"}
        assert isinstance(got[-1], GroupGenerated)
        assert worker._unfinished == 0
    finally:
        worker.stop()
