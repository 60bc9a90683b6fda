"""Reading what a newer (or older) version wrote: keep what this version understands, drop the rest.

Status is written by the operator and by the job's controller, which may run another
version of SpotRL than the reader (a rolling upgrade, a rollback). The API models refuse
unknown fields (``extra="forbid"``), right for a spec a user typed, wrong for a status another
version wrote: one new field must not stop a pass, or the daemon would stop handling notices
and the budget would hold every drain. :func:`read_leniently` validates, and on each refusal
drops just the refused part (an unknown key at any depth, a value of an unknown enum member,
an object missing a field this version requires) and tries again. The document it returns is
the one it could read, so a writer diffing against it never erases what it did not understand.

A spec is read more narrowly (:func:`ignoring_unknown`): a newer CRD defaults its new fields into
every stored RLJob, so this version skips the keys it does not know, but a value it cannot read
(an enum member it lacks, a broken rule) stays an error: dropping it would run another job than
the one the user wrote.
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
    """(the model, the part of ``doc`` it was read from, the dotted paths dropped).

    A value this version cannot read inside an object drops the whole object, not the field: the
    field's default would read as something the writer never said (a barrier in a state this
    version does not know must not read as ``Requested``). At the top level the field goes."""
    kept: dict[str, Any] = copy.deepcopy(dict(doc))
    dropped: list[str] = []
    for _ in range(MAX_DROPS):
        try:
            return model.model_validate(kept), kept, dropped
        except ValidationError as err:
            first = max(err.errors(), key=lambda e: len(e["loc"]))  # one at a time: list indices shift
            loc = tuple(first["loc"])
            unreadable = first["type"] not in ("extra_forbidden", "missing") and len(loc) > 1
            where = _drop(kept, loc[:-1] if unreadable else loc)
            if where is None:
                break
            if where not in dropped:
                dropped.append(where)
    return model.model_validate({}), {}, [*dropped, "<everything>"]


def ignoring_unknown(model: type[M], doc: Mapping[str, Any]) -> tuple[M, list[str]]:
    """(the model, the dotted paths of the keys it skipped). Only keys this version does not know
    are skipped; any other refusal raises the :class:`ValidationError` of the rest."""
    kept: dict[str, Any] = copy.deepcopy(dict(doc))
    skipped: list[str] = []
    for _ in range(MAX_DROPS):
        try:
            return model.model_validate(kept), skipped
        except ValidationError as err:
            unknown = {tuple(e["loc"]) for e in err.errors() if e["type"] == "extra_forbidden"}
            if not unknown:
                raise
            for loc in sorted(unknown, key=len, reverse=True):
                where = _drop(kept, loc)
                if where is not None and where not in skipped:
                    skipped.append(where)
    return model.model_validate(kept), skipped


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
        last: Any = loc[-1] if loc else None
        if (isinstance(parent, dict) and last in parent) or (isinstance(parent, list) and _index(parent, last)):
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


def _index(items: list[Any], key: Any) -> bool:
    return isinstance(key, int) and 0 <= key < len(items)
