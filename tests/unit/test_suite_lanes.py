"""`e2e/suite.sh`, the lanes of `make test`, run with a stand-in for Python that records each
pytest call: every lane gets its paths, the last lane every other test (never a test twice,
never one left out), a failure in any lane is the exit code, and a lane that names a missing
path starts nothing."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "e2e" / "suite.sh"

# Records its arguments (one per line) in CALLS/<its pid> (lanes run at once); runs $PRE_<word>
# first and exits with $FAIL_<word> when one of its arguments is that word (a lane's path's last
# part).
FAKE_PY = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$CALLS/$$"
echo "${SPOTRL_SUITE_THEN-unset}" > "$CALLS/../then-env-$$"
for a in "$@"; do
  pre="PRE_$(basename "$a" | tr -c 'A-Za-z0-9\\n' _)"
  if [ -n "${!pre:-}" ]; then eval "${!pre}"; fi
done
for a in "$@"; do
  key="FAIL_$(basename "$a" | tr -c 'A-Za-z0-9\\n' _)"
  if [ -n "${!key:-}" ]; then exit "${!key}"; fi
done
exit 0
"""


def run_suite(tmp_path: Path, lanes: str | None, **env: str) -> tuple[int, list[list[str]], str]:
    calls = tmp_path / "calls"
    calls.mkdir(parents=True)
    fake = tmp_path / "python"
    fake.write_text(FAKE_PY)
    fake.chmod(0o755)
    ours = ("SPOTRL_SUITE_LANES", "SPOTRL_SUITE_THEN", "SPOTRL_SUITE_NOT")
    full = {k: v for k, v in os.environ.items() if k not in ours}
    full.update(PY=str(fake), CALLS=str(calls), **env)
    if lanes is not None:
        full["SPOTRL_SUITE_LANES"] = lanes
    out = subprocess.run(
        ["bash", str(SUITE), str(tmp_path / "report")], env=full, capture_output=True, text=True, timeout=60
    )
    recorded = [p.read_text().splitlines() for p in sorted(calls.iterdir(), key=lambda p: p.stat().st_mtime_ns)]
    return out.returncode, recorded, out.stdout + out.stderr


def marker(call: list[str]) -> str:
    """The ``-m`` expression of a pytest call (``call[:2]`` is ``-m pytest``)."""
    args = call[2:]
    return args[args.index("-m") + 1]


def paths_of(call: list[str]) -> list[str]:
    args = call[2:]
    return args[: args.index("-m")]


def lane_of(calls: list[list[str]], junit: str) -> list[str]:
    (call,) = [c for c in calls if f"--junitxml={junit}" in c]
    return call


def test_each_lane_runs_its_paths_and_the_last_lane_the_rest(tmp_path: Path) -> None:
    code, calls, out = run_suite(tmp_path, "tests/e2e tests/cluster;tests/integration/controller/test_fence.py")
    assert code == 0, out
    report = tmp_path / "report"
    one = lane_of(calls, f"{report}/pytest-1.xml")
    two = lane_of(calls, f"{report}/pytest-2.xml")
    rest = lane_of(calls, f"{report}/pytest-3.xml")
    assert paths_of(one) == ["tests/e2e", "tests/cluster"]
    assert paths_of(two) == ["tests/integration/controller/test_fence.py"]
    assert paths_of(rest)[0] == "tests"
    ignored = sorted(a.removeprefix("--ignore=") for a in rest if a.startswith("--ignore="))
    assert ignored == ["tests/cluster", "tests/e2e", "tests/integration/controller/test_fence.py"]
    for lane in (one, two, rest):
        assert marker(lane) == "not alone"
    alone = lane_of(calls, f"{report}/pytest-alone.xml")
    assert marker(alone) == "alone"
    assert len(calls) == 4
    assert "CPU busy" in out


def test_the_default_lanes_name_paths_that_exist(tmp_path: Path) -> None:
    code, calls, out = run_suite(tmp_path, None)
    assert code == 0, out
    lanes = [c for c in calls if any(a.startswith("--junitxml=") and "alone" not in a for a in c)]
    assert len(lanes) >= 2
    rest = [c for c in lanes if c[2] == "tests"]
    assert len(rest) == 1
    named = [p for c in lanes if c is not rest[0] for p in paths_of(c)]
    assert sorted(named) == sorted(a.removeprefix("--ignore=") for a in rest[0] if a.startswith("--ignore="))
    assert all((ROOT / p).exists() for p in named)


def test_a_failing_lane_fails_the_suite_and_the_others_still_run(tmp_path: Path) -> None:
    code, calls, out = run_suite(tmp_path, "tests/e2e;tests/cluster", FAIL_cluster="3")
    assert code == 3, out
    assert len(calls) == 4, "the other lanes and the alone tests ran"
    assert "lane 2 (tests/cluster): exit 3" in out


