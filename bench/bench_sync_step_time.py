"""Step time before and after a change (the weight path, generation): the same jobs run by two
checkouts.

    PYTHONPATH=e2e python bench/bench_sync_step_time.py [--before <git-rev>] [--steps 20]
        [--backend transformers|vllm] [--shapes single,fsdp]

The CPU chat example (``examples/cpu-chat-gsm8k.yaml``) is run, in one run of this file, by the
code at ``--before`` (a ``git worktree`` of it) and by this checkout, in two shapes: one process
with one generation worker, and two FSDP ranks with one worker (what this 2-core machine's Ray
places beside the controller: each CPU worker takes a CPU). Per run: the median step period
(between two steps' audit records), the median ``weight_sync_seconds`` the run reported (after:
the channel), and the run's wall time.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from _chat_job import ROOT, chat_job
from _recovery_state import table
from spotrl_runtime.controller.audit_store import AuditStore
from spotrl_runtime.storage import open_storage

OBJECT_STORE_REV = "e383f9f"
"""The last revision whose weights went through the controller and Ray's object store."""


def fsdp_job(path: Path, steps: int) -> Path:
    chat_job(path, steps)
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    doc["spec"]["training"]["parallelism"] = {"strategy": "fsdp", "ranks": 2, "cpusPerRank": 0.5}
    path.write_text(yaml.safe_dump(doc))
    return path


def with_backend(path: Path, backend: str) -> Path:
    doc: dict[str, Any] = yaml.safe_load(path.read_text())
    doc["spec"]["generation"]["backend"] = backend
    path.write_text(yaml.safe_dump(doc))
    return path


def run(code: Path, job: Path, storage: Path, log: Path) -> tuple[float, float, float]:
    env = {**os.environ, "PYTHONPATH": f"{code / 'runtime'}:{ROOT / 'e2e'}"}
    cmd = [sys.executable, "-m", "spotrl_runtime.cli", "run", "-f", str(job), "--storage", str(storage)]
    t0 = time.monotonic()
    with log.open("w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=code).returncode
    wall = time.monotonic() - t0
    if rc != 0:
        raise SystemExit(f"{code}: the run failed (exit {rc}); see {log}")
    docs = AuditStore(open_storage(str(storage))).documents()
    period = statistics.median(b - a for a, b in itertools.pairwise(sorted(d["at"] for d in docs)))
    syncs = [float(d["weight_sync_seconds"]) for d in docs if d.get("weight_sync_seconds")]
    return period, statistics.median(syncs) if syncs else float("nan"), wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--before",
        default=OBJECT_STORE_REV,
        help="the git revision to compare with (default: the last that sent weights through the object store)",
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--backend", choices=("transformers", "vllm"), default="transformers", help="generation.backend")
    ap.add_argument("--shapes", default="single,fsdp", help="comma list of single (1 process), fsdp (2 ranks)")
    args = ap.parse_args()
    shapes = {"single": ("1 process, 1 worker", chat_job), "fsdp": ("2 FSDP ranks, 1 worker", fsdp_job)}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-sync-step-") as tmp:
        folder = Path(tmp)
        before = folder / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.before], check=True)
        try:
            for shape, make in (shapes[s] for s in args.shapes.split(",")):
                job = with_backend(make(folder / f"{len(rows)}.yaml", args.steps), args.backend)
                results = {}
                for name, code in (("before", before), ("after", ROOT)):
                    where = folder / f"{name}-{len(rows)}"
                    results[name] = run(code, job, where / "store", folder / f"{name}-{len(rows)}.log")
                    print(shape, name, results[name], flush=True)
                (p0, _, w0), (p1, s1, w1) = results["before"], results["after"]
                rows.append((shape, f"{p0:.3f}", f"{p1:.3f}", f"{p1 / p0:.2f}", f"{s1:.4f}", f"{w0:.1f}", f"{w1:.1f}"))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False)
    table(
        f"The CPU chat example on {args.backend}, {args.steps} steps: before ({args.before}) and after",
        (
            "shape",
            "step period s (before)",
            "step period s (after)",
            "after / before",
            "weight_sync_seconds (after)",
            "wall s (before)",
            "wall s (after)",
        ),
        rows,
    )


if __name__ == "__main__":
    main()
