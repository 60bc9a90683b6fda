"""The turn loop on a scripted engine: a sample that calls a tool becomes an episode whose
observations are appended token for token, whose turns run on the group's weights with their
own seeds, bounded by the environment's limits, with every tool failure an observation."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from spotrl_e2e.scripted_engine import ScriptedEngine, call
from spotrl_runtime.generation.types import (
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationRequest,
    GroupFailed,
    TurnsFinished,
)
from spotrl_runtime.rollouts.chat import ObservationRenderer
from spotrl_runtime.rollouts.environments import Calculator
from spotrl_runtime.rollouts.episodes import EpisodeBackend, EpisodeLimits, turn_seed
from spotrl_runtime.rollouts.protocol import Observation
from spotrl_runtime.rollouts.tool_calls import ToolCall


def _request(tokenizer: Any, n: int = 2, max_new_tokens: int = 64, seed: int = 11) -> GenerationRequest:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tom has 3 apples"}], add_generation_prompt=True
    )
    ids = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
    return GenerationRequest("g1", tuple(ids), n=n, max_new_tokens=max_new_tokens, seed=seed)


def _calls_then_answers(context: str, request: GenerationRequest) -> str:
    """Sample 0 (seed 1100) calls the calculator once, then answers with what it got; sample 1 answers at once."""
    if "tool\n" in context:
        return "The answer is " + context.rsplit("tool\n", 1)[1].split("<|im_end|>")[0] + "."
    return call("3*4") if request.seed == 1100 else "The answer is 7."


def _backend(tokenizer: Any, script: Any, split: bool = False, **limits: Any) -> tuple[EpisodeBackend, ScriptedEngine]:
    engine = ScriptedEngine(tokenizer, script, split=split)
    return EpisodeBackend(engine, tokenizer, Calculator, EpisodeLimits(**limits)), engine


def test_a_tool_call_becomes_an_episode_of_turns_and_observations(chat_tokenizer: Any) -> None:
    backend, engine = _backend(chat_tokenizer, _calls_then_answers, split=True)
    request = _request(chat_tokenizer, max_new_tokens=256)
    (group,) = backend.generate([request])
    episode, single = group.samples
    assert group.weight_version == 3
    assert backend.unfinished() == 0

    first, second = engine.requests
    assert (first.n, first.seed) == (2, 11), "the group's first turn is its own request, unchanged"
    assert second.n == 1
    assert second.seed == turn_seed(11, 0, 1)
    (span,) = episode.observed
    observation = ObservationRenderer(chat_tokenizer).render([{"role": "tool", "content": "12"}])
    assert episode.completion_token_ids[span[0] : span[1]] == observation
    assert second.prompt_token_ids == request.prompt_token_ids + episode.completion_token_ids[: span[1]], (
        "the next turn's prompt is the context token for token"
    )
    assert episode.logprobs[span[0] : span[1]] == (0.0,) * len(observation)
    assert all(lp == -0.5 for k, lp in enumerate(episode.logprobs) if not span[0] <= k < span[1])
    assert "The answer is 12." in episode.text
    assert episode.finish_reason == FINISH_STOP
    assert single.observed == (), "no call: a one-turn episode"
    assert single.text.startswith("The answer is 7.")


def test_an_episode_without_a_call_is_the_engines_sample_unchanged(chat_tokenizer: Any) -> None:
    backend, engine = _backend(chat_tokenizer, lambda context, request: "The answer is 7.")
    (group,) = backend.generate([_request(chat_tokenizer)])
    (alone,) = engine.generate([_request(chat_tokenizer)])
    assert group.samples == alone.samples


def test_the_engine_never_waits_on_one_episodes_tool(chat_tokenizer: Any) -> None:
    """Group a's tool blocks until group b has run three turns on the engine."""
    release = threading.Event()
    released: list[bool] = []

    class Slow(Calculator):
        def step(self, call: ToolCall) -> Observation:
            if call.arguments["expression"] == "1+1":
                released.append(release.wait(5))
            return super().step(call)

    def script(context: str, request: GenerationRequest) -> str:
        turns = context.count("tool\n")
        if "apples" in context:
            return call("1+1") if turns == 0 else "done"
        if turns == 3:
            release.set()
            return "done"
        return call("2+2")

    engine = ScriptedEngine(chat_tokenizer, script)
    backend = EpisodeBackend(engine, chat_tokenizer, Slow, EpisodeLimits())
    a = _request(chat_tokenizer, n=1)
    b = replace(
        a, group_id="g2", prompt_token_ids=tuple(chat_tokenizer("pears", add_special_tokens=False)["input_ids"])
    )
    groups = {g.group_id: g for g in backend.generate([a, b])}
    assert released == [True], "the engine ran group b's turns while group a's tool was busy"
    assert [len(groups[g].samples[0].observed) for g in ("g1", "g2")] == [1, 3]


