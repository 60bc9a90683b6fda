"""``builtin:calculator``: exact arithmetic from the expression's syntax tree; anything else is
an error observation, never code run."""

from __future__ import annotations

import pytest

from spotrl_runtime.rollouts.environments import Calculator, make_environment
from spotrl_runtime.rollouts.tool_calls import ToolCall


def _run(expression: object, name: str = "calculator") -> str:
    env = make_environment("builtin:calculator")
    env.reset(seed=1, episode_id="g/0")
    return env.step(ToolCall(name, {"expression": expression})).text


@pytest.mark.parametrize(
    ("expression", "result"),
    [
        ("3*4", "12"),
        ("(17 - 5) / 4", "3"),
        ("7 / 4", "1.75"),
        ("1/3", "0.3333333333"),
        ("-2**3 + 7 % 4", "-5"),
        ("0.1+0.2", "0.3"),
        ("9 // 2", "4"),
    ],
)
def test_arithmetic_is_exact(expression: str, result: str) -> None:
    assert _run(expression) == result


@pytest.mark.parametrize(
    ("expression", "why"),
    [
        ("__import__('os').system('id')", "not arithmetic"),
        ("open('/etc/passwd')", "not arithmetic"),
        ("1/0", "error: "),
        ("2**1000", "exponents are whole numbers up to 64"),
        ("10**30 * 10**30", "more than 40 digits"),
        ("3 +", "error: "),
        ("", 'calculator takes {"expression"'),
        (12, 'calculator takes {"expression"'),
    ],
)
def test_anything_else_is_an_error_observation(expression: object, why: str) -> None:
    text = _run(expression)
    assert text.startswith("error: ")
    assert why in text


def test_an_unknown_tool_or_environment_is_named() -> None:
    assert "there is no tool 'search'" in _run("1", name="search")
    with pytest.raises(ValueError, match=r"spec\.environment\.name: 'builtin:web'"):
        make_environment("builtin:web")
    assert isinstance(make_environment("builtin:calculator"), Calculator)
