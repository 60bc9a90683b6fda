"""The prompt source's contract: a map-style dataset whose rows carry a stable ``idx``.

``dataset[idx]`` must name the same row for the life of a run: that is what lets the
ledger persist only locators and rebuild every prompt on restore. Shuffling changes the
order rows are visited, never which row an ``idx`` names.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

Row = dict[str, Any]
"""One dataset row: its fields, plus ``idx`` (its position) and, by convention, ``task_name``."""


class DatasetError(ValueError):
    """A dataset that cannot be read, or a row that lacks what the run needs."""


@runtime_checkable
class PromptDataset(Protocol):
    """A map-style dataset: ``len()`` rows, each returned by ``dataset[idx]`` with its ``idx``."""

    uri: str
    """Where the rows come from (a path, an s3:// URI or ``builtin:<name>``)."""

    def __len__(self) -> int: ...

    def __getitem__(self, idx: int) -> Row: ...


def check_index(dataset: PromptDataset, idx: int) -> None:
    """Raises IndexError for an idx outside the dataset (negative indexes are not locators)."""
    if not isinstance(idx, int) or isinstance(idx, bool) or not 0 <= idx < len(dataset):
        raise IndexError(f"idx {idx!r} is outside dataset {dataset.uri} (rows 0..{len(dataset) - 1})")


def positioned(uri: str, row: Row, idx: int) -> Row:
    """``row`` with its ``idx`` set to its position; a row that carries its own ``idx`` must
    agree (a file whose rows were reordered after their idx was written is refused)."""
    if "idx" in row and row["idx"] != idx:
        raise DatasetError(
            f"{uri}: row {idx} has idx {row['idx']!r}; idx must be the row's position in the dataset (or be left out)"
        )
    row["idx"] = idx
    return row


D = TypeVar("D")


def from_local_copy(uri: str, download: Callable[[Path], object], read: Callable[[Path], D]) -> D:
    """A dataset read from a local copy of a remote one: ``download`` fills a fresh temporary
    folder, ``read`` opens the dataset there. The folder goes when the dataset does, or at once
    when either fails; a storage failure is a :class:`DatasetError` naming ``uri``."""
    from spotrl_runtime.storage import StorageError

    folder = tempfile.mkdtemp(prefix="spotrl-dataset-")
    try:
        download(Path(folder))
        dataset = read(Path(folder))
    except StorageError as err:
        shutil.rmtree(folder, ignore_errors=True)
        raise DatasetError(f"cannot read dataset {uri}: {err}") from None
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    weakref.finalize(dataset, shutil.rmtree, folder, True)
    return dataset
