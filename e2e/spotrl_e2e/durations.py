"""Where ``make test``'s time goes: per suite, per module and per test, from pytest's JUnit XML,
and the kind subset's phases (``.e2e-kind/timings``).

``make test`` (``e2e/suite.sh``) writes ``.out/test-report/pytest-1.xml`` ... ``pytest-N.xml``
(one per lane of pytest processes side by side; ``pytest-all.xml`` with
``SPOTRL_SUITE_LANES=none``) and
``pytest-alone.xml`` (the tests marked ``alone``, run with nothing beside them), then this
report (``.out/test-report/durations.txt``) on every run, failed ones included::

    python -m spotrl_e2e.durations REPORT.xml [REPORT.xml ...] [--kind .e2e-kind/timings] [--top 30]

A test's seconds are pytest's "total": its setup, call and teardown, so a session fixture
(a control plane, an S3 server, a baseline run) counts where it is first set up. Runs side by
side add up to more seconds than the wall time; the second line gives each run's wall time
(its report's ``testsuite`` time), the third the machine's speed (:func:`machine_probe`), so
that runs on two machines can be compared.

Each suite has a budget (:data:`SUITE_BUDGETS`, seconds summed over its tests), and the kind
subset one (:data:`KIND_BUDGET`): together what fits CI's time goal on the CI machine
(docs/benchmarks.md, "CI and test-suite durations"). The report prints each suite's seconds
against its budget, and its counts of tests and skips, so a suite that grew, or lost tests to a
skip, is seen on the run that did it. New work fits its suite's budget or moves one.
"""

from __future__ import annotations

import argparse
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

SUITE_BUDGETS: dict[str, float] = {
    "tests/integration/controller": 1285,
    "tests/e2e": 1100,
    "tests/integration/generation": 185,
    "tests/integration/checkpoint": 165,
    "tests/unit": 105,
    "tests/cluster": 65,
    "tests/integration/storage": 40,
    "tests/integration/training": 70,
    "tests/security": 5,
    "tests/integration/rollouts": 20,
}
"""Seconds of test time per suite (setup, call and teardown, summed). Two lanes share the CI
machine's 2 cores, the kind subset the second lane's last step, so the sum with the kind
subset's is about twice their wall time, which with lint and the tests run alone fits 30
minutes. Each is a few percent above what its suite took in the last measured run
(docs/benchmarks.md): a suite that grows past it says so in the report."""
KIND_BUDGET = 400.0
"""Seconds of the kind subset, cluster to teardown."""
PROBE_LOOPS = 2_000_000
"""The probe's fixed work: that many additions of a square in pure Python."""


def machine_probe(repeat: int = 5) -> float:
    """Seconds of :data:`PROBE_LOOPS` in pure Python, the best of ``repeat``: the same work on
    every machine, so a run's seconds can be set against its machine's (the suites' CPU is
    Python and torch, one core a process)."""
    best = float("inf")
    for _ in range(repeat):
        start, total = time.perf_counter(), 0
        for i in range(PROBE_LOOPS):
            total += i * i
        best = min(best, time.perf_counter() - start)
    return best


@dataclass(frozen=True)
class TestTime:
    __test__ = False  # a record, not a pytest test class
    module: str
    """The test file, as a path: ``tests/e2e/test_preemption.py``."""
    name: str
    seconds: float
    outcome: str
    """passed, failed, error or skipped."""

    @property
    def suite(self) -> str:
        """``tests/unit``, ``tests/e2e``, ``tests/integration/controller`` ..."""
        parts = self.module.split("/")
        depth = 3 if len(parts) > 3 and parts[1] == "integration" else 2
        return "/".join(parts[:depth])


def read_junit(text: str) -> list[TestTime]:
    """Every test case of a pytest JUnit XML report."""
    out = []
    for case in ET.fromstring(text).iter("testcase"):
        # A module that fails to import is reported with its dotted path as the name.
        classname = case.get("classname") or case.get("name") or ""
        parts = classname.split(".")
        # pytest names the class path: tests.e2e.test_x or tests.e2e.test_x.TestClass
        mod_parts = parts if not parts or not parts[-1][:1].isupper() else parts[:-1]
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
        out.append(TestTime("/".join(mod_parts) + ".py", case.get("name") or "", float(case.get("time") or 0), outcome))
    return out


