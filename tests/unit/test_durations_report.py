"""The durations report `make test` writes: suites, modules and tests ranked by their seconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from spotrl_e2e.durations import (
    KIND_BUDGET,
    SUITE_BUDGETS,
    TestTime,
    machine_probe,
    main,
    read_junit,
    read_phases,
    report,
)

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.e2e.test_preemption" name="test_drain[aws-notice]" time="120.5"/>
<testcase classname="tests.e2e.test_preemption" name="test_loss" time="80.0"><failure message="x"/></testcase>
<testcase classname="tests.integration.controller.test_fence" name="test_fenced" time="60.25"/>
<testcase classname="tests.unit.operator.test_reconcile" name="test_a" time="0.5"/>
<testcase classname="tests.unit.test_cli.TestRun" name="test_b" time="0.01"><skipped/></testcase>
<testcase classname="" name="tests.unit.test_broken" time="0.2"><error message="collection failure"/></testcase>
</testsuite></testsuites>
"""


def test_tests_are_grouped_by_suite_and_module() -> None:
    tests = read_junit(JUNIT)
    assert [(t.module, t.suite, t.outcome) for t in tests] == [
        ("tests/e2e/test_preemption.py", "tests/e2e", "passed"),
        ("tests/e2e/test_preemption.py", "tests/e2e", "failed"),
        ("tests/integration/controller/test_fence.py", "tests/integration/controller", "passed"),
        ("tests/unit/operator/test_reconcile.py", "tests/unit", "passed"),
        ("tests/unit/test_cli.py", "tests/unit", "skipped"),
        ("tests/unit/test_broken.py", "tests/unit", "error"),
    ]
    text = report(tests, read_phases("docker 3\nload 325\nnot a line\n"), top=2)
    lines = text.splitlines()
    assert lines[0] == "pytest: 6 tests, 261 s"
    suites = lines[lines.index(next(line for line in lines if line.startswith("suite"))) + 1 :][:3]
    assert [s.split()[0] for s in suites] == ["tests/e2e", "tests/integration/controller", "tests/unit"]
    assert "the 2 slowest tests:" in lines
    slowest = lines[lines.index("the 2 slowest tests:") + 1 :][:2]
    assert slowest[0].split()[:3] == ["120.5", "s", "passed"]
    assert "failed  tests/e2e/test_preemption.py::test_loss" in slowest[1]
    assert f"kind subset: 328 s, budget {KIND_BUDGET:.0f} s" in lines
    assert any(line.split() == ["load", "325", "s"] for line in lines)


def test_the_command_reads_the_files_and_says_what_is_missing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    xml = tmp_path / "pytest-1.xml"
    xml.write_text(JUNIT.replace('tests="5"', 'tests="5" time="200.5"'))
    alone = tmp_path / "pytest-alone.xml"
    alone.write_text(
        '<testsuites><testsuite name="pytest" time="10.0">'
        '<testcase classname="tests.integration.storage.test_storage_faults" name="test_stall" time="9.5"/>'
        "</testsuite></testsuites>"
    )
    assert main([str(xml), str(alone), "--kind", str(tmp_path / "no-timings")]) == 0
    first, second, third = capsys.readouterr().out.splitlines()[:3]
    assert first == "pytest: 7 tests, 271 s"  # 261.46 + 9.5
    assert second == "wall time: pytest-1 200 s, pytest-alone 10 s"
    assert third.startswith("machine: the probe (spotrl_e2e.durations.machine_probe) took ")
    assert main([str(xml), str(tmp_path / "missing.xml")]) == 1
    assert "missing.xml" in capsys.readouterr().err


def test_the_report_names_the_machines_speed_so_two_runs_compare() -> None:
    tests = read_junit(JUNIT)
    lines = report(tests, [], walls=[("pytest-1", 200.0)], probe=0.0834).splitlines()
    assert lines[2] == "machine: the probe (spotrl_e2e.durations.machine_probe) took 83 ms"
    assert not any(line.startswith("machine:") for line in report(tests, []).splitlines())
    assert machine_probe(repeat=1) > 0


def test_each_suite_is_shown_against_its_budget_with_its_skips() -> None:
    e2e = SUITE_BUDGETS["tests/e2e"]
    tests = [
        TestTime("tests/e2e/test_a.py", "t1", e2e * 0.75, "passed"),
        TestTime("tests/e2e/test_a.py", "t2", e2e * 0.5, "skipped"),
        TestTime("tests/unit/test_b.py", "t3", 1.0, "passed"),
        TestTime("tests/newsuite/test_c.py", "t4", 1.0, "passed"),
    ]
    rows = {line.split()[0]: line.split() for line in report(tests, [("tests", KIND_BUDGET + 1)]).splitlines() if line}
    assert rows["tests/e2e"][1:3] == ["2", "1"], "two tests, one skipped"
    assert rows["tests/e2e"][5:] == [f"{e2e:.0f}", "OVER", "by", "25%"]
    assert rows["tests/unit"][1:3] == ["1", "0"]
    assert "OVER" not in rows["tests/unit"]
    assert "none:" in rows["tests/newsuite"], "a suite with no budget says so"
    assert any(
        line.endswith("OVER") and line.startswith("kind subset")
        for line in report(tests, [("t", KIND_BUDGET + 1)]).splitlines()
    )


def test_the_budgets_fit_thirty_minutes_of_ci_and_every_suite_has_one() -> None:
    """Two lanes on 2 cores, the kind subset as the second lane's last step: their wall time is
    about half the summed seconds; with lint (about 60 s) and the tests run alone (about 20 s),
    30 minutes at most."""
    assert (sum(SUITE_BUDGETS.values()) + KIND_BUDGET) / 2 + 60 + 20 <= 30 * 60
    tests = Path(__file__).parents[1]
    suites = {
        TestTime(str(f.relative_to(tests.parent)), "t", 0, "passed").suite
        for f in tests.rglob("test_*.py")
        if "mutations" not in f.parts
    }
    assert suites == set(SUITE_BUDGETS), "every suite has a budget, and every budget a suite"
