"""Progress on the terminal for a person running a job locally (a :class:`StatusSink`)."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

from spotrl_runtime.controller.control import CutInfo

if TYPE_CHECKING:
    from spotrl_runtime.checkpoint.resume import SkippedCut


class TerminalProgress:
    """One line per trained step and per cut."""

    def __init__(self, total_steps: int, stream: TextIO | None = None):
        self.total = total_steps
        self.stream = stream or sys.stdout
        self.t0 = time.monotonic()

    def _say(self, text: str) -> None:
        self.stream.write(f"[{time.monotonic() - self.t0:7.1f}s] {text}\n")
        self.stream.flush()

    def on_started(self, resumed_from: CutInfo | None, skipped: Sequence[SkippedCut] = ()) -> None:
        for s in skipped:
            self._say(f"WARNING: skipped damaged cut {s.cut_id} ({s.check}): {s.message}")
        if resumed_from is None:
            self._say("starting a new run")
        else:
            self._say(f"resumed from cut {resumed_from.cut_id} ({resumed_from.kind}) at step {resumed_from.step}")

    def on_step(self, step: int, metrics: dict[str, Any]) -> None:
        self._say(
            f"step {step:>4}/{self.total}  reward {metrics['reward']:.3f}  acc {metrics.get('accuracy', 0.0):.2f}  "
            f"len {metrics.get('response_length_mean', 0.0):.1f}  loss {metrics['loss']:+.4f}  "
            f"grad {metrics.get('grad_norm', 0.0):.2f}  {metrics['seconds']:.2f} s  "
            f"idle {metrics.get('generation_idle_share', 0.0):.2f}  (attempt {metrics['attempt']})"
            + (f"  probs diff {metrics['rollout_probs_diff_max']:.1e}" if "rollout_probs_diff_max" in metrics else "")
        )

    def on_cut(self, cut: CutInfo) -> None:
        est = f"; a barrier cut now: ~{cut.estimate.seconds:.2f} s" if cut.estimate is not None else ""
        form = " delta" if cut.form == "delta" else ""
        self._say(f"cut {cut.cut_id} committed ({cut.kind}{form}, step {cut.step}, {cut.seconds:.2f} s{est})")

    def on_finished(self, steps: int) -> None:
        self._say(f"done: {steps} steps trained")
