"""Reading what a newer (or older) version wrote: keep what this version understands, drop the rest.

Status is written by the operator and by the job's controller, which may run another
version of SpotRL than the reader (a rolling upgrade, a rollback). The API models refuse
unknown fields (``extra="forbid"``), right for a spec a user typed, wrong for a status another
version wrote: one new field must not stop a pass, or the daemon would stop handling notices
and the budget would hold every drain. :func:`read_leniently` validates, and on each refusal
drops just the refused part (an unknown key at any depth, a value of an unknown enum member,
an object missing a field this version requires) and tries again. The document it returns is
the one it could read, so a writer diffing against it never erases what it did not understand.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

M = TypeVar("M", bound=BaseModel)
MAX_DROPS = 50
"""Refusals dropped before giving up on the document (then it reads as empty)."""


def read_leniently(model: type[M], doc: Mapping[str, Any]) -> tuple[M, dict[str, Any], list[str]]:
    """(the model, the part of ``doc`` it was read from, the dotted paths dropped)."""
    kept: dict[str, Any] = copy.deepcopy(dict(doc))
    dropped: list[str] = []
    for _ in range(MAX_DROPS):
        try:
            return model.model_validate(kept), kept, dropped
        except ValidationError as err:
            for loc in sorted({tuple(e["loc"]) for e in err.errors()}, key=len, reverse=True):
                where = _drop(kept, loc)
                if where is not None and where not in dropped:
                    dropped.append(where)
            if not dropped:
                break
    return model.model_validate({}), {}, [*dropped, "<everything>"]


def _drop(doc: dict[str, Any], loc: tuple[Any, ...]) -> str | None:
    """Removes the deepest existing part of ``doc`` along ``loc``'s path that holds the refusal;
    returns its dotted path (None: nothing there any more)."""
    parent: Any = doc
    existing: list[Any] = []
    for key in loc[:-1]:
        try:
            parent = parent[key]
        except (KeyError, IndexError, TypeError):
            break
        existing.append(key)
    else:
        last = loc[-1] if loc else None
        if isinstance(parent, dict) and last in parent:
            del parent[last]
            return ".".join(map(str, loc))
    # The refused key is missing (a required field), or the path ends early: drop its holder.
    if not existing:
        return None
    holder: Any = doc
    for key in existing[:-1]:
        holder = holder[key]
    if isinstance(holder, dict | list):
        del holder[existing[-1]]
    return ".".join(map(str, existing))
