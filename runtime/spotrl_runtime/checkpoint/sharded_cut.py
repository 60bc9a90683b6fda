"""A sharded (``dcp/v1``) cut as restore hands it on, and the error that names one of its files.
Apart from :mod:`spotrl_runtime.checkpoint.sharded`, which imports ``torch.distributed.checkpoint``
(a second or so of CPU): a controller that resumes from a single-process cut never loads it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class ShardError(ValueError):
    """A file of a sharded cut is not what the manifest says (not listed, missing, another size
    or digest), or matches it and still does not load. ``file`` names it, relative to the cut's
    data folder (``trainer/dcp/__0_0.distcp``), or is None."""

    def __init__(self, message: str, file: str | None = None):
        super().__init__(message)
        self.file = file

    def __reduce__(self) -> tuple[Any, ...]:
        # Crosses processes intact (DCP gathers the ranks' failures; Ray returns a rank's).
        return (type(self), (str(self), self.file))


@dataclass(frozen=True)
class ShardedCut:
    """A ``dcp/v1`` cut's trainer state, as restore hands it to the trainer (not loaded yet)."""

    storage_uri: str
    folder: str
    """``cuts/<id>/<data_dir>``, relative to the job's storage root."""
    files: Mapping[str, tuple[int, str]]
    """Every trainer file the manifest lists: name (relative to ``folder``) -> (size, sha256)."""
    meta: Mapping[str, Any]
    """``trainer/meta.json``: ``trainer_step``, ``world_size`` ..."""
