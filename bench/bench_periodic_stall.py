"""What a cut costs the trainer, for the ~100M policy (weights + AdamW moments, ~1.2 GB).

    PYTHONPATH=e2e python bench/bench_periodic_stall.py [--repeat 3] [--check]

One process, real torch, a local store, everything measured in the same run:

- **synchronous cut**: ``CutWriter.write`` of the owners and the trainer's state, start to
  commit: what the trainer would wait if it cut inline.
- **periodic-cut stall**: what the trainer thread actually waits per periodic cut: the
  capture under the owners' lock, plus the wait before its next optimizer step until the
  cut no longer holds its tensors. Between the two the trainer computes a step's gradients
  (a forward and backward pass) while the cut writer writes. Before: the trainer's state
  copied under the lock (``cut_copy = "locked"``); after: lent by reference and copied in
  the background (``"background"``). Goal: stall / synchronous cut <= 0.10. "step with the
  cut" is that whole step (capture to optimizer step done), against a step without a cut:
  on a CPU trainer the background write competes with the step for the cores, which the
  stall does not show (on a GPU trainer the step runs on the device). Running the file
  threads at nice +10 was measured and not kept: it did not shorten that step.
- **barrier cut** (the process's last cut) vs ``torch.save`` + fsync of the same state:
  before (copy under the lock, files one after the other) and after (the live tensors
  written, no copy; the files side by side). Goal <= 1.5.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from _recovery_state import table
from _targets import Targets, add_check
from spotrl_runtime.api.times import Deadline
from spotrl_runtime.checkpoint import CutRequest, CutWriter
from spotrl_runtime.core.owners import Owners, RecoveryConfig
from spotrl_runtime.data import ArithmeticDataset, PromptCollate
from spotrl_runtime.data.loader import PromptLoader
from spotrl_runtime.models.loading import load_policy
from spotrl_runtime.storage.local import LocalStorage
from spotrl_runtime.training.trainer import Trainer, TrainerConfig


def gradients(trainer: Trainer, tokens: int) -> None:
    """A step's forward and backward pass (it reads the weights, changes neither them nor Adam's)."""
    trainer.optimizer.zero_grad(set_to_none=True)
    ids = torch.randint(0, 1000, (1, tokens))
    trainer.model.train()
    trainer.model(input_ids=ids).logits.float().mean().backward()
    trainer.model.eval()


def optimizer_step(trainer: Trainer) -> float:
    """The end of a step, as ``Trainer.train_step`` does it: wait for cuts, then AdamW. Returns the wait."""
    waited = trainer.wait_for_cuts()
    trainer.optimizer.step()
    trainer.step += 1
    return waited


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256, help="tokens in the step between two cuts")
    add_check(parser)
    args = parser.parse_args()

    model, _ = load_policy("builtin:random-100m")
    trainer = Trainer(model, TrainerConfig(learning_rate=1e-5))
    gradients(trainer, 16)
    optimizer_step(trainer)  # AdamW's moments exist from here on
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    state_bytes += sum(
        t.numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values() if t.dim()
    )

    with tempfile.TemporaryDirectory(prefix="bench-stall-") as tmp:
        owners = Owners(
            RecoveryConfig(group_size=4, prompts_per_step=8, lookahead=1),
            PromptLoader(ArithmeticDataset(100), PromptCollate(), batch_size=8),
        )
        owners.pump()
        writer = CutWriter(
            LocalStorage(Path(tmp) / "cuts"), job="bench", dataset={"uri": "builtin:arithmetic", "size": 100}
        )

        def state_fn(last: bool = False) -> Any:
            return trainer.snapshot({"model": "builtin:random-100m"}, last=last)

        def synchronous() -> float:
            trainer.cut_copy, writer.parallel_files = "locked", False
            t0 = time.perf_counter()
            writer.write(owners, CutRequest.periodic("bench"), state_fn)
            return time.perf_counter() - t0

        def periodic(mode: str) -> tuple[float, float]:
            """(stall, step seconds): capture on the trainer thread, write in the background."""
            import threading

            trainer.cut_copy, writer.parallel_files = mode, True
            t0 = time.perf_counter()
            snap = owners.capture(state_fn)
            stall = time.perf_counter() - t0
            done = threading.Thread(target=writer.write_snapshot, args=(snap, CutRequest.periodic("bench")))
            done.start()
            gradients(trainer, args.tokens)
            stall += optimizer_step(trainer)
            step = time.perf_counter() - t0
            done.join()
            return stall, step

        def plain_step() -> float:
            t0 = time.perf_counter()
            gradients(trainer, args.tokens)
            optimizer_step(trainer)
            return time.perf_counter() - t0

        def barrier(after: bool) -> float:
            trainer.cut_copy = "background" if after else "locked"
            writer.parallel_files = after
            t0 = time.perf_counter()
            writer.write(owners, CutRequest.barrier(Deadline.after(600), "bench"), lambda: state_fn(last=after))
            return time.perf_counter() - t0

        def plain_save() -> float:
            state = {
                "weights": model.state_dict(),
                "optimizer": trainer.optimizer.state_dict(),
            }
            path = Path(tmp) / "plain.pt"
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            took = time.perf_counter() - t0
            path.unlink()
            return took

        r: dict[str, list[float]] = {}
        for _ in range(args.repeat):
            r.setdefault("sync", []).append(synchronous())
            for mode in ("locked", "background"):
                stall, step = periodic(mode)
                r.setdefault(f"stall {mode}", []).append(stall)
                r.setdefault(f"step {mode}", []).append(step)
            r.setdefault("step", []).append(plain_step())
            r.setdefault("save", []).append(plain_save())
            r.setdefault("barrier before", []).append(barrier(False))
            r.setdefault("barrier after", []).append(barrier(True))

    m = {k: statistics.median(v) for k, v in r.items()}
    print(f"\nstate: {state_bytes / 1e6:.0f} MB (weights + AdamW moments), median of {args.repeat}")
    table(
        "Periodic cut: the trainer's stall vs a synchronous cut",
        ("capture", "stall per cut", "synchronous cut", "stall / sync (goal <= 0.10)", "step with the cut", "step"),
        [
            (
                label,
                f"{m[f'stall {mode}']:.3f} s",
                f"{m['sync']:.2f} s",
                f"{m[f'stall {mode}'] / m['sync']:.3f}",
                f"{m[f'step {mode}']:.2f} s",
                f"{m['step']:.2f} s",
            )
            for label, mode in (
                ("before: copy under the lock", "locked"),
                ("after: lent, copied behind", "background"),
            )
        ],
    )
    table(
        "Barrier cut vs torch.save + fsync of the same state",
        ("cut", "barrier cut", "torch.save + fsync", "ratio (goal <= 1.5)"),
        [
            (label, f"{m[key]:.2f} s", f"{m['save']:.2f} s", f"{m[key] / m['save']:.2f}")
            for label, key in (
                ("before: copy under the lock, files in turn", "barrier before"),
                ("after: live tensors, files side by side", "barrier after"),
            )
        ],
    )
    # The goals are the code's as it is (the "after" rows); the "before" rows show what it replaced.
    targets = Targets()
    targets.at_most("periodic cut: the trainer's stall / a synchronous cut", m["stall background"] / m["sync"], 0.10)
    targets.at_most("barrier cut / torch.save + fsync of the same state", m["barrier after"] / m["save"], 1.5)
    targets.report(args.check)


if __name__ == "__main__":
    main()
