"""A Parquet file of prompts (GSM8K and MATH ship as Parquet), read a row group at a time.

Row ``idx`` is the row's position in the file. Opening reads the footer only (row count,
row groups); ``dataset[idx]`` reads the one row group that holds ``idx`` and keeps the last
few in memory, so a file of a million rows costs a row group's memory, not the file's. An
``s3://`` file is downloaded once to a local temporary file (removed when the dataset goes)
and memory-mapped from there. A row may carry its own ``idx`` field only if it agrees.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from spotrl_runtime.data.dataset import DatasetError, Row, check_index, from_local_copy, positioned

ROW_GROUPS_KEPT = 4
"""Row groups kept decoded in memory (a shuffled loader visits them in any order)."""


class ParquetDataset:
    """The rows of one Parquet file; see the module's docstring."""

    def __init__(self, path: Path, uri: str):
        import pyarrow as pa
        import pyarrow.parquet as pq

        self.uri = uri
        self.path = path
        """The local file read (an s3:// file's downloaded copy)."""
        try:
            self._file = pq.ParquetFile(path, memory_map=True)
        except (OSError, pa.ArrowException) as err:
            raise DatasetError(f"{uri}: not a Parquet file ({err})") from None
        meta = self._file.metadata
        self._starts = [0]
        for g in range(meta.num_row_groups):
            self._starts.append(self._starts[-1] + meta.row_group(g).num_rows)
        if self._starts[-1] == 0:
            raise DatasetError(f"{uri}: the file has no rows")
        self._groups: OrderedDict[int, list[Row]] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def open(cls, uri: str, **s3_options: str | None) -> ParquetDataset:
        """Opens a Parquet file from a path, ``file://`` or ``s3://`` URI."""
        from spotrl_runtime.storage import LocalStorage, open_object

        storage, key = open_object(uri, **s3_options)
        if isinstance(storage, LocalStorage):
            path = storage.path_of(key)
            if not path.is_file():
                raise DatasetError(f"cannot read dataset {uri}: no such file")
            return cls(path, uri)
        return from_local_copy(
            uri,
            lambda folder: storage.download_file(key, folder / "data.parquet"),
            lambda folder: cls(folder / "data.parquet", uri),
        )

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, idx: int) -> Row:
        check_index(self, idx)
        group = bisect.bisect_right(self._starts, idx) - 1
        return positioned(self.uri, dict(self._group(group)[idx - self._starts[group]]), idx)

    def _group(self, group: int) -> list[Row]:
        with self._lock:
            rows = self._groups.get(group)
            if rows is not None:
                self._groups.move_to_end(group)
                return rows
            rows = _plain(self._file.read_row_group(group).to_pylist())
            self._groups[group] = rows
            while len(self._groups) > ROW_GROUPS_KEPT:
                self._groups.popitem(last=False)
            return rows


def _plain(rows: list[dict[str, Any]]) -> list[Row]:
    """Rows as JSON would give them (a row's fingerprint is its canonical JSON): bytes decoded."""
    return [{k: v.decode("utf-8", "replace") if isinstance(v, bytes) else v for k, v in r.items()} for r in rows]
