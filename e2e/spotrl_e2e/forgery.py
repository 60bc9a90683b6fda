"""Forging cuts for tests: edit a committed local cut in place and keep its manifest consistent
(sizes, sha256 digests and, when asked, group counts recomputed), the way a buggy writer or
an attacker would leave it, so that only the check under test can catch the edit."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from spotrl_runtime.core.cut_format import (
    OWNER_FILES,
    decode_owner_files,
    decode_rollouts,
    document_counts,
    encode_rollouts,
)
from spotrl_runtime.core.ledger import LedgerRecord


class CutSurgery:
    """One committed cut folder (``<root>/cuts/<id>``) of a local store, edited in place."""

    def __init__(self, cut: Path):
        self.cut = cut
        self.manifest_path = cut / "manifest.json"
        self.m: dict[str, Any] = json.loads(self.manifest_path.read_text())

    @classmethod
    def only_cut(cls, root: Path) -> CutSurgery:
        """The store's one cut."""
        (cut,) = sorted((root / "cuts").iterdir())
        return cls(cut)

    def path(self, role: str) -> Path:
        (entry,) = [f for f in self.m["files"] if f["role"] == role]
        return self.cut / entry["path"]

    def json(self, role: str) -> Any:
        return json.loads(self.path(role).read_bytes())

    def save_manifest(self) -> None:
        self.manifest_path.write_text(json.dumps(self.m))

    def replace(self, role: str, data: bytes, *, fix_counts: bool = False) -> None:
        """New content for a file, its size and digest in the manifest updated to match (and
        the group counts recomputed from the owner files with ``fix_counts``)."""
        self.path(role).write_bytes(data)
        for f in self.m["files"]:
            if f["role"] == role:
                f.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
        if fix_counts:
            docs = decode_owner_files({r: self.path(r).read_bytes() for r in OWNER_FILES})
            docs = replace(docs, ledger=tuple(LedgerRecord.from_json(x) for x in docs.ledger_raw))
            self.m["group_counts"] = document_counts(docs)
        self.save_manifest()

    def edit_json(self, role: str, change: Callable[[Any], None], *, fix_counts: bool = False) -> None:
        doc = self.json(role)
        change(doc)
        self.replace(role, json.dumps(doc).encode(), fix_counts=fix_counts)


# ------------------------------------------------------------- delta cuts: one invariant each


def delta_base(delta: CutSurgery) -> CutSurgery:
    """The full cut a delta extends, beside it in the same store."""
    return CutSurgery(delta.cut.parent / delta.m["base"]["cut_id"])


def rebase(delta: CutSurgery) -> None:
    """The delta records its base's manifest as it now is (the digest recomputed)."""
    delta.m["base"]["manifest_sha256"] = hashlib.sha256(delta_base(delta).manifest_path.read_bytes()).hexdigest()
    delta.save_manifest()


def drop_a_redo_step(delta: CutSurgery) -> None:
    """``redo_steps``: the first redo step gone."""
    delta.edit_json("redo_index", lambda d: d["steps"].pop(0))


def drop_a_redo_row(delta: CutSurgery) -> None:
    """``redo_rows``: one row of a redo group gone."""
    rows = decode_rollouts(delta.path("redo_rows").read_bytes())
    first = next(iter(rows))
    rows[first] = rows[first][:-1]
    delta.replace("redo_rows", encode_rollouts(list(rows.items())))


def swap_two_redo_groups(delta: CutSurgery) -> None:
    """``redo_audit``: the first redo step's first two groups in the other order."""

    def swap(doc: Any) -> None:
        groups = doc["steps"][0]["groups"]
        groups[0], groups[1] = groups[1], groups[0]

    delta.edit_json("redo_index", swap)


def remove_the_base(delta: CutSurgery) -> None:
    """``delta_base``: the base's manifest gone (it no longer exists as a cut)."""
    delta_base(delta).manifest_path.unlink()


def edit_the_base(delta: CutSurgery) -> None:
    """``delta_base``: the base's manifest changed after the delta recorded its digest."""
    base = delta_base(delta)
    base.m["created_at"] = "2020-01-01T00:00:00.000+00:00"
    base.save_manifest()


def base_of_another_job(delta: CutSurgery) -> None:
    """``delta_base``: a base of another job, its digest recorded anew."""
    base = delta_base(delta)
    base.m["job"] = "another/job"
    base.save_manifest()
    rebase(delta)


def base_refused_by_its_chain(delta: CutSurgery) -> None:
    """``delta_base``: a base whose loader position its own chain refuses, digests recomputed."""
    delta_base(delta).edit_json("loader", lambda d: d.update(_num_yielded=d["_num_yielded"] + 1))
    rebase(delta)
