"""Where a job's cuts live in its store, and how to find the newest committed one.

::

    <job root>/
      LATEST.json                         pointer to the newest committed cut (a hint; updated
                                          only after that cut's manifest exists)
      cuts/0000000007/manifest.json       the commit: written last, create-only
      cuts/0000000007/w3-1a2b3c4d/...     the cut's files, under its writer's fresh folder
      audit/...                           the controller's audit records, one per trained
                                          step and attempt (spotrl_runtime.controller)

Cut ids are zero-padded sequence numbers, so key order is commit order. A folder under
``cuts/`` without a manifest is a torn cut: it does not exist as a cut.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from spotrl_runtime.core.cut_format import MANIFEST_NAME
from spotrl_runtime.storage import ObjectNotFoundError, Storage

CUTS = "cuts"
POINTER = "LATEST.json"
AUDIT = "audit"
"""Prefix of the controller's audit records (one object per trained step and attempt)."""


def cut_id_of(seq: int) -> str:
    """The id of the ``seq``-th cut."""
    return f"{seq:010d}"


def seq_of(cut_id: str) -> int | None:
    """The sequence number in a cut id, or None if it is not one."""
    return int(cut_id) if cut_id.isdigit() else None


def cut_dir(cut_id: str) -> str:
    """The cut's folder key."""
    return f"{CUTS}/{cut_id}"


def manifest_key(cut_id: str) -> str:
    """The cut's manifest key."""
    return f"{CUTS}/{cut_id}/{MANIFEST_NAME}"


@dataclass(frozen=True)
class CutFolder:
    """One folder under ``cuts/``: committed (it has a manifest) or torn (it does not)."""

    cut_id: str
    committed: bool
    keys: tuple[str, ...]
    size: int


def list_cut_folders(storage: Storage) -> list[CutFolder]:
    """Every cut folder in the store, oldest first."""
    found: dict[str, list[tuple[str, int]]] = {}
    for info in storage.list(f"{CUTS}/"):
        parts = info.key.split("/")
        if len(parts) >= 3 and seq_of(parts[1]) is not None:
            found.setdefault(parts[1], []).append((info.key, info.size))
    out = []
    for cut_id in sorted(found, key=lambda c: seq_of(c) or 0):
        keys = found[cut_id]
        committed = any(k == manifest_key(cut_id) for k, _ in keys)
        out.append(CutFolder(cut_id, committed, tuple(k for k, _ in keys), sum(s for _, s in keys)))
    return out


def newest_committed(storage: Storage) -> str | None:
    """The id of the newest cut that has a manifest, or None (the listing is the truth, not the pointer)."""
    committed = [f.cut_id for f in list_cut_folders(storage) if f.committed]
    return committed[-1] if committed else None


def read_pointer(storage: Storage) -> dict[str, Any] | None:
    """The LATEST.json pointer, or None when there is none (or it is unreadable)."""
    try:
        data = json.loads(storage.get_bytes(POINTER))
    except (ObjectNotFoundError, ValueError):
        return None
    return data if isinstance(data, dict) else None
