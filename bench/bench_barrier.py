"""Barrier time: SIGTERM to a committed cut, for the demo model and a ~100M-parameter policy.

For each policy, `spotrl run` trains until its first steps are done, gets SIGTERM, and takes
its barrier cut. The baseline, measured in the same run on the same disk, is a plain
``torch.save`` of the very trainer state the cut holds, plus an fsync: what any checkpoint
of that state must at least cost (the median of three, after one to warm up: the first big
write of a process pays for the page cache, and would flatter the ratio). The ratio says
what the cut adds (the owners, digests, the manifest).

Then, in this process and on the same disk, the cut writer alone on the same state: as it
was (the weights in one file, hashed then written) and as it is (the weights in parts
written side by side, each hashed while it is written).

Each policy's run is preempted ``--repeat`` times (a fresh `spotrl run` each time) in two
scenarios: its first cut, and after periodic cuts (each replacing the one before); the table
gives the median and the range. The torch.save baseline is measured both into page cache never
used before and into the pages of a file just deleted: on a VM the two can differ severalfold
(docs/benchmarks.md), so each scenario is compared with its like.

    python bench/bench_barrier.py [--policies tiny,100m] [--repeat 5] [--check]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from _targets import Targets, add_check

ROOT = Path(__file__).resolve().parents[1]
POLICIES = {"tiny": "builtin:tiny-arith", "100m": "builtin:random-100m"}


SCENARIOS = {
    # The first cut of a run: its files go into page cache the run has never used.
    "first cut": {"everySteps": 1000},
    # Steady state: a periodic cut every 3 steps, one kept, so each new cut's files take the
    # pages of the one it replaces; SIGTERM just after the cut of step 6 replaced step 3's.
    "after cuts": {"everySteps": 3, "keep": 1},
}


def job(model: str, checkpoint: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "spotrl.dev/v1alpha1",
        "kind": "RLJob",
        "metadata": {"name": "bench"},
        "spec": {
            "policy": {"model": model},
            "dataset": {"uri": "builtin:arithmetic"},
            "reward": {"name": "arithmetic_exact"},
            "generation": {"groupSize": 4, "promptsPerStep": 4, "lookahead": 1, "maxNewTokens": 4},
            "training": {"totalSteps": 1000, "learningRate": 1e-5, "microBatchSize": 16},
            "checkpoint": checkpoint or SCENARIOS["first cut"],
            "scheduling": {"terminationGracePeriodSeconds": 300},
        },
    }


def periodic_step(storage: Path) -> int:
    """The step of the newest committed periodic cut (-1: none yet)."""
    steps = [-1]
    for m in (storage / "cuts").glob("*/manifest.json"):
        try:
            doc = json.loads(m.read_text())
        except (OSError, ValueError):
            continue  # being written or being deleted
        if doc.get("kind") == "periodic":
            steps.append(int(doc["trainer_step"]))
    return max(steps)


def barrier_seconds(
    model: str, work: Path, delay: float = 0.0, scenario: str = "first cut"
) -> tuple[float, float, int]:
    """SIGTERM → committed barrier manifest, in seconds; of that, the cut writer's own time
    (capture to commit, from the run's log: without the wait for a step still training and
    the signal's way to the writer); the cut's bytes."""
    spec = work / "job.yaml"
    spec.write_text(yaml.safe_dump(job(model, SCENARIOS[scenario])))
    storage = work / "cuts"
    proc = subprocess.Popen(
        [sys.executable, "-m", "spotrl_runtime.cli", "run", "-f", str(spec), "--storage", str(storage), "-q"],
        stdout=subprocess.DEVNULL,
        stderr=open(work / "run.log", "wb"),  # noqa: SIM115 (the child holds it)
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    audit = storage / "audit"
    deadline = time.monotonic() + 900

    def ready() -> bool:
        if scenario == "after cuts":  # step 6's cut committed, and step 3's deleted
            return periodic_step(storage) >= 6 and len(list((storage / "cuts").iterdir())) == 1
        return audit.exists() and len(list(audit.iterdir())) >= 2

    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"{model}: the run ended or stalled before it was ready for SIGTERM ({scenario})")
        time.sleep(0.05)
    time.sleep(delay)
    t0 = time.time()
    proc.send_signal(signal.SIGTERM)
    if proc.wait(timeout=600) != 143:
        raise SystemExit(f"{model}: SIGTERM did not end with a barrier cut (exit {proc.returncode})")
    manifests = sorted((storage / "cuts").glob("*/manifest.json"))
    manifest = json.loads(manifests[-1].read_text())
    assert manifest["kind"] == "barrier", manifest["kind"]
    committed = manifests[-1].stat().st_mtime
    writer = float("nan")
    for line in (work / "run.log").read_text().splitlines():
        if "committed (barrier" in line and "total " in line:
            writer = float(line.rsplit("total ", 1)[1].split(" s")[0])
    return committed - t0, writer, sum(f["size"] for f in manifest["files"])


def trainer_state(work: Path) -> dict[str, Any]:
    """The trainer state the barrier cut holds (every file of its trainer/ folder, loaded)."""
    import torch

    cut = sorted((work / "cuts" / "cuts").glob("*/manifest.json"))[-1].parent
    return {p.stem: torch.load(p, weights_only=False) for p in sorted(cut.glob("*/trainer/*.pt"))}


def plain_save_seconds(state: dict[str, Any], work: Path, *, recycled: bool) -> tuple[float, int]:
    """torch.save of ``state``, fsynced: the median of three, each a new file, after a warm-up.
    ``recycled``: each file is deleted before the next is written, so it takes the pages its
    predecessor freed; else the files are kept, and each goes into page cache never used
    before (what the first cut of a run meets: on a VM, memory touched for the first time
    costs more than recycled pages)."""
    import torch

    times = []
    for i in range(4):
        path = work / f"plain-{i}.pt"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - t0)
        size = path.stat().st_size
        if recycled:
            path.unlink()
    for i in range(4):
        (work / f"plain-{i}.pt").unlink(missing_ok=True)
    return statistics.median(times[1:]), size


def writer_alone(state: dict[str, Any], work: Path) -> dict[str, float]:
    """The cut writer alone (a barrier cut of ``state`` to a local store), median of three: as
    it was (one weights file, hashed then written) and as it is (weights in parts)."""
    import torch

    from spotrl_runtime.api.times import Deadline
    from spotrl_runtime.checkpoint import CutRequest, CutWriter
    from spotrl_runtime.checkpoint import trainer_state as ts
    from spotrl_runtime.core.owners import Owners, RecoveryConfig
    from spotrl_runtime.data import ArithmeticDataset, PromptCollate
    from spotrl_runtime.data.loader import PromptLoader
    from spotrl_runtime.storage import LocalStorage

    class OneWeightsFile(ts.TorchSaveFormat):
        name = "torch.save/v1"

        def files(self, snapshot: ts.TrainerSnapshot) -> list[ts.TrainerFile]:
            rest = [f for f in super().files(snapshot) if f.role != "weights"]
            weights = dict(snapshot.weights)
            return [ts.TrainerFile("trainer/weights.pt", "weights", lambda f: torch.save(weights, f)), *rest]

    weights = {k: v for part in state.values() if isinstance(part, dict) for k, v in part.items() if "." in k}
    owners = Owners(
        RecoveryConfig(group_size=4, prompts_per_step=8, lookahead=1),
        PromptLoader(ArithmeticDataset(100), PromptCollate(), batch_size=8),
    )
    owners.pump()
    out: dict[str, float] = {}
    for label, fmt, overlap in (("one file", OneWeightsFile(), 1 << 62), ("parts", None, ts.OVERLAP_BYTES)):
        saved, ts.OVERLAP_BYTES = ts.OVERLAP_BYTES, overlap
        try:
            times = []
            for i in range(4):
                store = LocalStorage(work / f"alone-{i}")
                writer = CutWriter(store, job="bench", dataset={"uri": "builtin:arithmetic?size=100", "size": 100})
                if fmt is not None:
                    writer.trainer_format = fmt
                t0 = time.perf_counter()
                writer.write(
                    owners,
                    CutRequest.barrier(Deadline.after(300)),
                    # As a barrier captures (``last``): the live tensors, no copy.
                    lambda: ts.TrainerSnapshot(weights=weights, meta={"trainer_step": owners.trainer_step}),
                )
                times.append(time.perf_counter() - t0)
                shutil.rmtree(work / f"alone-{i}")
            out[label] = statistics.median(times[1:])
        finally:
            ts.OVERLAP_BYTES = saved
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policies", default="tiny,100m")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"of {', '.join(SCENARIOS)}")
    ap.add_argument("--repeat", type=int, default=5, help="preemptions per policy and scenario (a fresh run each)")
    ap.add_argument(
        "--delay",
        type=float,
        default=0.0,
        help="seconds between the second step and SIGTERM (0: at once, while its weights go to the workers)",
    )
    add_check(ap)
    args = ap.parse_args()
    rows, alone_rows = [], []
    for name in args.policies.split(","):
        with tempfile.TemporaryDirectory(prefix=f"bench-barrier-{name}-") as tmp:
            work = Path(tmp)
            for scenario in args.scenarios.split(","):
                samples = []
                for i in range(max(1, args.repeat)):
                    one = work / f"{scenario.replace(' ', '-')}-{i}"
                    one.mkdir()
                    samples.append(barrier_seconds(POLICIES[name], one, args.delay, scenario))
                cuts, writers = [c for c, _, _ in samples], [w for _, w, _ in samples]
                rows.append((name, scenario, cuts, writers, samples[-1][2]))
            state = trainer_state(one)
            recycled, plain_bytes = plain_save_seconds(state, work, recycled=True)
            fresh, _ = plain_save_seconds(state, work, recycled=False)
            alone_rows.append((name, recycled, fresh, plain_bytes, writer_alone(state, work)))
    saves = {name: (recycled, fresh) for name, recycled, fresh, _, _ in alone_rows}
    targets = Targets()
    print(
        f"{'policy':8} {'scenario':11} {'SIGTERM→cut s':>14} {'range':>11} {'cut writer s':>13} {'cut MB':>8} "
        f"{'ratio, fresh':>13} {'ratio, recycled':>16}"
    )
    for name, scenario, cuts, writers, cut_b in rows:
        cut_s, writer_s = statistics.median(cuts), statistics.median(writers)
        recycled, fresh = saves[name]
        if name != "tiny":  # the demo model's 1.6 MB cut is its fixed costs alone: no goal
            like = fresh if scenario == "first cut" else recycled
            targets.at_most(f"{name}, {scenario}: SIGTERM→cut / torch.save + fsync, like for like", cut_s / like, 1.5)
        print(
            f"{name:8} {scenario:11} {cut_s:14.2f} {f'{min(cuts):.2f}-{max(cuts):.2f}':>11} {writer_s:13.2f} "
            f"{cut_b / 1e6:8.1f} {cut_s / fresh:13.2f} {cut_s / recycled:16.2f}"
        )
    print(
        f"medians of {args.repeat} preemptions. ratio: SIGTERM→cut / torch.save+fsync of the same state (goal <= 1.5), "
        "into page cache never used before (fresh: what a run's first cut meets) or into the pages of a file just "
        "deleted (recycled: what a cut replacing an older one meets); like for like: first cut / fresh, after "
        "cuts / recycled"
    )
    head = (
        f"{'torch.save fresh s':>19} {'recycled s':>11} {'save MB':>8} {'writer alone, one file s':>25} {'parts s':>8}"
    )
    print(f"\n{'policy':8} {head} {'ratio':>6}")
    for name, recycled, fresh, plain_b, alone in alone_rows:
        before, after = alone["one file"], alone["parts"]
        print(
            f"{name:8} {fresh:19.2f} {recycled:11.2f} {plain_b / 1e6:8.1f} {before:25.2f} {after:8.2f} "
            f"{after / recycled:6.2f}"
        )
    print(
        "torch.save+fsync medians of 3 after a warm-up; the cut writer alone in this process, a barrier cut of the "
        "same weights to the same disk (median of 3, each cut deleted before the next: ratio to recycled), as it "
        "was (one weights file, hashed then written) and as it is (weights in parts)"
    )
    targets.report(args.check)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
