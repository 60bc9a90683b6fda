"""A ChatML tokenizer (tiny-chat's, trained in a second on a few texts) and a scripted engine
for the turn loop's tests, unit and integration (a conftest module's name is shared by every
folder's, and which one ``from conftest import`` finds depends on the order of collection)."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from spotrl_runtime.generation.backend import GenerationBackend
from spotrl_runtime.generation.types import FINISH_LENGTH, FINISH_STOP, GenerationRequest, GroupGenerated, Sample
from spotrl_runtime.models.tiny_chat import build_bpe_tokenizer

TEXTS = [
    'Tom has 3 apples. <tool_call>\n{"name": "calculator", "arguments": {"expression": "3*4"}}\n</tool_call>',
    "The answer is 12.\n#### 12 error: not arithmetic tool assistant user system",
]


def chat_tokenizer() -> Any:
    return build_bpe_tokenizer(TEXTS * 20, 400)


def call(expression: str, name: str = "calculator") -> str:
    """A turn's text that calls a tool in Qwen's (Hermes') format."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": {"expression": expression}}) + "\n</tool_call>"


class ScriptedEngine(GenerationBackend):
    """An engine whose turns are ``script(context text, turn request)``: the text to generate
    (it ends with the end-of-turn token unless it is longer than the request allows). Log-probs
    are -0.5 per token; every call is recorded."""

    def __init__(
        self, tokenizer: Any, script: Callable[[str, GenerationRequest], str], version: int = 3, split: bool = False
    ) -> None:
        """``split``: each character of a turn's text its own token(s), not the tokenizer's
        merges (as a policy may sample): decoding and encoding again gives other tokens."""
        self.tokenizer = tokenizer
        self.script = script
        self.split = split
        self.weight_version = version
        self.requests: list[GenerationRequest] = []
        self.steps = 0

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GroupGenerated]:
        self.steps += 1
        self.requests.extend(requests)
        return [self._group(r) for r in requests]

    def _group(self, request: GenerationRequest) -> GroupGenerated:
        context = self.tokenizer.decode(list(request.prompt_token_ids), skip_special_tokens=False)
        samples = []
        for i in range(request.n):
            text = self.script(context, request if request.n == 1 else _nth(request, i))
            pieces = list(text) if self.split else [text]
            ids = [i for p in pieces for i in self.tokenizer(p, add_special_tokens=False)["input_ids"]]
            ids.append(self.tokenizer.eos_token_id)
            finish = FINISH_STOP
            if len(ids) > request.max_new_tokens:
                ids, finish = ids[: request.max_new_tokens], FINISH_LENGTH
            samples.append(
                Sample(tuple(ids), (-0.5,) * len(ids), finish, self.tokenizer.decode(ids, skip_special_tokens=True))
            )
        return GroupGenerated(request.group_id, request.prompt_token_ids, tuple(samples), self.weight_version)

    def join_channel(self, address: Any) -> None:
        raise NotImplementedError

    def receive_weights(self, plan: Any, version: int) -> int:
        raise NotImplementedError


def _nth(request: GenerationRequest, i: int) -> GenerationRequest:
    """Sample ``i`` of a group's first turn, told apart by its seed in the script."""
    from dataclasses import replace

    return replace(request, seed=request.seed * 100 + i)


def run_group(backend: Any, request: GenerationRequest, seconds: float = 120) -> tuple[GroupGenerated, list[Any]]:
    """Runs one group on a turn loop (:class:`~spotrl_runtime.rollouts.episodes.EpisodeBackend`)
    to its end: (the group, the episode states its finished turns reported, in order)."""
    import time

    from spotrl_runtime.generation.types import TurnsFinished

    backend.start([request])
    states: list[Any] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for outcome in backend.step():
            if isinstance(outcome, TurnsFinished):
                states.append(outcome.episode)
            else:
                assert isinstance(outcome, GroupGenerated), outcome
                return outcome, states
    raise AssertionError(f"group {request.group_id} did not finish within {seconds} s")