def test_one_process_with_none(tmp_path: Path) -> None:
    code, calls, out = run_suite(tmp_path, "none")
    assert code == 0, out
    assert [marker(c) for c in calls] == ["not alone", "alone"]
    assert f"--junitxml={tmp_path}/report/pytest-all.xml" in calls[0]


def test_a_lane_naming_a_missing_path_starts_nothing(tmp_path: Path) -> None:
    code, calls, out = run_suite(tmp_path, "tests/e2e;tests/nowhere")
    assert code == 2
    assert "SPOTRL_SUITE_LANES names tests/nowhere, which does not exist" in out
    assert calls == [], "no lane started before the check"
    code, calls, out = run_suite(tmp_path / "empty-lane", "tests/e2e;;tests/cluster")
    assert code == 2
    assert "lane 2 of SPOTRL_SUITE_LANES names no path" in out
    assert calls == []


# The command after the last lane: records when it ran (after which lanes had recorded their
# calls), and exits $THEN_EXIT.
THEN = 'ls "$CALLS" | wc -l > "$CALLS/../then-saw"; touch "$CALLS/../then-ran"; exit "${THEN_EXIT:-0}"'


def test_the_command_after_the_last_lane_runs_beside_the_others_before_the_alone_tests(tmp_path: Path) -> None:
    # Lane 1 waits until the command has run: it ran while lane 1 was still running.
    ran = tmp_path / "then-ran"
    held = f'for _ in $(seq 200); do [ -e "{ran}" ] && break; sleep 0.05; done; [ -e "{ran}" ] || exit 9'
    code, calls, out = run_suite(tmp_path, "tests/e2e", SPOTRL_SUITE_THEN=THEN, PRE_e2e=held)
    assert code == 0, out
    assert (tmp_path / "then-ran").exists(), out
    saw = int((tmp_path / "then-saw").read_text())
    assert saw == 2, "both lanes had started, the alone tests had not"
    assert marker(calls[-1]) == "alone"
    seen = {f.read_text().strip() for f in tmp_path.glob("then-env-*")}
    assert seen == {"unset"}, "the tests do not inherit the command (some run this script themselves)"


def test_a_failing_command_after_the_lanes_fails_the_suite(tmp_path: Path) -> None:
    code, calls, out = run_suite(tmp_path, "tests/e2e", SPOTRL_SUITE_THEN=THEN, THEN_EXIT="7")
    assert code == 7, out
    assert "then: exit 7" in out
    assert marker(calls[-1]) == "alone", "the alone tests still ran"


def test_the_command_does_not_run_when_the_last_lane_failed(tmp_path: Path) -> None:
    code, _, out = run_suite(tmp_path, "tests/e2e", SPOTRL_SUITE_THEN=THEN, FAIL_tests="4")
    assert code == 4, out
    assert not (tmp_path / "then-ran").exists()
    assert "not run, the lane before it failed" in out
    code, _, out = run_suite(tmp_path / "one", "none", SPOTRL_SUITE_THEN=THEN)
    assert code == 0, out
    assert (tmp_path / "one" / "then-ran").exists(), "with one process, after it"


def test_what_failed_is_kept_last_with_each_failed_parts_last_lines(tmp_path: Path) -> None:
    # A lane that dies of a signal (as a segfaulting pytest does) and a failing command after the
    # last lane: failures.txt names both with their last lines; a passing lane is not in it.
    died = 'echo "Fatal Python error: Segmentation fault"; kill -SEGV $$'
    code, _, out = run_suite(
        tmp_path, "tests/e2e;tests/cluster", PRE_cluster=died, SPOTRL_SUITE_THEN="echo the command said; exit 7"
    )
    assert code == 7, out
    failures = (tmp_path / "report" / "failures.txt").read_text()
    assert "== lane 2 (tests/cluster): exit 139" in failures
    assert "Fatal Python error: Segmentation fault" in failures
    assert "exit 7" in failures
    assert "the command said" in failures
    assert "lane 1" not in failures
    assert "lane 3" not in failures
    code, _, out = run_suite(tmp_path / "passed", "tests/e2e")
    assert code == 0, out
    assert not (tmp_path / "passed" / "report" / "failures.txt").exists()


def test_a_marker_left_out_is_left_out_of_every_pytest_call(tmp_path: Path) -> None:
    # make test: the kind subset's tests run on kind only (SPOTRL_SUITE_NOT=kind_ci).
    code, calls, out = run_suite(tmp_path, "tests/e2e", SPOTRL_SUITE_NOT="kind_ci")
    assert code == 0, out
    lanes, alone = "not alone and not kind_ci", "alone and not kind_ci"
    assert sorted(marker(c) for c in calls) == [alone, lanes, lanes]
    code, calls, out = run_suite(tmp_path / "one", "none", SPOTRL_SUITE_NOT="kind_ci")
    assert [marker(c) for c in calls] == [lanes, alone]
