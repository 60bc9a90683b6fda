#!/usr/bin/env bash
# pytest over tests/ for `make test`: lanes of pytest processes side by side, then the tests
# marked `alone` by themselves. make test runs the kind subset (`make e2e-kind-ci`) as the
# last lane's next step, beside the other lanes.
#
#   e2e/suite.sh REPORT_DIR [PYTEST ARGS...]
#
# $SPOTRL_SUITE_LANES names the lanes' paths, lanes separated by ';', paths by spaces; one
# more lane runs every other test under tests/ (so a new folder is never left out).
# SPOTRL_SUITE_LANES=none runs tests/ in one process. The default is two lanes: unit (first:
# its tests with second-long bounds do not run beside the kind subset), the test control
# plane's suites (they share one cluster, so they stay in one process), security, the
# generation suite, the delta cuts' and vLLM's controller tests; then the rest (the other controller
# suites, checkpoint, storage, training) and, after it, the kind subset. Which
# suites go where only evens the lanes. Most tests wait (on a process start, a watch, a barrier), so
# two lanes share 2 cores well; three did not (the CPU saturated and controller tests failed
# under the load). The measurements: docs/benchmarks.md, "CI and test-suite durations".
# The CPU figure printed at the end says how busy the machine was while the lanes ran.
#
# $SPOTRL_SUITE_NOT: a marker whose tests no pytest here runs (make test: kind_ci, the tests its
# $SPOTRL_SUITE_THEN runs on kind, where they test more: real kubelets, images and pod deletion).
#
# $SPOTRL_SUITE_THEN: a command (bash) run once the last lane has passed, beside the lanes
# still running, so that the machine runs two things at a time throughout. Its failure fails
# the suite; it does not run when the last lane failed (with one process: after it, when it
# passed).
#
# Then the tests marked `alone` (timing windows of a second or so) with nothing beside them.
# Reports: REPORT_DIR/pytest-1.xml ... pytest-N.xml (pytest-all.xml with one lane) and
# pytest-alone.xml (JUnit); each lane's output in REPORT_DIR/pytest-K.log (the last lane's is
# also shown as it runs, the others' when all are done).
# REPORT_DIR/failures.txt: the last lines of each part that failed (a lane's log, the $THEN
# command's output), for `make test` to print last, where a truncated CI log still shows them.
# Exit: 0 when everything passed, else the first failure's code.
set -uo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
REPORT=${1:?usage: e2e/suite.sh REPORT_DIR [PYTEST ARGS...]}
shift
DEFAULT_LANES="tests/unit tests/e2e tests/cluster tests/security tests/integration/generation tests/integration/controller/test_delta_cuts.py tests/integration/controller/test_controller_vllm.py"
LANES=${SPOTRL_SUITE_LANES:-$DEFAULT_LANES}
THEN=${SPOTRL_SUITE_THEN:-}
NOT=${SPOTRL_SUITE_NOT:+ and not $SPOTRL_SUITE_NOT}
unset SPOTRL_SUITE_THEN SPOTRL_SUITE_NOT # not inherited by the tests: some run this script
cd "$ROOT"
mkdir -p "$REPORT"
rm -f "$REPORT"/pytest-*.xml "$REPORT"/pytest-*.log "$REPORT"/then.log "$REPORT"/failures.txt

first_failure() { # code: keep the first non-zero code
  [ "$rc" != 0 ] || rc=$1
}
failed() { # code: a failure, but for pytest's 5 ("no tests collected") with extra arguments
  [ "$1" != 0 ] && ! { [ "$1" = 5 ] && [ "$nargs" -gt 0 ]; }
}
note_failure() { # what code log: a failed part's last lines into failures.txt
  failed "$2" || return 0
  { echo "== $1: exit $2; the last lines of $3:"; tail -n 120 "$3"; } >>"$REPORT/failures.txt"
}
then_after() { # code of the lane it follows; runs $THEN when that passed
  [ -n "$THEN" ] || return 0
  if failed "$1"; then
    echo "== not run, the lane before it failed: $THEN"
    return 0
  fi
  echo "== then, at $((SECONDS - start)) s: $THEN"
  bash -c "$THEN" 2>&1 | tee "$REPORT/then.log"
  local c=${PIPESTATUS[0]}
  echo "== then: exit $c at $((SECONDS - start)) s"
  note_failure "then ($THEN)" "$c" "$REPORT/then.log"
  first_failure "$c"
}
cpu_ticks() { # "busy total" jiffies of all CPUs since boot
  awk '/^cpu /{t=0; for (i=2; i<=NF; i++) t+=$i; print t-$5-$6, t}' /proc/stat
}

