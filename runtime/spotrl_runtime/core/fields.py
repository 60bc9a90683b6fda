"""Strict readers of persisted JSON fields: every error names the field and what was found."""

from __future__ import annotations

from typing import Any


class RecordFormatError(ValueError):
    """A persisted record that is not well formed; the message names the field."""


def require_str(data: dict[str, Any], key: str, *, allow_empty: bool = False) -> str:
    """``data[key]`` as a string (non-empty unless ``allow_empty``)."""
    value = data.get(key, "" if allow_empty else None)
    if not isinstance(value, str) or (not value and not allow_empty):
        raise RecordFormatError(f"{key} must be a non-empty string, got {value!r}")
    return value


def require_int(data: dict[str, Any], key: str, *, minimum: int = 0) -> int:
    """``data[key]`` as an integer >= ``minimum`` (booleans are not integers here)."""
    if key not in data:
        raise RecordFormatError(f"{key} is missing")
    value = data[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise RecordFormatError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return value


def optional_int(data: dict[str, Any], key: str, *, minimum: int = 0) -> int | None:
    """``data[key]`` as an integer >= ``minimum``, or None (the key must be present)."""
    if key not in data:
        raise RecordFormatError(f"{key} is missing")
    if data[key] is None:
        return None
    return require_int(data, key, minimum=minimum)
