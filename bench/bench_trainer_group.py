"""The trainer group (FSDP2 ranks on CPU, gloo): sharded cut time against rank count, and step time.

    PYTHONPATH=e2e python bench/bench_trainer_group.py [--ranks 1,2,4] [--repeat 3] [--model 100m] [--check]

For a ~100M-parameter policy (``builtin:random-100m``) after one AdamW step (so the cut holds
weights and both Adam moments, ~1.2 GB), in one run, per rank count N:

- **sharded cut**: every rank writes its shards through torch.distributed.checkpoint into a
  local store, hashing as it writes (what a cut's trainer part costs; the capture, a copy of
  each rank's shards, is timed apart);
- **plain parallel write** (the baseline): N threads, each writing as many bytes as that rank's
  shard files hold into one file of its own in the same store folder, with fsync;
- **torch.save + fsync** of as many bytes from one process (a second baseline, as for the
  single-process barrier);
- **step**: one GRPO step on the same synthetic groups, N ranks against 1.

The goal is a cut within 1.2x of the plain parallel write of the same bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _recovery_state import table
from _targets import Targets, add_check
from bench_train_step import MODELS, synthetic_groups
from spotrl_runtime.storage import LocalStorage
from spotrl_runtime.training import TrainerConfig
from spotrl_runtime.training.group import TrainerGroup


def plain_parallel_write(folder: Path, sizes: list[int]) -> float:
    """N threads, each writing ``sizes[i]`` bytes to its own file, fsync'd: the floor for a cut."""
    chunk = os.urandom(8 * 1024 * 1024)

    def write(i: int) -> None:
        with open(folder / f"plain-{i}.bin", "wb") as f:
            left = sizes[i]
            while left > 0:
                n = min(left, len(chunk))
                f.write(chunk[:n])
                left -= n
            f.flush()
            os.fsync(f.fileno())

    threads = [threading.Thread(target=write, args=(i,)) for i in range(len(sizes))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def torch_save_fsync(folder: Path, nbytes: int) -> float:
    """One process, ``torch.save`` of ``nbytes`` of float32 tensors (100 MB each) and fsync: the
    single-writer baseline issue 15 uses for the barrier."""
    import torch

    state = {
        f"t{i}": torch.rand(min(25_000_000, (nbytes - i * 100_000_000) // 4)) for i in range(-(-nbytes // 100_000_000))
    }
    t0 = time.perf_counter()
    with open(folder / "torch-save.pt", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--model", default="100m", choices=sorted(MODELS))
    add_check(parser)
    args = parser.parse_args()
    import ray

    from spotrl_runtime.models import load_policy

    policy = MODELS[args.model]
    model, _ = load_policy(policy)  # built and cached once, before the ranks load it
    vocab = model.config.vocab_size
    params = sum(p.numel() for p in model.parameters())
    del model
    groups = synthetic_groups(vocab, groups=4, group_size=4, prompt_len=16, completion_len=16)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    ray.init(num_cpus=8, include_dashboard=False, _temp_dir=ray_tmp, log_to_driver=False, configure_logging=False)
    rows: list[tuple[Any, ...]] = []
    step_rows: list[tuple[Any, ...]] = []
    single_step: float | None = None
    targets = Targets()
    try:
        for n in [int(r) for r in args.ranks.split(",")]:
            group = TrainerGroup(
                policy, TrainerConfig(learning_rate=1e-5, micro_batch_size=4), ranks=n, cpus_per_rank=1
            )
            try:
                group.start(timeout=300)
                steps = [group.train_step(groups)["seconds"] for _ in range(2)]
                step = min(steps)
                single_step = single_step or (step if n == 1 else None)
                step_rows.append((n, f"{step:.2f} s", f"{step / single_step:.2f}" if single_step else "-"))
                cuts, plains, saves, captures, total = [], [], [], [], 0
                with tempfile.TemporaryDirectory(dir=os.environ.get("SPOTRL_BENCH_DIR")) as tmp:
                    store = LocalStorage(tmp)
                    for r in range(args.repeat):
                        t0 = time.perf_counter()
                        snap = group.snapshot({"model": policy})
                        captures.append(time.perf_counter() - t0)
                        t0 = time.perf_counter()
                        files = snap.write(store, f"cut-{r}", None)
                        cuts.append(time.perf_counter() - t0)
                        by_rank: dict[str, int] = {}
                        for f in files:
                            if f.name.endswith(".distcp"):  # __<rank>_<n>.distcp
                                rank = f.name.rsplit("/", 1)[-1].split("_")[2]
                                by_rank[rank] = by_rank.get(rank, 0) + f.size
                        data = list(by_rank.values())
                        total = sum(f.size for f in files)
                        plains.append(plain_parallel_write(Path(tmp), data))
                        saves.append(torch_save_fsync(Path(tmp), sum(data)))
                cut, plain, save = statistics.median(cuts), statistics.median(plains), statistics.median(saves)
                targets.at_most(f"{n} ranks: sharded cut / plain parallel write of the same bytes", cut / plain, 1.2)
                rows.append(
                    (
                        n,
                        f"{total / 1e9:.2f} GB",
                        f"{statistics.median(captures):.2f} s",
                        f"{cut:.2f} s",
                        f"{plain:.2f} s",
                        f"{cut / plain:.2f}",
                        f"{save:.2f} s",
                        f"{cut / save:.2f}",
                    )
                )
            finally:
                group.shutdown()
    finally:
        ray.shutdown()
    table(
        f"Sharded cut of {policy} ({params / 1e6:.0f}M parameters, AdamW) on CPU, median of {args.repeat}",
        (
            "ranks",
            "bytes",
            "capture",
            "sharded cut (DCP, hashed)",
            "plain parallel write",
            "ratio (goal <= 1.2)",
            "torch.save + fsync",
            "ratio",
        ),
        rows,
    )
    table(
        f"One GRPO step of {policy} on CPU (4 groups x 4 rollouts, 16+16 tokens)",
        ("ranks", "step", "ratio to 1 rank"),
        step_rows,
    )
    targets.report(args.check)


if __name__ == "__main__":
    main()
