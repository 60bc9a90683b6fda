"""What a delta cut after every step costs the trainer: the chat example with and without them.

    PYTHONPATH=e2e python bench/bench_delta_stall.py [--steps 30] [--check]

The same job (``examples/cpu-chat-gsm8k.yaml``, ``--steps`` steps), in one run of this file:

1. a local store, ``checkpoint.deltaEverySteps: 0`` (full cuts every ``everySteps`` only): the baseline;
2. a local store, ``deltaEverySteps: 1`` (the default);
3. S3 (versitygw on loopback) through our fault proxy, every PUT stalled ``--stall`` seconds,
   ``deltaEverySteps: 1``.

Per setting: the median step period (between two steps' audit records), the trainer's stall per
delta: the capture under the owners' lock, on the trainer thread (each delta's manifest), plus
the mean wait of a step's commit for the cut of the step before it (each step's
``cut_wait_seconds``: a cut writer slower than a step makes the trainer wait rather than let a
loss without notice cost more steps), that stall over the step period, deltas committed over
steps trained, and the run's wall time over the baseline's. The goal, stall <= 0.10 of a step,
is the local store's, which keeps up with the trainer. Through the slowed S3 a delta takes
longer to write than the chat example's short step trains: the step waits for it, the price of
the bound on a loss, shown without a goal.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _chat_job import chat_job
from _recovery_state import table
from _targets import Targets, add_check
from spotrl_e2e.faultproxy import FaultProxy
from spotrl_e2e.s3 import S3Server
from spotrl_runtime.checkpoint.layout import list_cut_folders, manifest_key
from spotrl_runtime.controller.audit_store import AuditStore
from spotrl_runtime.storage import open_storage


def job_file(folder: Path, delta_every_steps: int, steps: int) -> Path:
    # keep: every delta's manifest stays, to read its capture
    return chat_job(folder / f"job-{delta_every_steps}.yaml", steps, deltaEverySteps=delta_every_steps, keep=1000)


def delta_captures(store: Any) -> list[float]:
    """The trainer's stall per delta cut: each delta manifest's capture seconds (the capture
    under the owners' lock, on the trainer thread)."""
    out = []
    for folder in list_cut_folders(store):
        if folder.committed:
            m = json.loads(store.get_bytes(manifest_key(folder.cut_id)))
            if m["form"] == "delta":
                out.append(float(m["capture_seconds"]))
    return out


def run(job: Path, uri: str, log: Path, env: dict[str, str]) -> float:
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "spotrl_runtime.cli", "run", "-f", str(job), "--storage", uri]
    with log.open("w") as out:
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}).returncode
    if rc != 0:
        raise SystemExit(f"{uri}: the run failed (exit {rc}); see {log}")
    return time.monotonic() - t0


def measure(
    name: str,
    uri: str,
    job: Path,
    log: Path,
    env: dict[str, str],
    base_wall: float | None,
    targets: Targets | None,
    store: Any = None,
) -> tuple[Any, ...]:
    """One setting's row; its target goes to ``targets`` (None: no goal, as for the baseline,
    which cuts no deltas); ``store``: how this process reads the run's storage (default: ``uri``)."""
    wall = run(job, uri, log, env)
    docs = AuditStore(store or open_storage(uri)).documents()
    at = sorted(d["at"] for d in docs)
    period = statistics.median(b - a for a, b in itertools.pairwise(at))
    captures = delta_captures(store or open_storage(uri))
    wait = statistics.fmean(d.get("cut_wait_seconds", 0.0) for d in docs)
    stall = (statistics.median(captures) if captures else 0.0) + wait
    if targets is not None:
        # A setting that should cut deltas and committed none has missed its goal, not met it.
        targets.at_most(f"{name}: stall per delta / step period", stall / period if captures else math.nan, 0.10)
    return (
        name,
        f"{period:.3f}",
        f"{stall * 1000:.3f}" if captures else "-",
        f"{wait * 1000:.3f}",
        f"{stall / period:.4f}" if captures else "-",
        f"{len(captures)}/{len(docs)}",
        f"{wall:.1f}",
        f"{wall / base_wall:.3f}" if base_wall else "1",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--stall", type=float, default=0.1, help="seconds each PUT through the proxy is held")
    add_check(ap)
    args = ap.parse_args()
    rows = []
    targets = Targets()
    with tempfile.TemporaryDirectory(prefix="bench-delta-stall-") as tmp:
        folder = Path(tmp)
        base = measure(
            "local, deltaEverySteps 0",
            str(folder / "off"),
            job_file(folder, 0, args.steps),
            folder / "off.log",
            {},
            None,
            None,
        )
        rows.append(base)
        base_wall = float(base[6])
        on = job_file(folder, 1, args.steps)
        rows.append(
            measure("local, deltaEverySteps 1", str(folder / "on"), on, folder / "on.log", {}, base_wall, targets)
        )
        server = S3Server(folder / "s3").start()
        try:
            bucket = server.create_bucket()
            with FaultProxy(server.endpoint) as proxy:
                proxy.add("stall", method="PUT", seconds=args.stall)
                env = {**bucket.env(), "AWS_ENDPOINT_URL_S3": proxy.endpoint}
                name = f"S3 via the proxy, PUTs +{args.stall:g} s, deltaEverySteps 1"
                uri = f"s3://{bucket.bucket}/job"
                rows.append(measure(name, uri, on, folder / "s3.log", env, base_wall, None, bucket.storage("job")))
        finally:
            server.stop()
    table(
        f"A delta cut after every step, {args.steps} steps of the chat example",
        (
            "setting",
            "step period s",
            "stall per delta ms",
            "of it, commit wait ms",
            "stall / step",
            "deltas / steps",
            "wall s",
            "wall / base",
        ),
        rows,
    )
    targets.report(args.check)


if __name__ == "__main__":
    main()