rc=0
nargs=$#
read -r busy0 total0 <<<"$(cpu_ticks)"
start=$SECONDS
if [ "$LANES" = none ]; then
  "$PY" -m pytest -m "not alone$NOT" --durations=20 --junitxml="$REPORT/pytest-all.xml" "$@" 2>&1 |
    tee "$REPORT/pytest-all.log"
  code=${PIPESTATUS[0]}
  note_failure "tests/" "$code" "$REPORT/pytest-all.log"
  rc=0
  then_after "$code"
  first_failure "$code"
else
  IFS=';' read -r -a lanes <<<"$LANES"
  ignore=()
  for i in "${!lanes[@]}"; do # every lane checked before any starts
    read -r -a paths <<<"${lanes[$i]}"
    ((${#paths[@]})) || { echo "suite: lane $((i + 1)) of SPOTRL_SUITE_LANES names no path" >&2; exit 2; }
    for path in "${paths[@]}"; do
      [ -e "$path" ] || { echo "suite: SPOTRL_SUITE_LANES names $path, which does not exist" >&2; exit 2; }
      ignore+=(--ignore="$path")
    done
  done
  pids=()
  for i in "${!lanes[@]}"; do
    n=$((i + 1))
    read -r -a paths <<<"${lanes[$i]}"
    "$PY" -m pytest "${paths[@]}" -m "not alone$NOT" --durations=10 --junitxml="$REPORT/pytest-$n.xml" "$@" \
      >"$REPORT/pytest-$n.log" 2>&1 &
    pids+=($!)
  done
  last=$((${#lanes[@]} + 1))
  "$PY" -m pytest tests "${ignore[@]}" -m "not alone$NOT" --durations=10 --junitxml="$REPORT/pytest-$last.xml" "$@" 2>&1 |
    tee "$REPORT/pytest-$last.log"
  code=${PIPESTATUS[0]}
  echo "== lane $last (the rest of tests/): exit $code at $((SECONDS - start)) s"
  note_failure "lane $last (the rest of tests/)" "$code" "$REPORT/pytest-$last.log"
  then_after "$code"
  for i in "${!pids[@]}"; do
    n=$((i + 1))
    wait "${pids[$i]}"
    c=$?
    echo "== lane $n (${lanes[$i]}): exit $c; done by $((SECONDS - start)) s; its output ($REPORT/pytest-$n.log):"
    cat "$REPORT/pytest-$n.log"
    note_failure "lane $n (${lanes[$i]})" "$c" "$REPORT/pytest-$n.log"
    first_failure "$c"
  done
  first_failure "$code"
fi
read -r busy1 total1 <<<"$(cpu_ticks)"
echo "== the lanes took $((SECONDS - start)) s; CPU busy $(((busy1 - busy0) * 100 / (total1 - total0 + 1)))% of $(nproc) cores meanwhile"

echo "== the tests marked alone (timing windows of a second or so), with nothing beside them"
arc=0
"$PY" -m pytest -m "alone$NOT" --junitxml="$REPORT/pytest-alone.xml" "$@" 2>&1 | tee "$REPORT/pytest-alone.log"
arc=${PIPESTATUS[0]}
note_failure "the tests marked alone" "$arc" "$REPORT/pytest-alone.log"
first_failure "$arc"
# pytest's 5 ("no tests collected") is a failure, unless extra arguments (-k, -m) chose fewer.
[ "$rc" = 5 ] && [ $# -gt 0 ] && rc=0
exit "$rc"