def read_wall(text: str) -> float:
    """The seconds the pytest run took, start to end (its ``testsuite`` elements' time)."""
    root = ET.fromstring(text)
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return sum(float(s.get("time") or 0) for s in suites)


def read_phases(text: str) -> list[tuple[str, float]]:
    """The kind run's ``PHASE SECONDS`` lines."""
    rows = []
    for line in text.splitlines():
        name, _, secs = line.strip().rpartition(" ")
        if name and secs.replace(".", "", 1).isdigit():
            rows.append((name, float(secs)))
    return rows


def report(
    tests: list[TestTime],
    phases: list[tuple[str, float]],
    top: int = 30,
    walls: list[tuple[str, float]] | None = None,
    probe: float | None = None,
) -> str:
    """The text of the report; ``walls``: (run, seconds start to end) of each pytest run;
    ``probe``: :func:`machine_probe`'s seconds on the machine that ran them."""
    total = sum(t.seconds for t in tests)
    lines = [f"pytest: {len(tests)} tests, {total:.0f} s"]
    if walls:
        lines.append("wall time: " + ", ".join(f"{name} {secs:.0f} s" for name, secs in walls))
    if probe is not None:
        lines.append(f"machine: the probe (spotrl_e2e.durations.machine_probe) took {probe * 1000:.0f} ms")
    by_suite: dict[str, list[TestTime]] = defaultdict(list)
    by_module: dict[str, list[TestTime]] = defaultdict(list)
    for t in tests:
        by_suite[t.suite].append(t)
        by_module[t.module].append(t)
    lines += ["", f"{'suite':<34} {'tests':>6} {'skipped':>7} {'seconds':>9} {'share':>6} {'budget':>7}"]
    for suite, ts in sorted(by_suite.items(), key=lambda kv: -sum(t.seconds for t in kv[1])):
        secs = sum(t.seconds for t in ts)
        skipped = sum(t.outcome == "skipped" for t in ts)
        share = secs / (total or 1)
        lines.append(f"{suite:<34} {len(ts):>6} {skipped:>7} {secs:>9.1f} {share:>6.1%} {_budget(secs, suite)}")
    lines += ["", f"{'module':<62} {'tests':>6} {'seconds':>9}"]
    modules = sorted(by_module.items(), key=lambda kv: -sum(t.seconds for t in kv[1]))
    for module, ts in modules[:top]:
        lines.append(f"{module:<62} {len(ts):>6} {sum(t.seconds for t in ts):>9.1f}")
    lines += ["", f"the {min(top, len(tests))} slowest tests:"]
    for t in sorted(tests, key=lambda t: -t.seconds)[:top]:
        lines.append(f"{t.seconds:>8.1f} s  {t.outcome:<7} {t.module}::{t.name}")
    if phases:
        kind = sum(s for _, s in phases)
        lines += ["", f"kind subset: {kind:.0f} s, budget {KIND_BUDGET:.0f} s{' OVER' if kind > KIND_BUDGET else ''}"]
        lines += [f"  {name:<20} {secs:>7.0f} s" for name, secs in phases]
    return "\n".join(lines)


def _budget(seconds: float, suite: str) -> str:
    """``1150``, or ``1150 OVER by 12%``; ``none`` for a suite with no budget (give it one)."""
    budget = SUITE_BUDGETS.get(suite)
    if budget is None:
        return "   none: give this suite a budget in SUITE_BUDGETS"
    over = f" OVER by {seconds / budget - 1:.0%}" if seconds > budget else ""
    return f"{budget:>7.0f}{over}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m spotrl_e2e.durations", description=__doc__)
    p.add_argument("junit", nargs="+", help="pytest's --junitxml reports (one per pytest run)")
    p.add_argument("--kind", help="the kind run's phase timings (PHASE SECONDS lines); missing: none")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    tests: list[TestTime] = []
    walls = []
    for junit in args.junit:
        try:
            text = Path(junit).read_text()
            tests += read_junit(text)
            walls.append((Path(junit).stem, read_wall(text)))
        except (OSError, ET.ParseError) as err:
            print(f"durations: {junit}: {err}", file=sys.stderr)
            return 1
    timings = Path(args.kind) if args.kind else None
    phases = read_phases(timings.read_text()) if timings is not None and timings.exists() else []
    print(report(tests, phases, args.top, walls, machine_probe()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
