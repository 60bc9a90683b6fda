"""A JSONL file of prompts, from a local path or an s3:// URI (read through the storage interface).

Row ``idx`` is the 0-based position among the file's non-empty lines. A row may carry its
own ``idx`` field only if it agrees, so an ``idx`` always names one row of this file.
"""

from __future__ import annotations

import json

from spotrl_runtime.data.dataset import DatasetError, Row, check_index


class JsonlDataset:
    """All rows of one JSONL file, parsed once when opened."""

    def __init__(self, rows: list[Row], uri: str):
        self._rows = rows
        self.uri = uri

    @classmethod
    def from_bytes(cls, data: bytes, uri: str) -> JsonlDataset:
        """Parses JSONL content; errors name the line."""
        rows: list[Row] = []
        for lineno, line in enumerate(data.decode("utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DatasetError(f"{uri}: line {lineno} is not JSON ({err.msg})") from None
            if not isinstance(row, dict):
                raise DatasetError(f"{uri}: line {lineno} is not a JSON object")
            idx = len(rows)
            if "idx" in row and row["idx"] != idx:
                raise DatasetError(
                    f"{uri}: line {lineno} has idx {row['idx']!r} but is row {idx}; "
                    "idx must be the row's position among non-empty lines (or be left out)"
                )
            row["idx"] = idx
            rows.append(row)
        if not rows:
            raise DatasetError(f"{uri}: the file has no rows")
        return cls(rows, uri)

    @classmethod
    def open(cls, uri: str, **s3_options: str | None) -> JsonlDataset:
        """Reads a JSONL file from a path, ``file://`` or ``s3://`` URI."""
        from spotrl_runtime.storage import StorageError, open_object

        storage, key = open_object(uri, **s3_options)
        try:
            data = storage.get_bytes(key)
        except StorageError as err:
            raise DatasetError(f"cannot read dataset {uri}: {err}") from None
        return cls.from_bytes(data, uri)

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, idx: int) -> Row:
        check_index(self, idx)
        return dict(self._rows[idx])
