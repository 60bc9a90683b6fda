"""`spotrl run --resume auto` from a barrier cut to its first trained step (issue 15, target 2).

    PYTHONPATH=e2e python bench/bench_resume.py [--repeat 5] [--check]

Each round, in a temporary folder: `spotrl run -f examples/tiny-cpu.yaml` trains until a few
more steps are done, gets SIGTERM (a barrier cut commits, exit 143), and the same command is
run again: the figure is the wall time from launching it to its first `step` line, medians
over the rounds. Its phases come from the run's own lines: the process's start up to the
"resumed from cut" line (imports, Ray and the generation worker, the policy, the validation
chain and restore), then up to the first step. The model is in the user's cache (built once,
before the rounds), as it is on a machine that has run the job before. Goal: <= 10 s.
"""

from __future__ import annotations

import argparse
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _recovery_state import table
from _targets import Targets, add_check

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "examples" / "tiny-cpu.yaml"
SPOTRL = [sys.executable, "-m", "spotrl_runtime.cli", "run", "-f", str(JOB)]


def wait_for_line(log: Path, pattern: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> float:
    """Seconds until ``pattern`` is in ``log`` (polled every 20 ms)."""
    t0 = time.monotonic()
    rx = re.compile(pattern, re.M)
    while time.monotonic() - t0 < timeout:
        if rx.search(log.read_text(errors="replace")):
            return time.monotonic() - t0
        if proc.poll() is not None:
            raise RuntimeError(f"the run exited ({proc.returncode}) before /{pattern}/:\n{log.read_text()[-2000:]}")
        time.sleep(0.02)
    raise TimeoutError(f"no /{pattern}/ in {log} within {timeout} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    add_check(parser)
    args = parser.parse_args()
    firsts, resumed, after = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        storage = Path(tmp) / "cuts"
        trained = 0
        for r in range(args.repeat):
            trained += 4
            log = Path(tmp) / f"train-{r}.log"
            with open(log, "wb") as out:
                proc = subprocess.Popen([*SPOTRL, "--storage", str(storage)], stdout=out, stderr=subprocess.STDOUT)
                wait_for_line(log, rf"step +{trained}/", proc)
                proc.send_signal(signal.SIGTERM)
                if proc.wait(120) != 143:
                    raise RuntimeError(f"SIGTERM did not end in a barrier cut (exit {proc.returncode})")
            log = Path(tmp) / f"resume-{r}.log"
            with open(log, "wb") as out:
                argv = [*SPOTRL, "--storage", str(storage), "--max-steps", str(trained + 2)]
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
                first = wait_for_line(log, r"\] step +\d+/", proc)
                proc.wait(120)
            text = log.read_text()
            m = re.search(r"\[ *([\d.]+)s\] resumed from cut \d+ \(barrier\)", text)
            s = re.search(r"\[ *([\d.]+)s\] step +\d+/", text)
            if m is None or s is None:
                raise RuntimeError(f"round {r}: no barrier resume in\n{text[-2000:]}")
            firsts.append(first)
            # The progress clock starts after the CLI's imports: the rest of ``first`` is before it.
            resumed.append(first - (float(s.group(1)) - float(m.group(1))))
            after.append(float(s.group(1)) - float(m.group(1)))
            trained += 2
    table(
        f"spotrl run --resume auto from a barrier cut, tiny job (examples/tiny-cpu.yaml), median of {args.repeat}",
        ("launch -> resumed (imports, Ray, workers, policy, restore)", "resumed -> first step", "launch -> first step"),
        [
            (
                f"{statistics.median(resumed):.2f} s",
                f"{statistics.median(after):.2f} s",
                f"{statistics.median(firsts):.2f} s (goal <= 10 s; min {min(firsts):.2f}, max {max(firsts):.2f})",
            )
        ],
    )
    targets = Targets()
    targets.at_most("launch -> first step after a barrier cut, median s", statistics.median(firsts), 10.0)
    targets.report(args.check)


if __name__ == "__main__":
    main()
