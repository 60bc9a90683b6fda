"""Episodes on vLLM's CPU build: tiny-agent's turns, the calculator's answers between them, each
later turn a request of its own beside the others (the engine's continuous batching), in float32
and bf16. Every generated token's log-prob from the engine is the trainer's for the same
sequence (its observations as context, left out of the trained tokens): what vLLM generated
each turn from is exactly the context the trainer scores, token for token."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_vllm_cpu import pytestmark  # noqa: F401  (the same skip)
from vllm_cpu import cpu_engine

from spotrl_runtime.api.rljob import Environment
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.data.word_problems import split_rows
from spotrl_runtime.generation import GenerationRequest
from spotrl_runtime.generation.rollouts import encode_prompt
from spotrl_runtime.generation.vllm_backend import VLLMBackend
from spotrl_runtime.models import load_policy
from spotrl_runtime.models.tiny_agent import SYSTEM_PROMPT
from spotrl_runtime.rewards.builtin import gsm8k
from spotrl_runtime.rollouts.episodes import EpisodeBackend
from spotrl_runtime.training import logprobs as lp
from spotrl_runtime.training import precision
from spotrl_runtime.training.rows import generated_values

GAP_BOUND = {"float32": 1e-4, "bfloat16": 0.25}
"""As test_vllm_cpu.py's and test_vllm_cpu_bf16.py's bounds for single-turn samples."""


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def episodes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EpisodeBackend]:
    engine = cpu_engine(tmp_path_factory, "builtin:tiny-agent", request.param)
    environment = Environment(name="builtin:calculator", maxTurns=3, maxEpisodeTokens=160)
    backend = EpisodeBackend.from_spec(engine, environment, max_model_len=None)
    try:
        yield backend
    finally:
        backend.close()


def test_vllm_episodes_call_the_tool_and_the_trainer_scores_their_tokens_alike(episodes: EpisodeBackend) -> None:
    assert isinstance(episodes.inner, VLLMBackend)
    dtype = episodes.inner.llm.llm_engine.model_config.dtype
    name = str(dtype).removeprefix("torch.")
    rows = split_rows("test", 2)[:12]
    prompts = [Prompt(i, r["task_name"], r["question"], r["answer"]) for i, r in enumerate(rows)]
    tokenizer: Any = episodes.tokenizer
    requests = [
        GenerationRequest(
            f"g{p.idx}", encode_prompt(tokenizer, p, chat=True, system_prompt=SYSTEM_PROMPT), 4, 48, seed=p.idx
        )
        for p in prompts
    ]
    groups = episodes.generate(requests)
    assert episodes.limits.max_model_len == 256, "the engine's context bounds an episode"
    pairs = [(p, g.prompt_token_ids, s) for p, g in zip(prompts, groups, strict=True) for s in g.samples]
    with_tools = [(p, s) for p, _, s in pairs if s.observed]
    assert len(with_tools) >= len(pairs) // 4, "tiny-agent calls the calculator in about half its answers"
    for _, s in with_tools:
        for start, end in s.observed:
            assert "<tool_response>" in tokenizer.decode(list(s.completion_token_ids[start:end]))
            assert set(s.logprobs[start:end]) == {0.0}
    right = sum(gsm8k(p, s.text) for p, s in with_tools) / len(with_tools)
    assert right > 0.7, f"through the calculator, answers are right ({right:.2f})"

    model, _ = load_policy("builtin:tiny-agent", "cpu", dtype="float32")
    batch = lp.token_batch(
        [(prompt, s.completion_token_ids) for _, prompt, s in pairs], 0, "cpu", observed=[s.observed for *_, s in pairs]
    )
    with torch.no_grad(), precision.autocast("cpu", dtype):
        trainer, _ = lp.call(model, batch, 1.0)
    engine = torch.tensor([x for *_, s in pairs for x in generated_values(s.logprobs, s.observed)])
    gap = float((engine - trainer).abs().max())
    print(f"{name}: {len(with_tools)}/{len(pairs)} episodes called the tool; worst log-prob gap {gap:.2e}")
    assert gap < GAP_BOUND[name]
