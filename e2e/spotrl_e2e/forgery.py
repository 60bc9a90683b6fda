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

from spotrl_runtime.core.cut_format import OWNER_FILES, decode_owner_files, document_counts
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
