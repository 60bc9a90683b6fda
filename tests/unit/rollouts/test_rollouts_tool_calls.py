"""Tool calls in the chat template's format (Qwen's and Hermes' ``<tool_call>`` JSON), parsed by
vLLM's parser; a call that cannot be read is reported, to become an observation."""

from __future__ import annotations

from typing import Any

import pytest

from spotrl_e2e.scripted_engine import call
from spotrl_runtime.rollouts.tool_calls import ToolCall, ToolCallParser


@pytest.fixture(scope="module")
def parser(chat_tokenizer: Any) -> ToolCallParser:
    return ToolCallParser(chat_tokenizer)


def test_a_turn_without_a_call_asks_for_nothing(parser: ToolCallParser) -> None:
    parsed = parser.parse("The answer is 12.\n#### 12")
    assert not parsed.wants_tools
    assert parsed.calls == ()


def test_calls_are_read_in_order_with_their_arguments(parser: ToolCallParser) -> None:
    parsed = parser.parse("Let me compute. " + call("3*4") + "\n" + call("12+1"))
    assert parsed.calls == (
        ToolCall("calculator", {"expression": "3*4"}),
        ToolCall("calculator", {"expression": "12+1"}),
    )
    assert not parsed.malformed


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("<tool_call>\n{not json}\n</tool_call>", "could not be parsed"),
        ('<tool_call>\n{"name": "calculator"}\n</tool_call>', "could not be parsed"),
        ('<tool_call>\n{"name": "calculator", "arguments": "3*4"}\n</tool_call>', "not a JSON object"),
        ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "3*', "could not be parsed"),
    ],
    ids=["not-json", "no-arguments", "arguments-a-string", "cut-off"],
)
def test_a_malformed_call_is_reported_not_raised(parser: ToolCallParser, text: str, why: str) -> None:
    parsed = parser.parse(text)
    assert parsed.wants_tools
    assert parsed.calls == ()
    assert why in parsed.malformed


def test_an_unknown_parser_is_refused_by_its_field(chat_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match=r"spec\.environment\.toolParser: 'xml'"):
        ToolCallParser(chat_tokenizer, "xml")
