"""Observations rendered by the policy's own chat template, to follow a generated turn."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from spotrl_runtime.rollouts.chat import ObservationRenderer


def test_an_observation_is_the_templates_text_between_two_assistant_turns(chat_tokenizer: Any) -> None:
    tokens = ObservationRenderer(chat_tokenizer).render([{"role": "tool", "content": "12"}])
    assert chat_tokenizer.decode(list(tokens)) == "\n<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    conversation = [
        {"role": "user", "content": "Tom has 3 apples"},
        {"role": "assistant", "content": "calling"},
        {"role": "tool", "content": "12"},
    ]
    whole = chat_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert whole.endswith("<|im_end|>" + chat_tokenizer.decode(list(tokens))), "what the template writes after a turn"


def test_a_template_that_rewrites_history_is_refused(chat_tokenizer: Any) -> None:
    """A template that renders an assistant turn differently once a tool message follows it (as
    templates that drop earlier reasoning do) cannot be appended to token for token."""
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = (
        "{%- for m in messages -%}"
        "{%- if m['role'] == 'assistant' and not loop.last -%}{{ '<|im_start|>assistant\\n(earlier)<|im_end|>\\n' }}"
        "{%- else -%}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif -%}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
    )
    with pytest.raises(ValueError, match="renders earlier turns differently"):
        ObservationRenderer(tokenizer).render([{"role": "tool", "content": "12"}])


def test_a_model_without_a_chat_template_is_refused(chat_tokenizer: Any) -> None:
    tokenizer = copy.deepcopy(chat_tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match=r"spec\.environment needs a chat model"):
        ObservationRenderer(tokenizer)
