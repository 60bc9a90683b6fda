"""What a loss without notice costs: the chat example SIGKILLed at random moments, resumed each time.

    PYTHONPATH=e2e python bench/bench_abrupt_loss.py [--kills 10] [--seed N] [--steps 60]

A kernel panic, an OOM kill or a VM reclaimed past its PodDisruptionBudget gives no notice:
no barrier cut, the run resumes from its newest periodic cut. For each setting of
``checkpoint.deltaEverySteps`` (1: a delta cut after every step, the default; 0: full cuts
every ``everySteps`` only), in the same run of this file:

1. the uninterrupted run of ``examples/cpu-chat-gsm8k.yaml`` (its wall time, stream, weights);
2. one run SIGKILLed ``--kills`` times (the controller's whole process group, no notice), each
   time at a random moment: after the attempt's first trained step, uniformly within the next
   three steps' time (the seed is printed; ``--seed`` replays it). Each attempt resumes with
   ``--resume auto`` until the run ends.

Per kill: steps trained twice (``spotrl audit --summary``: steps retrained), steps redone from a
delta's rows (training, no generation), groups generated again (those the restore relaunched,
and every group of a step trained again), the generation seconds that is (at the uninterrupted
run's seconds per group: generation is most of a step), and wall seconds lost (the killed runs'
total against the uninterrupted run, over the kills: a restart's fixed seconds included).
Every resumed run must end with the uninterrupted run's stream and final weights, bit for bit,
and no step may count a version mismatch; the bench fails otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from _chat_job import chat_job
from _recovery_state import table
from spotrl_runtime.controller.audit_store import AuditStore
from spotrl_runtime.storage import open_storage


def job_file(folder: Path, delta_every_steps: int, steps: int) -> Path:
    return chat_job(folder / f"job-delta{delta_every_steps}.yaml", steps, deltaEverySteps=delta_every_steps)


def prompts_per_step(job: Path) -> int:
    return int(yaml.safe_load(job.read_text())["spec"]["generation"]["promptsPerStep"])


def start(job: Path, store: Path, marker: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "spotrl_runtime.cli", "run", "-f", str(job), "--storage", str(store)]
    env = {**os.environ, "SPOTRL_BENCH_RUN": marker, "PYTHONUNBUFFERED": "1"}
    log = open(store.with_suffix(".log"), "ab")  # noqa: SIM115 - the child writes it
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def processes_of(marker: str) -> list[int]:
    """Live processes of one run (the controller's, Ray's, the workers'), by their environment."""
    entry = f"SPOTRL_BENCH_RUN={marker}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(int(pid))
        except OSError:
            continue
    return found


def kill_all(proc: subprocess.Popen[bytes], marker: str) -> None:
    """SIGKILL to the process group, as a node's loss gives; then whatever the run left (Ray
    starts its processes in sessions of their own) is killed too before the next attempt."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 60
    while (left := processes_of(marker)) and time.monotonic() < deadline:
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def steps_by(store: Path, attempt_at_least: int) -> int:
    if not (store / "audit").exists():
        return 0
    return sum(1 for d in AuditStore(open_storage(str(store))).documents() if d["attempt"] >= attempt_at_least)


def attempts(store: Path) -> int:
    docs = AuditStore(open_storage(str(store))).documents() if (store / "audit").exists() else []
    return max((d["attempt"] for d in docs), default=-1) + 1


def uninterrupted(job: Path, store: Path) -> float:
    t0 = time.monotonic()
    proc = start(job, store, f"{store}-0")
    if proc.wait() != 0:
        raise SystemExit(f"the uninterrupted run failed; see {store.with_suffix('.log')}")
    return time.monotonic() - t0


def killed(job: Path, store: Path, kills: int, step_seconds: float, rng: random.Random) -> tuple[float, int]:
    """Runs to the end, SIGKILLed ``kills`` times; returns (wall seconds, kills that landed)."""
    t0, landed = time.monotonic(), 0
    while True:
        marker = f"{store}-{landed}-{time.monotonic()}"
        first = attempts(store)
        proc = start(job, store, marker)
        if landed >= kills:
            if proc.wait() != 0:
                raise SystemExit(f"the last attempt failed; see {store.with_suffix('.log')}")
            return time.monotonic() - t0, landed
        while steps_by(store, first) == 0 and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(rng.uniform(0, 3 * step_seconds))
        if proc.poll() is not None:  # finished before the kill
            return time.monotonic() - t0, landed
        kill_all(proc, marker)
        landed += 1


def summary(store: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "spotrl_runtime.cli", "audit", str(store), "--summary", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout))


def stream(store: Path) -> list[tuple[int, list[int]]]:
    return [(d["step"], d["idxs"]) for d in AuditStore(open_storage(str(store))).effective()]


def weights(store: Path) -> dict[str, torch.Tensor]:
    """The final full cut's weights."""
    cut = sorted(p for p in (store / "cuts").iterdir() if (p / "manifest.json").exists())[-1]
    manifest = json.loads((cut / "manifest.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for f in manifest["files"]:
        if f["role"] == "weights":
            out.update(torch.load(cut / f["path"], map_location="cpu", weights_only=True))
    return out


def check_same(store: Path, want_store: Path) -> None:
    if stream(store) != stream(want_store):
        raise SystemExit(f"{store}: the effective stream differs from the uninterrupted run's")
    got, want = weights(store), weights(want_store)
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    if differ:
        raise SystemExit(f"{store}: {len(differ)} of {len(want)} tensors differ from the uninterrupted run's")
    docs = AuditStore(open_storage(str(store))).documents()
    mismatched = [d["step"] for d in docs if d.get("version_mismatches")]
    if mismatched:
        raise SystemExit(f"{store}: steps {mismatched} have groups generated by other weights than admitted")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    print(f"seed {seed} (replay with --seed {seed})")
    rows: list[tuple[Any, ...]] = []
    with tempfile.TemporaryDirectory(prefix="bench-abrupt-") as tmp:
        folder = Path(tmp)
        for delta in (1, 0):
            job = job_file(folder, delta, args.steps)
            base = folder / f"uninterrupted-{delta}"
            wall = uninterrupted(job, base)
            step_seconds = wall / args.steps
            store = folder / f"killed-{delta}"
            killed_wall, landed = killed(job, store, args.kills, step_seconds, random.Random(seed))
            check_same(store, base)
            s = summary(store)
            per = max(landed, 1)
            # Generated again: the groups a restore relaunched, and every group of a step retrained.
            again = s["groups_redispatched"] + s["steps_retrained"] * prompts_per_step(job)
            seconds_per_group = wall / (args.steps * prompts_per_step(job))
            rows.append(
                (
                    f"deltaEverySteps {delta}",
                    landed,
                    f"{s['steps_retrained'] / per:.2f}",
                    f"{s['steps_redone'] / per:.2f}",
                    f"{again / per:.1f}",
                    f"{again * seconds_per_group / per:.1f}",
                    f"{wall:.1f}",
                    f"{(killed_wall - wall) / per:.1f}",
                )
            )
    heads = ("setting", "kills", "steps trained twice / kill", "steps redone / kill", "groups generated again / kill")
    title = f"abrupt loss, {args.steps} steps of the chat example"
    table(title, (*heads, "generation s lost / kill", "uninterrupted s", "wall s lost / kill"), rows)
    print("every killed run ended with the uninterrupted run's stream and weights, no version mismatch")


if __name__ == "__main__":
    main()
