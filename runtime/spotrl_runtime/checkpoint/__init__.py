"""Cuts: the one writer (periodic and barrier), the layout in a store, and the restore.

The names below are imported on first use (PEP 562), not with the package: the writer and
the restore import torch, and the modules that only read a store (``layout``, ``reader``,
``ownership``, ``precheck``) must not pay for it. That is what lets a controller refuse a
resume before it starts anything (:mod:`~spotrl_runtime.checkpoint.precheck`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = [
    "BarrierDeadlineMissedError",
    "CommittedCut",
    "CutConflictError",
    "CutError",
    "CutRequest",
    "CutWriter",
    "DatasetLookup",
    "NoCommittedCutError",
    "RestoredRun",
    "TorchSaveFormat",
    "TrainerSnapshot",
    "capture_rng",
    "list_cut_folders",
    "newest_committed",
    "read_pointer",
    "restore_cut",
    "restore_rng",
    "snapshot_trainer",
    "start_or_restore",
    "validate_stored_cut",
]

# Where the names above live, the light module first.
_MODULES = ("layout", "restore", "trainer_state", "writer")


def __getattr__(name: str) -> Any:
    if name in __all__:
        for module in _MODULES:
            found = getattr(importlib.import_module(f"{__name__}.{module}"), name, None)
            if found is not None:
                globals()[name] = found
                return found
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:
    from spotrl_runtime.checkpoint.layout import list_cut_folders, newest_committed, read_pointer
    from spotrl_runtime.checkpoint.restore import (
        DatasetLookup,
        NoCommittedCutError,
        RestoredRun,
        restore_cut,
        start_or_restore,
        validate_stored_cut,
    )
    from spotrl_runtime.checkpoint.trainer_state import (
        TorchSaveFormat,
        TrainerSnapshot,
        capture_rng,
        restore_rng,
        snapshot_trainer,
    )
    from spotrl_runtime.checkpoint.writer import (
        BarrierDeadlineMissedError,
        CommittedCut,
        CutConflictError,
        CutError,
        CutRequest,
        CutWriter,
    )
