#!/usr/bin/env bash
# pytest over tests/ for `make test`: two processes side by side, then the tests marked
# `alone` by themselves. (make test then runs the kind subset, `make e2e-kind-ci`.)
#
#   e2e/suite.sh REPORT_DIR [PYTEST ARGS...]
#
# Lane a: the folders in $SPOTRL_SUITE_A (default: the test control plane's suites, which
# share one cluster, and the integration suites that start no controller). Lane b: every
# other test under tests/ (so a new folder is never left out): the controller suites, unit
# tests. Measured on 2 cores, warm: lane a 1803 s and lane b 1945 s side by side, against
# 3053 s for the same tests in one process (README, Tests). SPOTRL_SUITE_PARTS=1 runs tests/
# in one process instead.
#
# Then the tests marked `alone` (timing windows of a second or so) with nothing beside them.
# Reports: REPORT_DIR/pytest-a.xml, -b.xml (or -all.xml), -alone.xml (JUnit); lane a's output
# REPORT_DIR/pytest-a.log (shown when the lanes are done; lane b's is shown as it runs).
# Exit: 0 when everything passed, else the first failure's code.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
REPORT=${1:?usage: e2e/suite.sh REPORT_DIR [PYTEST ARGS...]}
shift
A=${SPOTRL_SUITE_A:-tests/e2e tests/cluster tests/security tests/integration/generation tests/integration/checkpoint tests/integration/storage tests/integration/training}
cd "$ROOT"
mkdir -p "$REPORT"
rm -f "$REPORT"/pytest-*.xml "$REPORT"/pytest-*.log

first_failure() { # rc code: keep the first non-zero code
  [ "$rc" != 0 ] || rc=$1
}

rc=0
if [ "${SPOTRL_SUITE_PARTS:-2}" = 1 ]; then
  "$PY" -m pytest -m "not alone" --durations=20 --junitxml="$REPORT/pytest-all.xml" "$@" || rc=$?
else
  ignore=()
  for path in $A; do
    [ -e "$path" ] || { echo "suite: SPOTRL_SUITE_A names $path, which does not exist" >&2; exit 2; }
    ignore+=(--ignore="$path")
  done
  # shellcheck disable=SC2086
  "$PY" -m pytest $A -m "not alone" --durations=10 --junitxml="$REPORT/pytest-a.xml" "$@" >"$REPORT/pytest-a.log" 2>&1 &
  a=$!
  "$PY" -m pytest tests "${ignore[@]}" -m "not alone" --durations=10 --junitxml="$REPORT/pytest-b.xml" "$@" 2>&1 |
    tee "$REPORT/pytest-b.log"
  b=${PIPESTATUS[0]}
  echo "== lane b (the rest of tests/): exit $b at $SECONDS s"
  wait "$a"
  a=$?
  echo "== lane a ($A): exit $a at $SECONDS s; its output ($REPORT/pytest-a.log):"
  cat "$REPORT/pytest-a.log"
  first_failure "$a"
  first_failure "$b"
fi

echo "== the tests marked alone (timing windows of a second or so), with nothing beside them"
arc=0
"$PY" -m pytest -m alone --junitxml="$REPORT/pytest-alone.xml" "$@" || arc=$?
first_failure "$arc"
# pytest's 5 ("no tests collected") is a failure, unless extra arguments (-k, -m) chose fewer.
[ "$rc" = 5 ] && [ $# -gt 0 ] && rc=0
exit "$rc"
