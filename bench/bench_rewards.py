"""Reward scoring with ``spec.reward.workers`` processes against one (issue 58).

    PYTHONPATH=e2e python bench/bench_rewards.py [--completions 1024] [--group-size 8] [--workers 1,2]
        [--repeat 3] [--check]

The built-in ``math_verify`` reward scores ``--completions`` completions, a group of
``--group-size`` at a time through :meth:`RewardRunner.score`, as the controller scores each
generated group, with each worker count in turn (the rounds interleaved, each count first in
turn, so that the machine's speed drifting during the run hits every count alike); the figure
is the median wall time of a round, and the target the median of each round's ratio. The
completions are the shapes models write: ``\\boxed{}``, ``$...$``, LaTeX fractions and plain
numbers, right and wrong, each different (math-verify caches what it parsed). The processes load
the reward before the clock starts (:meth:`RewardRunner.ready`). Every count must give the same
scores, in the same order; the same call in this process, without any child, is shown for what
the processes cost. Goal: 2 workers take at most 0.7 of 1 worker's time where the machine gives
two busy processes 1.6 CPUs or more (measured before and after: these machines are shared).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time

from _recovery_state import table
from _targets import Targets, add_check
from spotrl_runtime.api.rljob import Reward
from spotrl_runtime.core.types import Prompt
from spotrl_runtime.cpus import pod_cpus
from spotrl_runtime.rewards.builtin import math_verify
from spotrl_runtime.rewards.isolation import RewardIsolation
from spotrl_runtime.rewards.runner import RewardRunner, Score

GOAL = 0.7
FREE_FOR_TARGET = 1.6
"""The target is measured only where two busy processes got this many CPUs, before and after:
on a machine whose other work leaves one CPU, no count of workers can be faster than one."""


def groups(completions: int, group_size: int, seed: int = 0) -> list[tuple[Prompt, list[str]]]:
    """Prompts with a fraction or an integer for answer, each with ``group_size`` completions:
    about half right, in the forms models write them, with a line of working before."""
    rng = random.Random(seed)
    out: list[tuple[Prompt, list[str]]] = []
    for g in range(completions // group_size):
        p, q = rng.randint(1, 500), rng.randint(2, 60)
        answer = f"{p}/{q}" if g % 2 else str(p * q)
        value = p / q if g % 2 else float(p * q)
        texts = []
        for k in range(group_size):
            guess = value if rng.random() < 0.5 else value + rng.randint(1, 9)
            shown = f"\\frac{{{p}}}{{{q}}}" if g % 2 and guess == value and k % 2 else f"{guess:g}"
            working = f"First, {p} and {q} give {p * q + k} so far. "
            texts.append(
                [
                    f"{working}So the answer is $\\boxed{{{shown}}}$.",
                    f"{working}The answer is ${shown}$.",
                    f"{working}Therefore \\boxed{{{shown}}}",
                    f"{working}{shown}",
                ][k % 4]
            )
        out.append((Prompt(idx=g, task_name="math", text="...", answer=answer), texts))
    return out


def _direct(work: list[tuple[Prompt, list[str]]]) -> tuple[float, list[list[Score]]]:
    t0 = time.perf_counter()
    scores: list[list[Score]] = [[math_verify(prompt, t) for t in texts] for prompt, texts in work]
    return time.perf_counter() - t0, scores


def scored(runner: RewardRunner, work: list[tuple[Prompt, list[str]]]) -> tuple[float, list[list[Score]]]:
    t0 = time.perf_counter()
    scores = [runner.score(prompt, texts, stop_at_failure=False) for prompt, texts in work]
    return time.perf_counter() - t0, scores


SPIN = "sum(i * i for i in range(3_000_000))"


def cpus_free() -> float:
    """How many CPUs the machine gives two processes now: 2 x (one busy process's time) / (the
    time of two side by side); 2.0 on an idle machine of 2 or more CPUs, less when other work
    takes them (these machines are shared)."""

    def run(n: int) -> float:
        t0 = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(n)]
        for proc in procs:
            proc.wait()
        return time.perf_counter() - t0

    return 2 * run(1) / run(2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--completions", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--workers", default="1,2", help="worker counts, the first the baseline")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=30.0, help="spec.reward.timeoutSeconds")
    add_check(parser)
    args = parser.parse_args()
    counts = [int(w) for w in args.workers.split(",")]
    runners = {
        w: RewardRunner(
            Reward(name="math_verify"), timeout=args.timeout, isolation=RewardIsolation.of(os.environ, ()), workers=w
        )
        for w in counts
    }
    load = os.getloadavg()  # the machine is shared: other work takes CPUs the workers would use
    free = [cpus_free()]
    times: dict[int, list[float]] = {w: [] for w in counts}
    in_process: list[float] = []
    right = 0
    try:
        for r in runners.values():
            r.ready()
        warm = groups(8 * args.group_size, args.group_size, seed=-1)  # sympy loads more on its first parses
        _direct(warm)
        for r in runners.values():
            scored(r, warm)
        for round_ in range(args.repeat):
            work = groups(args.completions, args.group_size, seed=round_)  # nothing scored twice
            seconds, direct = _direct(work)
            in_process.append(seconds)
            right = sum(s == 1.0 for group in direct for s in group)
            order = list(runners.items())
            for w, r in order if round_ % 2 == 0 else order[::-1]:  # neither count always goes first
                seconds, scores = scored(r, work)
                times[w].append(seconds)
                if scores != direct:
                    raise SystemExit(f"{w} workers scored differently from math_verify called in this process")
    finally:
        for r in runners.values():
            r.close()
    free.append(cpus_free())

    base = statistics.median(times[counts[0]])
    n = args.completions // args.group_size * args.group_size
    direct_median = statistics.median(in_process)
    rows = [
        (
            "math_verify called in this process (no isolation, no timeout)",
            f"{direct_median:.2f} s",
            f"{direct_median / n * 1e3:.2f} ms",
            f"{direct_median / base:.2f}",
        )
    ]
    for w in counts:
        median = statistics.median(times[w])
        rows.append(
            (
                f"reward.workers: {w}",
                f"{median:.2f} s ({min(times[w]):.2f}–{max(times[w]):.2f})",
                f"{median / n * 1e3:.2f} ms",
                f"**{median / base:.2f}**",
            )
        )
    table(
        f"math_verify on {n} completions (about {right} right), groups of {args.group_size}, "
        f"{pod_cpus()} CPUs, of which two busy processes got {free[0]:.1f} before and {free[1]:.1f} after "
        f"(load average {load[0]:.1f} before, {os.getloadavg()[0]:.1f} after), median of {args.repeat}",
        ("scored by", "seconds", "per completion", f"ratio to {counts[0]} worker(s)"),
        rows,
    )
    targets = Targets()
    if counts[0] == 1 and 2 in counts:
        paired = statistics.median(a / b for a, b in zip(times[2], times[1], strict=True))  # round by round
        print(f"\n2 workers / 1 worker, the median of each round's ratio: {paired:.2f}")
        if min(free) < FREE_FOR_TARGET:
            print(f"no target: the machine gave two busy processes {min(free):.1f} CPUs (< {FREE_FOR_TARGET:g})")
        else:
            targets.at_most("2 workers / 1 worker, math_verify, median of the rounds' ratios", paired, GOAL)
    targets.report(args.check)


if __name__ == "__main__":
    main()
