"""``builtin:tiny-agent``: tiny-chat's shape, pre-trained to call a calculator, sometimes.

The calculator example's policy (``examples/cpu-agent-calculator.yaml``). Its problems have
two-digit operands (:data:`~spotrl_runtime.data.word_problems.CALCULATOR_SPLITS`), more than a
model of this size computes reliably in its head. Pre-training shows it both ways to answer:

- half the time, at once, the worked line and ``#### N`` (often wrong once it is on its own);
- half the time, a tool call first, in Qwen2.5's format (``<tool_call>`` JSON with the
  calculator's expression), then, after the tool's answer comes back in a ``<tool_response>``,
  the worked line with that number and ``#### N``.

RL then has one habit to learn: call the calculator. Its template renders a tool message as
Qwen2.5's does (inside a user turn, between ``<tool_response>`` markers), and the markers are
whole tokens that are not special, as in Qwen's tokenizer.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from spotrl_runtime.models.cache import build_once, model_cache_dir
from spotrl_runtime.models.tiny_chat import TinyChatRecipe, build_chat_model

NAME = "tiny-agent"
SYSTEM_PROMPT = 'Solve the problem. You may call the calculator tool. Write the final answer after "####".'
"""The system turn the calculator example sends (and tiny-agent was pre-trained with)."""
TOOL_MARKERS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
"""ChatML, with a tool's answer as Qwen2.5's template writes it."""


@dataclass(frozen=True)
class TinyAgentRecipe(TinyChatRecipe):
    tool_use: float = 0.5
    """Fraction of pre-training problems answered through the calculator."""
    corpus_seed: int = 17
    corpus_rows: int = 8000
    num_layers: int = 3
    pretrain_steps: int = 1500


DEFAULT_RECIPE = TinyAgentRecipe()


def tiny_agent_dir(recipe: TinyAgentRecipe = DEFAULT_RECIPE, cache_dir: Path | None = None) -> Path:
    """The local folder of the built model, building and caching it first if needed."""
    target = (cache_dir or model_cache_dir()) / f"{NAME}-{recipe.key()}"
    return build_once(target, lambda tmp: _build(recipe, tmp))


def tool_call_text(expression: str) -> str:
    """A calculator call as Qwen2.5 writes one."""
    payload = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return f"<tool_call>\n{payload}\n</tool_call>"


def corpus(recipe: TinyAgentRecipe) -> list[tuple[list[dict[str, str]], str]]:
    """(chat turns, assistant reply) pairs: a problem answered through the calculator gives two,
    the call, and the answer after the tool's reply."""
    from spotrl_runtime.data.word_problems import word_problem

    rng = random.Random(recipe.seed)
    pairs = []
    for i in range(recipe.corpus_rows):
        row = word_problem(recipe.corpus_seed, i, digits=2)
        turns = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": row["question"]}]
        work = row["solution"]
        if rng.random() < recipe.tool_use:
            expression = re.search(r"\d+ [-+*] \d+", work).group()  # type: ignore[union-attr]
            call = tool_call_text(expression)
            pairs.append((turns, call))
            answered = [*turns, {"role": "assistant", "content": call}, {"role": "tool", "content": row["answer"]}]
            pairs.append((answered, work))
        else:
            pairs.append((turns, work))
    return pairs


def _build(recipe: TinyAgentRecipe, out_dir: Path) -> None:
    build_chat_model(recipe, out_dir, NAME, corpus(recipe), TOOL_MARKERS, TEMPLATE)
