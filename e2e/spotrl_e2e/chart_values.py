"""The chart's values as Helm checks them, without Helm: charts/spotrl/values.yaml under its
values.schema.json, a user's values merged over the defaults first (as ``helm template``,
``install`` and ``lint`` merge them), and ``--set`` flags read into values. The docs tests check
every values example and ``--set`` on the pages this way; tests/e2e/test_chart.py has Helm
itself refuse what the schema refuses.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from functools import cache
from typing import Any

import jsonschema
import yaml

from spotrl_e2e.tools import REPO_ROOT

CHART = REPO_ROOT / "charts" / "spotrl"
VALUES = CHART / "values.yaml"
SCHEMA = CHART / "values.schema.json"


@cache
def defaults() -> dict[str, Any]:
    return dict(yaml.safe_load(VALUES.read_text()))


@cache
def schema() -> dict[str, Any]:
    return dict(json.loads(SCHEMA.read_text()))


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base`` as Helm coalesces values: maps merge key by key, anything else
    replaces, and a null removes the default."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def errors(values: dict[str, Any]) -> list[str]:
    """What the schema refuses in ``values`` merged over values.yaml, each as ``at /path:
    message``, the way Helm names them."""
    checked = merged(defaults(), values)
    validator = jsonschema.Draft7Validator(schema())
    return [
        f"at /{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in sorted(validator.iter_errors(checked), key=lambda e: list(map(str, e.absolute_path)))
    ]


_SET_FLAG = re.compile(r"--set(-string)?[ =]((?:[^\s=\\]|\\.)+)=(\S*)")


def set_flags(line: str) -> Iterator[tuple[str, Any]]:
    """``(key, value)`` of each ``--set KEY=VALUE`` (or ``--set-string``) in a command line, the
    value typed as Helm types it: true/false, an integer, null, else a string."""
    for match in _SET_FLAG.finditer(line):
        as_string, key, text = match.groups()
        text = text.strip("\"'")
        value: Any = text
        if not as_string:
            if text in ("true", "false"):
                value = text == "true"
            elif text == "null":
                value = None
            elif re.fullmatch(r"-?(0|[1-9][0-9]*)", text):
                value = int(text)
        yield key, value


def set_values(key: str, value: Any) -> dict[str, Any]:
    """The values one ``--set key=value`` gives: ``a.b\\.c=v`` is ``{a: {"b.c": v}}``; ``a[0]``
    an item of a list."""
    out: Any = value
    for part in reversed(re.split(r"(?<!\\)\.", key)):
        name, index = re.fullmatch(r"(.*?)(?:\[(\d+)\])?", part.replace("\\.", ".")).groups()  # type: ignore[union-attr]
        if index is not None:
            out = [None] * int(index) + [out]
        out = {name: out}
    return dict(out)
