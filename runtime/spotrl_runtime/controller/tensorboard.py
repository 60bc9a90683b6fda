"""TensorBoard event files of every trained step, next to the cuts (``<storage>/tensorboard/``).

Each controller attempt writes a file of its own (``events.out.tfevents.*.attempt-N``). A
resumed attempt's file starts with TensorBoard's purge marker at the step it resumes from, so
the steps the preempted attempt trained after its last cut, and this one trains again, show
once: TensorBoard hides the older file's events from that step on. A local store is written in
place; an S3 one gets the file again after each step (a few hundred bytes a step).

``tensorboard --logdir <storage>/tensorboard`` (or the S3 prefix, copied down) shows the tags
below, grouped as veRL groups its own.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spotrl_runtime.checkpoint.resume import SkippedCut
from spotrl_runtime.controller.control import CutInfo
from spotrl_runtime.storage import LocalStorage, Storage

log = logging.getLogger("spotrl.controller")

PREFIX = "tensorboard"
TAGS = {
    "val_accuracy": "val/accuracy",
    "val_reward": "val/reward",
    "reward": "reward/mean",
    "reward_std": "reward/std",
    "accuracy": "reward/accuracy",
    "response_length_mean": "response_length/mean",
    "response_length_max": "response_length/max",
    "response_clip_ratio": "response_length/clip_ratio",
    "frac_reward_zero_std": "reward/frac_zero_std",
    "turns_mean": "episode/turns_mean",
    "observation_tokens_mean": "episode/observation_tokens_mean",
    "reward_errors": "reward/errors",
    "version_mismatches": "rollout/version_mismatches",
    "loss": "actor/loss",
    "kl": "actor/kl",
    "entropy": "actor/entropy",
    "clip_fraction": "actor/pg_clipfrac",
    "grad_norm": "actor/grad_norm",
    "learning_rate": "actor/lr",
    "rollout_probs_diff_mean": "rollout/probs_diff_mean",
    "rollout_probs_diff_max": "rollout/probs_diff_max",
    "rollout_probs_diff_stale_mean": "rollout/probs_diff_stale_mean",
    "rollout_probs_diff_stale_max": "rollout/probs_diff_stale_max",
    "is_weight_mean": "rollout/is_weight_mean",
    "is_weight_max": "rollout/is_weight_max",
    "is_capped_fraction": "rollout/is_capped_fraction",
    "outside_nucleus_fraction": "rollout/outside_nucleus_fraction",
    "padding_share": "perf/padding_share",
    "overlong_filtered": "response_length/overlong_filtered",
    "overlong_penalty_mean": "response_length/overlong_penalty_mean",
    "reward_kl_penalty_mean": "actor/reward_kl_penalty",
    "dynamic_filtered": "dynamic_sampling/filtered",
    "dynamic_filtered_share": "dynamic_sampling/filtered_share",
    "refill_rounds": "dynamic_sampling/rounds",
    "seconds": "perf/step_seconds",
    "train_tokens_per_second": "perf/train_tokens_per_second",
    "generation_tokens_per_second": "perf/generation_tokens_per_second",
    "generation_idle_share": "perf/generation_idle_share",
    "generation_idle_share_max": "perf/generation_idle_share_max",
    "weight_sync_seconds": "perf/weight_sync_seconds",
    "weight_sync_bytes": "perf/weight_sync_bytes",
    "cut_wait_seconds": "perf/cut_wait_seconds",
}
"""Step metric -> TensorBoard tag."""


class TensorBoardLog:
    """A :class:`~spotrl_runtime.controller.control.StatusSink` that writes the event file of
    attempt ``attempt`` into ``storage``; a failed write costs the file, never the run."""

    def __init__(self, storage: Storage, attempt: int) -> None:
        self.storage = storage
        self.attempt = attempt
        self._writer: Any = None
        self._local: Path | None = None
        self._temp: str | None = None

    def on_started(self, resumed_from: CutInfo | None, skipped: Sequence[SkippedCut] = ()) -> None:
        from torch.utils.tensorboard import SummaryWriter

        try:
            if isinstance(self.storage, LocalStorage):
                self._local = self.storage.path_of(PREFIX)
            else:
                self._temp = tempfile.mkdtemp(prefix="spotrl-tensorboard-")
                self._local = Path(self._temp)
            self._local.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(
                log_dir=str(self._local),
                purge_step=resumed_from.step if resumed_from is not None else None,
                filename_suffix=f".attempt-{self.attempt}",
                flush_secs=3600,  # flushed after each step, below
            )
        except Exception as err:
            log.warning("TensorBoard events not written: %s", err)
            self._writer = None

    def on_step(self, step: int, metrics: dict[str, Any]) -> None:
        if self._writer is None:
            return
        try:
            for name, tag in TAGS.items():
                if name in metrics:
                    self._writer.add_scalar(tag, float(metrics[name]), global_step=int(metrics["step"]))
            self._writer.flush()
            self._upload()
        except Exception as err:
            log.warning("TensorBoard events of step %s not written: %s", metrics.get("step"), err)

    def on_cut(self, cut: CutInfo) -> None:
        pass

    def on_finished(self, steps: int) -> None:
        self.close()

    def close(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
                self._upload()
            except Exception as err:
                log.warning("TensorBoard events not closed: %s", err)
            self._writer = None
        if self._temp is not None:
            shutil.rmtree(self._temp, ignore_errors=True)
            self._temp = None

    def _upload(self) -> None:
        if self._temp is None or self._local is None:
            return  # a local store is written in place
        for path in self._local.iterdir():
            self.storage.put_file(f"{PREFIX}/{path.name}", path)
