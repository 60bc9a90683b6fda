"""A generated turn's tool calls, in the format the policy's chat template writes them.

Parsing is vLLM's (:mod:`vllm.tool_parsers`, the parsers its OpenAI server uses for the same
models): ``hermes`` reads Qwen2.5's and Hermes' ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`` blocks. A turn that opens a call the parser cannot read is *malformed*: the
episode gets an observation saying so (the policy learns from it), never an exception.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, cast

PARSERS = ("hermes",)
"""``spec.environment.toolParser`` values: vLLM tool parsers whose format we have tested."""

_OPENS = {"hermes": "<tool_call>"}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)

    def action(self) -> dict[str, Any]:
        """The call as an environment's action (OpenEnv's ``CallToolAction`` fields)."""
        return {"tool_name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class ParsedTurn:
    """What a turn asked for: its tool calls, or why a call it opened could not be read."""

    calls: tuple[ToolCall, ...] = ()
    malformed: str = ""

    @property
    def wants_tools(self) -> bool:
        return bool(self.calls or self.malformed)


class ToolCallParser:
    """Parses turns with one of vLLM's tool parsers, for ``tokenizer``'s format."""

    def __init__(self, tokenizer: Any, name: str = "hermes") -> None:
        if name not in PARSERS:
            raise ValueError(f"spec.environment.toolParser: {name!r} is not one of {', '.join(PARSERS)}")
        from vllm.tool_parsers import ToolParserManager

        self.name = name
        self._opens = _OPENS[name]
        parser = ToolParserManager.get_tool_parser(name)
        # A policy in training writes malformed calls often; vLLM's parser logs each with its
        # traceback at ERROR. Here one is an observation, and the episode's transcript holds it.
        logging.getLogger(parser.__module__).setLevel(logging.CRITICAL)
        self._parser = parser(tokenizer)

    def parse(self, text: str) -> ParsedTurn:
        """``text``: the turn decoded with its special tokens (a template's call markers may be
        special tokens), the end-of-turn token removed."""
        if self._opens not in text:
            return ParsedTurn()
        # The parsers read the request only for the tools it declares, which ours does not.
        extracted = self._parser.extract_tool_calls(text, request=cast(Any, None))
        if not extracted.tools_called:
            return ParsedTurn(malformed=f"the tool call could not be parsed: {_tail(text)}")
        calls = []
        for call in extracted.tool_calls:
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except ValueError:
                arguments = None
            if not isinstance(arguments, dict):
                return ParsedTurn(malformed=f"the arguments of {call.function.name!r} are not a JSON object")
            calls.append(ToolCall(call.function.name, arguments))
        return ParsedTurn(calls=tuple(calls))


def _tail(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]