@pytest.mark.parametrize(
    ("limits", "turns", "finish"),
    [
        ({"max_turns": 3}, 3, FINISH_LENGTH),
        ({"max_episode_tokens": 120}, None, FINISH_LENGTH),
        ({"max_model_len": 150}, None, FINISH_LENGTH),
        ({"max_episode_seconds": 0.0}, 1, FINISH_LENGTH),
    ],
    ids=["max-turns", "max-episode-tokens", "max-model-len", "max-episode-seconds"],
)
def test_an_episode_that_would_run_on_ends_at_its_limit(
    chat_tokenizer: Any, limits: dict[str, Any], turns: int | None, finish: str
) -> None:
    backend, engine = _backend(chat_tokenizer, lambda context, request: call("1+1"), **limits)
    request = _request(chat_tokenizer, n=1)
    (group,) = backend.generate([request])
    (sample,) = group.samples
    assert sample.finish_reason == finish
    if turns is not None:
        assert len(sample.observed) == turns - 1
        assert len(engine.requests) == turns
    assert len(sample.completion_token_ids) <= limits.get("max_episode_tokens", 10**9)
    if "max_model_len" in limits:
        assert len(request.prompt_token_ids) + len(sample.completion_token_ids) <= limits["max_model_len"]
        assert all(len(r.prompt_token_ids) + r.max_new_tokens <= limits["max_model_len"] for r in engine.requests)


class Broken(Calculator):
    def step(self, call: ToolCall) -> Observation:
        if call.arguments["expression"] == "crash":
            raise RuntimeError("segfault in the tool")
        if call.arguments["expression"] == "hang":
            time.sleep(3)
        if call.arguments["expression"] == "huge":
            return Observation("x" * 10**7)
        return super().step(call)


@pytest.mark.parametrize(
    ("expression", "observed"),
    [
        ("crash", "error: calculator raised RuntimeError: segfault in the tool"),
        ("hang", "error: the tool did not answer within 0.2 s"),
        ("nonsense(", "error: "),
        ("huge", "x\n[9991808 more characters left out]"),
    ],
    ids=["tool-raises", "tool-hangs", "tool-errors", "tool-floods"],
)
def test_a_tools_failure_is_an_observation_and_the_episode_goes_on(
    chat_tokenizer: Any, expression: str, observed: str
) -> None:
    def script(context: str, request: GenerationRequest) -> str:
        return "gave up" if "tool\n" in context else call(expression)

    engine = ScriptedEngine(chat_tokenizer, script)
    backend = EpisodeBackend(engine, chat_tokenizer, Broken, EpisodeLimits(tool_seconds=0.2, max_episode_tokens=20000))
    (group,) = backend.generate([_request(chat_tokenizer, n=1)])
    (sample,) = group.samples
    (span,) = sample.observed
    text = chat_tokenizer.decode(list(sample.completion_token_ids[span[0] : span[1]]))
    assert observed in text
    assert sample.text.endswith("gave up")
    assert sample.finish_reason == FINISH_STOP
    errors = 0 if expression == "huge" else 1  # a huge answer is an answer, not an error
    assert (group.episodes.tool_calls, group.episodes.tool_errors) == (1, errors)


def test_a_malformed_call_is_an_observation(chat_tokenizer: Any) -> None:
    def script(context: str, request: GenerationRequest) -> str:
        return "sorry" if "tool\n" in context else "<tool_call>\n{oops}\n</tool_call>"

    backend, _ = _backend(chat_tokenizer, script)
    (group,) = backend.generate([_request(chat_tokenizer, n=1)])
    assert "error: the tool call could not be parsed" in group.samples[0].text


def test_a_turn_on_other_weights_fails_its_group(chat_tokenizer: Any) -> None:
    backend, engine = _backend(chat_tokenizer, _calls_then_answers)
    backend.start([_request(chat_tokenizer)])
    outcomes: list[Any] = []
    while not outcomes:
        outcomes = [o for o in backend.step() if not isinstance(o, TurnsFinished)]
        engine.weight_version = 4
    (failed,) = outcomes
    assert isinstance(failed, GroupFailed)
    assert "a turn ran on version 4, its group on 3" in failed.error
    assert backend.unfinished() == 0


def test_abort_returns_every_unfinished_group_and_closes_their_environments(chat_tokenizer: Any) -> None:
    closed: list[str] = []

    class Tracked(Calculator):
        def close(self) -> None:
            closed.append("closed")

    engine = ScriptedEngine(chat_tokenizer, lambda context, request: call("1+1"))
    backend = EpisodeBackend(engine, chat_tokenizer, Tracked, EpisodeLimits())
    backend.start([_request(chat_tokenizer), replace(_request(chat_tokenizer), group_id="g2")])
    for _ in range(3):
        backend.step()
    assert sorted(backend.abort()) == ["g1", "g2"]
    assert backend.unfinished() == 0
    assert closed
    assert len(closed) == 4
    assert backend.step() == []
