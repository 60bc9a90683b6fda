"""Cuts: the one writer (periodic and barrier), the layout in a store, and the restore."""

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
