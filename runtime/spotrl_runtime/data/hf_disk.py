"""A folder that Hugging Face ``datasets`` wrote with ``save_to_disk``, read with pyarrow.

``Dataset.save_to_disk`` writes ``state.json`` (the Arrow files in order, ``_data_files``),
``dataset_info.json`` and the rows as Arrow IPC streams (``data-00000-of-0000N.arrow``);
``DatasetDict.save_to_disk`` writes ``dataset_dict.json`` (``{"splits": [...]}``) and one such
folder per split, chosen by ``spec.dataset.split``. Every file is memory-mapped when the
dataset opens (its rows are counted from the stream's batch headers; nothing is copied), so a
large dataset costs the pages its rows touch, not its size. Row ``idx`` is the row's position across the files,
in ``state.json``'s order; a row may carry its own ``idx`` only if it agrees.

An ``s3://bucket/prefix/`` folder is downloaded once into a temporary folder (removed when
the dataset goes). The ``datasets`` library is not needed to read it.
"""

from __future__ import annotations

import bisect
import json
from pathlib import Path
from typing import Any

from spotrl_runtime.data.dataset import DatasetError, Row, check_index, from_local_copy, positioned

DICT_FILE = "dataset_dict.json"
STATE_FILE = "state.json"


def local_folder(uri: str) -> Path | None:
    """The local path a path or ``file://`` URI names (None for another scheme)."""
    if uri.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(uri).path))
    return None if "://" in uri else Path(uri)


def is_saved_folder(path: Path) -> bool:
    """A folder ``save_to_disk`` wrote: a ``Dataset``'s or a ``DatasetDict``'s."""
    return (path / STATE_FILE).is_file() or (path / DICT_FILE).is_file()


def is_hf_disk_uri(uri: str) -> bool:
    """A ``save_to_disk`` folder: a local folder, or an ``s3://`` URI that ends with ``/``."""
    if uri.startswith("s3://"):
        return uri.endswith("/")
    local = local_folder(uri)
    return local is not None and local.is_dir()


class HFDiskDataset:
    """The rows of one ``save_to_disk`` folder (one split of a ``DatasetDict``)."""

    def __init__(self, folder: Path, uri: str, split: str = "train"):
        self.uri = uri
        if (folder / DICT_FILE).is_file():
            splits = _json(folder / DICT_FILE, uri).get("splits")
            if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
                raise DatasetError(f"{uri}: {DICT_FILE} has no list of splits")
            if split not in splits:
                raise DatasetError(
                    f"{uri} holds the splits {splits}, not {split!r}; set spec.dataset.split to one of them"
                )
            folder = folder / split
        state = _json(folder / STATE_FILE, uri)
        files = state.get("_data_files")
        if not isinstance(files, list) or not files:
            raise DatasetError(f"{uri}: {STATE_FILE} lists no data files (_data_files)")
        self.files: list[Path] = []
        for entry in files:
            name = entry.get("filename") if isinstance(entry, dict) else None
            if not isinstance(name, str) or "/" in name or name.startswith("."):
                raise DatasetError(f"{uri}: {STATE_FILE} has a data file entry {entry!r} without a plain filename")
            if not (folder / name).is_file():
                raise DatasetError(f"{uri}: {name}, listed in {STATE_FILE}, is missing")
            self.files.append(folder / name)
        self._tables = [self._map(f) for f in self.files]
        self._starts = [0]
        for table in self._tables:
            self._starts.append(self._starts[-1] + table.num_rows)
        if self._starts[-1] == 0:
            raise DatasetError(f"{uri}: the dataset has no rows")

    @classmethod
    def open(cls, uri: str, split: str = "train", **s3_options: str | None) -> HFDiskDataset:
        """Opens a folder by path, ``file://`` or ``s3://bucket/prefix/`` URI."""
        from spotrl_runtime.storage import download_prefix, open_storage

        if not uri.startswith("s3://"):
            local = local_folder(uri)
            if local is None or not local.is_dir():
                raise DatasetError(f"cannot read dataset {uri}: no such folder")
            return cls(local, uri, split)
        storage = open_storage(uri.rstrip("/"), **s3_options)

        def download(folder: Path) -> None:
            if download_prefix(storage, folder) == 0:
                raise DatasetError(f"cannot read dataset {uri}: no objects under it")

        return from_local_copy(uri, download, lambda folder: cls(folder, uri, split))

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, idx: int) -> Row:
        check_index(self, idx)
        f = bisect.bisect_right(self._starts, idx) - 1
        return positioned(self.uri, self._tables[f].slice(idx - self._starts[f], 1).to_pylist()[0], idx)

    def _map(self, path: Path) -> Any:
        import pyarrow as pa

        try:
            return pa.ipc.open_stream(pa.memory_map(str(path))).read_all()
        except (OSError, pa.ArrowException) as err:
            raise DatasetError(f"{self.uri}: {path.name} is not an Arrow stream ({err})") from None


def _json(path: Path, uri: str) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise DatasetError(f"{uri}: no {path.name}; give a folder written by datasets' save_to_disk") from None
    except (OSError, ValueError) as err:
        raise DatasetError(f"{uri}: {path.name} is not JSON ({err})") from None
    if not isinstance(doc, dict):
        raise DatasetError(f"{uri}: {path.name} is not a JSON object")
    return doc
