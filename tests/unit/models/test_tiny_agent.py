"""``builtin:tiny-agent``: tiny-chat's shape with Qwen2.5's tool-call markers as whole tokens
and its way of writing a tool's answer, pre-trained on problems answered at once or through a
calculator call whose expression the calculator answers right."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from transformers import AutoTokenizer

from spotrl_runtime.data.word_problems import held_out
from spotrl_runtime.models.tiny_agent import DEFAULT_RECIPE, SYSTEM_PROMPT, TOOL_MARKERS, corpus, tiny_agent_dir
from spotrl_runtime.rollouts.chat import ObservationRenderer
from spotrl_runtime.rollouts.environments import Calculator
from spotrl_runtime.rollouts.tool_calls import ToolCall

QUICK = dataclasses.replace(DEFAULT_RECIPE, corpus_rows=60, pretrain_steps=2, batch_size=4)


def test_its_corpus_answers_half_through_the_calculator_and_holds_no_test_question() -> None:
    pairs = corpus(DEFAULT_RECIPE)
    calls = [(turns, reply) for turns, reply in pairs if reply.startswith("<tool_call>")]
    answers_after_a_tool = [(turns, reply) for turns, reply in pairs if turns[-1]["role"] == "tool"]
    assert len(calls) == len(answers_after_a_tool)
    assert 0.4 < len(calls) / DEFAULT_RECIPE.corpus_rows < 0.6
    for (turns, call), (after, reply) in zip(calls, answers_after_a_tool, strict=True):
        assert turns[0] == {"role": "system", "content": SYSTEM_PROMPT}
        payload = json.loads(call.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
        answer = Calculator().step(ToolCall(payload["name"], payload["arguments"])).text
        assert after[-1]["content"] == answer, "the calculator answers the corpus' calls as the corpus says"
        assert reply.endswith(f"#### {answer}")
    assert not any(held_out(turns[1]["content"]) for turns, _ in pairs), "the test split is never seen"


def test_a_quick_build_has_qwens_markers_and_tool_template(tmp_path: Path) -> None:
    folder = tiny_agent_dir(QUICK, cache_dir=tmp_path)
    assert folder.name == f"tiny-agent-{QUICK.key()}"
    tok = AutoTokenizer.from_pretrained(folder)
    for marker in TOOL_MARKERS:
        (token,) = tok(marker, add_special_tokens=False)["input_ids"]
        assert tok.decode([token], skip_special_tokens=True) == marker, "a whole token, kept in decoded text"
    observation = tok.decode(list(ObservationRenderer(tok).render([{"role": "tool", "content": "187"}])))
    assert (
        observation == "\n<|im_start|>user\n<tool_response>\n187\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
