#!/usr/bin/env bash
# Brings the Debian packages a make target (or script) needs, the one way every target does:
#
#   e2e/toolchain/system-packages.sh WHO COMMAND:PACKAGE ...
#
# For each COMMAND not on PATH (or, for a shared library such as libnuma.so.1, one the dynamic
# linker does not know: ldconfig -p), its PACKAGE is installed with apt-get, as root (one apt at a
# time: a lock beside apt's own). Not root, or no apt-get: one line says what to run, exit 2.
# $SPOTRL_APT_GET names apt-get (tests/unit/test_system_packages.py gives a fake one).
set -euo pipefail
apt=${SPOTRL_APT_GET:-apt-get}
who=${1:?usage: system-packages.sh WHO COMMAND:PACKAGE ...}
shift
missing=()
have() {
  case $1 in
  # The cache is read whole before grep: `ldconfig -p | grep -q` under pipefail fails whenever
  # grep exits at its match before ldconfig has written the rest (SIGPIPE).
  *.so | *.so.*) grep -q "^[[:space:]]*$1 " <<<"$(ldconfig -p 2>/dev/null || /sbin/ldconfig -p 2>/dev/null)" ;;
  *) command -v "$1" >/dev/null 2>&1 ;;
  esac
}
for pair in "$@"; do
  have "${pair%%:*}" && continue
  pkg=${pair#*:}
  [[ " ${missing[*]-} " == *" $pkg "* ]] || missing+=("$pkg")
done
((${#missing[@]})) || exit 0
if [[ $(id -u) != 0 ]] || ! command -v "$apt" >/dev/null; then
  echo "$who: missing ${missing[*]}: install them first (Debian/Ubuntu: sudo apt-get install -y ${missing[*]})" >&2
  exit 2
fi
echo "$who: installing ${missing[*]} (apt-get)" >&2
install() {
  "$apt" update -q >&2
  DEBIAN_FRONTEND=noninteractive "$apt" install -y -q --no-install-recommends ca-certificates "${missing[@]}" >&2
}
if command -v flock >/dev/null; then
  exec 9>"${SPOTRL_APT_LOCK:-/var/lock/spotrl-apt.lock}"
  flock 9
fi
install
