"""`make demo`: the tiny job, preempted mid-run, resumed, finished — and what survived.

1. Runs examples/tiny-cpu.yaml with `spotrl run` (cuts in a local folder).
2. Part-way through, sends SIGTERM, as a spot node's shutdown would: the controller takes a
   barrier cut and exits 143.
3. Runs the same command again: it validates the cut, redispatches the unfinished groups,
   and trains to the end.
4. Prints what survived (prompts lost, steps retrained, in-flight groups regenerated,
   finished groups reused), and writes a PNG of reward against step with the preemption
   marked.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def spotrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "spotrl_runtime.cli", *args]


def audit(storage: Path, *extra: str) -> list[dict[str, Any]]:
    out = subprocess.run(spotrl("audit", str(storage), *extra), capture_output=True, text=True, check=True)
    return [json.loads(line) for line in out.stdout.splitlines()]


def trained_steps(storage: Path) -> int:
    folder = storage / "audit"
    return len(list(folder.iterdir())) if folder.exists() else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--job", default=str(ROOT / "examples" / "tiny-cpu.yaml"))
    ap.add_argument("--out", default=str(ROOT / ".out" / "demo"))
    ap.add_argument("--preempt-at", type=float, default=0.4, help="fraction of the steps after which to SIGTERM")
    args = ap.parse_args()

    import yaml

    job = yaml.safe_load(Path(args.job).read_text())
    total = int(job["spec"]["training"]["totalSteps"])
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    storage = out / "cuts"
    run = spotrl("run", "-f", args.job, "--storage", str(storage), "--summary-json")

    print(f"== 1. training {job['metadata']['name']} ({total} steps); cuts go to {storage}", flush=True)
    first = subprocess.Popen([*run, str(out / "first.json")], cwd=out)
    preempt_after = max(1, int(total * args.preempt_at))
    while trained_steps(storage) < preempt_after and first.poll() is None:
        time.sleep(0.05)
    if first.poll() is not None:
        print(f"demo: the run ended (exit {first.returncode}) before step {preempt_after}", file=sys.stderr)
        return 1
    print(f"\n== 2. SIGTERM after step {trained_steps(storage)} (a spot node going away)", flush=True)
    first.send_signal(signal.SIGTERM)
    rc = first.wait(timeout=120)
    if rc != 143:
        print(f"demo: expected exit code 143 after SIGTERM, got {rc}", file=sys.stderr)
        return 1
    barrier = json.loads(
        subprocess.run(
            spotrl("ckpt", "inspect", str(storage), "--json"), capture_output=True, text=True, check=True
        ).stdout
    )

    print("\n== 3. resuming with the same command", flush=True)
    rc = subprocess.run([*run, str(out / "second.json")], cwd=out).returncode
    if rc != 0:
        print(f"demo: the resumed run failed (exit {rc})", file=sys.stderr)
        return rc
    second = json.loads((out / "second.json").read_text())

    stream = audit(storage)
    every = audit(storage, "--all")
    trained = {p for d in stream for p in d["prompts"]}
    owned = [r["idx"] for r in barrier["ledger"]] + [r["idx"] for r in barrier["replay"]]
    lost = [p for p in owned if p not in trained]
    retrained = sorted({d["step"] for d in every if d["attempt"] > 0 and d["step"] < barrier["trainer_step"]})
    in_flight = sum(1 for r in barrier["ledger"] if r["phase"] == "ADMITTED")
    counters = second["counters"]
    rewards = [d["reward"] for d in stream]
    k = max(1, len(rewards) // 5)
    early, late = sum(rewards[:k]) / k, sum(rewards[-k:]) / k

    print("\n== what survived the preemption")
    print(f"  barrier cut:                {barrier['cut_id']} at step {barrier['trainer_step']}")
    print(f"  steps trained:              {len(stream)} of {total}, every one exactly once in the effective stream")
    print(f"  prompts lost:               {len(lost)}")
    print(f"  steps retrained:            {len(retrained)}")
    print(f"  finished groups reused:     {counters['finished_found']} (trained without generating again)")
    print(f"  in-flight groups regenerated: {in_flight} (relaunched with their group id and step)")
    print(f"  groups discarded on restore: {counters['groups_discarded']}")
    print(f"  mean reward, first {k} steps: {early:.3f}; last {k} steps: {late:.3f}")
    png = plot(every, barrier["trainer_step"], out / "reward.png")
    print(f"  plot:                       {png}")
    return 0 if not lost and counters["groups_discarded"] == 0 and len(stream) == total else 1


def plot(records: list[dict[str, Any]], preempted_at: int, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=120)
    for attempt in sorted({d["attempt"] for d in records}):
        pts = sorted((d["step"], d["reward"]) for d in records if d["attempt"] == attempt)
        ax.plot([s for s, _ in pts], [r for _, r in pts], marker="o", ms=3, label=f"controller attempt {attempt}")
    ax.axvline(preempted_at - 0.5, color="red", linestyle="--", label=f"SIGTERM → barrier cut (step {preempted_at})")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("tiny-arith GRPO on 2 CPU cores, preempted and resumed")
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
