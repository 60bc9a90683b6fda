"""The turn loop around a real engine (transformers, tiny-chat): a job with an environment
whose policy calls no tool generates exactly what the job without one does, in both dtypes."""

from __future__ import annotations

import pytest

from spotrl_runtime.api.rljob import Environment
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.data.word_problems import word_problem
from spotrl_runtime.generation.backend import BackendSpec
from spotrl_runtime.generation.rollouts import encode_prompt
from spotrl_runtime.generation.types import GenerationRequest
from spotrl_runtime.generation.worker import build_backend
from spotrl_runtime.rollouts.episodes import EpisodeBackend


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_episodes_that_call_no_tool_are_the_single_turn_samples(dtype: str) -> None:
    spec = BackendSpec(kind="transformers", model="builtin:tiny-chat", dtype=dtype, torch_threads=2)
    plain = build_backend(spec)
    episodes = build_backend(BackendSpec(**{**spec.__dict__, "environment": Environment(name="builtin:calculator")}))
    assert isinstance(episodes, EpisodeBackend)
    assert episodes.limits.max_model_len == 256, "the model's positions bound an episode"
    requests = [
        GenerationRequest(
            f"g{i}",
            encode_prompt(plain.tokenizer, Prompt(i, "w", word_problem(3, i)["question"]), chat=True),  # type: ignore[attr-defined]
            n=3,
            max_new_tokens=48,
            seed=i,
        )
        for i in range(3)
    ]
    want = plain.generate(requests)
    got = episodes.generate(requests)
    assert [g.samples for g in got] == [w.samples for w in want]
    assert all(s.observed == () for g in got for s in g.samples)
    assert sum(len(s.completion_token_ids) for g in got for s in g.samples) > 50
