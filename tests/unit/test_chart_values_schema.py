"""charts/spotrl/values.schema.json, which helm lint, template, install and upgrade check values
against: it types every value of values.yaml, refuses a key the chart does not have at every
level (but in the maps it says are open), and refuses a value of the wrong type, naming where.
Helm applying it: tests/e2e/test_chart.py; the docs' values checked by it: tests/unit/test_docs.py.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from spotrl_e2e import chart_values
from spotrl_operator.settings import FINALIZER_SECONDS_MAX
from spotrl_runtime.api import reference

UNKNOWN = "notAValue"
Path = tuple[str | int, ...]


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = chart_values.schema()["definitions"][node["$ref"].rsplit("/", 1)[1]]
    return node


def _node(path: Path) -> dict[str, Any]:
    """The schema of the value at ``path`` (a key declared, or an open map's values)."""
    node = _resolve(chart_values.schema())
    for part in path:
        if isinstance(part, int):
            node = node["items"]
        elif part in node.get("properties", {}):
            node = node["properties"][part]
        else:
            node = node["additionalProperties"]
        node = _resolve(node)
    return node


def _walk(value: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Every value under ``value`` (maps and lists, and what they hold), with its path."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield (*path, key), child
        yield from _walk(child, (*path, key))


def _with(path: Path, change: Any) -> dict[str, Any]:
    """values.yaml with the value at ``path`` replaced by ``change(value)``."""
    values = copy.deepcopy(chart_values.defaults())
    parent: Any = values
    for part in path[:-1]:
        parent = parent[part]
    parent[path[-1]] = change(parent[path[-1]])
    return values


def _at(path: Path) -> str:
    return "at /" + "/".join(map(str, path)) + ":"


def test_the_schema_types_every_value_of_values_yaml_and_has_no_other() -> None:
    """The values the reference page lists (docs/reference/operator.md, from values.yaml's
    comments) are the schema's: each declared with a type and a description, and the schema
    has no top-level value the chart lacks."""
    rows = reference.helm_values(chart_values.VALUES.read_text())
    assert len(rows) >= 60, "values.yaml lost its values, or helm_values lost track of them"
    for dotted, _, _ in rows:
        node = _node(tuple(dotted.split(".")))
        assert "type" in node, f"{dotted}: no type in values.schema.json"
        if "." not in dotted:
            assert node.get("description"), f"{dotted}: no description in values.schema.json"
    assert set(chart_values.schema()["properties"]) == set(chart_values.defaults())
    assert chart_values.errors({}) == [], "values.yaml's own defaults pass"
    assert chart_values.schema()["properties"]["finalizerSeconds"]["maximum"] == FINALIZER_SECONDS_MAX


def test_every_object_of_the_schema_refuses_unknown_keys_or_says_why_it_is_open() -> None:
    def objects(node: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
        if isinstance(node, dict):
            if node.get("type") == "object":
                yield where, node
            for key, child in node.items():
                yield from objects(child, f"{where}/{key}")

    found = list(objects(chart_values.schema(), ""))
    assert len(found) >= 30
    for where, node in found:
        assert "additionalProperties" in node, f"{where}: says nothing of unknown keys (JSON Schema then allows them)"
        if node["additionalProperties"] is not False:
            assert "Open" in node.get("description", ""), f"{where}: open to any key without saying why"


def test_every_level_of_the_values_refuses_a_key_the_chart_does_not_have() -> None:
    """A misspelt key, at the top or inside any section (and inside a list's objects), is
    refused naming it; only a map the schema declares open (runtimeEnv, nodeSelector ...) takes it."""
    levels = [()] + [path for path, value in _walk(chart_values.defaults()) if isinstance(value, dict)]
    assert len(levels) >= 25
    problems = []
    for path in levels:
        values = _with(path, lambda d: {**d, UNKNOWN: "x"}) if path else {**chart_values.defaults(), UNKNOWN: "x"}
        refused = [e for e in chart_values.errors(values) if e.startswith(_at(path)) and f"'{UNKNOWN}'" in e]
        if _node(path)["additionalProperties"] is False and not refused:
            problems.append(f"/{'/'.join(map(str, path))}: {UNKNOWN} accepted")
    assert not problems, "\n".join(problems)


WRONG = {bool: "yes", int: "two", float: "two", str: True, list: "x", dict: "x"}
"""A value of another type for a default of each type: a string where a boolean or a number
belongs (--set-string, or a quoted YAML value), a boolean for a string, a scalar for a list or a
section."""


def test_every_value_refuses_a_value_of_the_wrong_type() -> None:
    leaves = list(_walk(chart_values.defaults()))
    assert len(leaves) >= 80
    problems = []
    for path, value in leaves:
        errors = chart_values.errors(_with(path, lambda v: WRONG[type(v)]))
        if not any(e.startswith(_at(path)) for e in errors):
            problems.append(f"/{'/'.join(map(str, path))}: {WRONG[type(value)]!r} accepted for {value!r}")
    assert not problems, "\n".join(problems)
