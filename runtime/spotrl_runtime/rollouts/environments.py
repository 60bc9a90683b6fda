"""The built-in environments, and :func:`make_environment`, the one way to get an episode's.

They implement the protocol of :mod:`.protocol`: OpenEnv's per-turn one (``reset(seed,
episode_id)``, then ``step(action)`` until ``done``), which our turn loop drives instead of an
environment's own rollout loop: the loop owns generation, the weight version and the seeds, so
that each turn can be recorded.
An action is a tool call (OpenEnv's ``CallToolAction``: a tool's name and its arguments); an
observation is what the policy reads next (a tool message), with an optional reward and
``done``. A tool that raises, or is not there, answers with an error observation: the episode
goes on, and the policy learns from it.

Built in (``spec.environment.name``):

- ``builtin:calculator``: one tool, ``calculator(expression)``, exact arithmetic on integers
  and decimals (``+ - * / // % **`` and parentheses), evaluated from the expression's syntax
  tree (never ``eval``). No reward of its own: the job's reward scores the episode.

``openenv``: an OpenEnv environment server at ``spec.environment.url``, one session an episode
(:mod:`.openenv`).
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from spotrl_runtime.rollouts.protocol import Environment, Observation
from spotrl_runtime.rollouts.tool_calls import ToolCall


class Calculator:
    """``builtin:calculator``: exact arithmetic, one expression a call."""

    TOOL = "calculator"
    MAX_EXPONENT = 64
    MAX_DIGITS = 40

    def reset(self, seed: int, episode_id: str) -> None:
        """Stateless: every episode is the same calculator."""

    def step(self, call: ToolCall) -> Observation:
        if call.name != self.TOOL:
            return Observation(
                f"error: there is no tool {call.name!r}; the one tool is {self.TOOL}(expression)", error=True
            )
        expression = call.arguments.get("expression")
        if not isinstance(expression, str) or not expression.strip():
            return Observation('error: calculator takes {"expression": "<arithmetic>"}', error=True)
        try:
            return Observation(_number(_evaluate(ast.parse(expression.strip(), mode="eval").body)))
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError) as err:
            return Observation(f"error: {err or type(err).__name__}", error=True)

    def close(self) -> None:
        """Nothing to release."""


_BINARY: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: lambda a, b: Fraction(a // b),
    ast.Mod: operator.mod,
}


def _evaluate(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        base, exponent = _evaluate(node.left), _evaluate(node.right)
        if exponent.denominator != 1 or abs(exponent) > Calculator.MAX_EXPONENT:
            raise ValueError(f"exponents are whole numbers up to {Calculator.MAX_EXPONENT}")
        return Fraction(base ** int(exponent))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError(f"not arithmetic: {ast.unparse(node)[:60]}")


def _number(value: Fraction) -> str:
    """An exact result as a whole number or a decimal (10 places at most, trailing zeros off)."""
    if len(str(abs(value.numerator))) > Calculator.MAX_DIGITS:
        raise OverflowError(f"the result has more than {Calculator.MAX_DIGITS} digits")
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.10f}".rstrip("0").rstrip(".")
    return text if text not in ("-0", "") else "0"


BUILTIN: dict[str, Callable[[], Any]] = {"builtin:calculator": Calculator}
SERVED = ("openenv",)
"""Environments served by a server of their own at ``spec.environment.url``."""


def make_environment(name: str, url: str | None = None, seconds: float = 60.0) -> Environment:
    """A fresh environment for one episode (``spec.environment.name``; a served one at ``url``,
    each of its waits bounded by ``seconds``)."""
    if name == "openenv":
        from spotrl_runtime.rollouts.openenv import OpenEnvSession

        if not url:
            raise ValueError("spec.environment.url: an openenv environment needs its server's address")
        return OpenEnvSession(url, seconds)
    factory = BUILTIN.get(name)
    if factory is None:
        raise ValueError(f"spec.environment.name: {name!r} is not one of {', '.join(sorted([*BUILTIN, *SERVED]))}")
    env: Environment = factory()
    return env
