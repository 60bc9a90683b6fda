# Sourced by e2e/toolchain/build.sh: one build at a time into the tool cache, and each
# tool's folder appears whole or not at all.
#
#   toolchain_lock CACHE     wait for CACHE/.toolchain.lock (held until the script exits),
#                            then remove what a killed build left in CACHE/.partial
#   step NAME DIR FILE...    unless DIR holds every FILE (executable), run build_NAME OUT WORK
#                            with OUT and WORK fresh folders under CACHE/.partial, then rename
#                            OUT to DIR: a reader never sees a half-built DIR, and a build
#                            killed midway leaves nothing at DIR
#
# Two builds at once used to share (and delete) each other's source folders; the lock
# makes the second wait. tests/unit/test_toolchain_lock.py drives this file with fake builds.
# shellcheck shell=bash

toolchain_lock() {
  local cache=$1
  "$(dirname "${BASH_SOURCE[0]}")/system-packages.sh" toolchain flock:util-linux || return 1
  mkdir -p "$cache"
  # The descriptor stays open (and the lock held) until this shell exits, however it exits.
  exec {TOOLCHAIN_LOCK_FD}>>"$cache/.toolchain.lock"
  if ! flock -n "$TOOLCHAIN_LOCK_FD"; then
    echo "toolchain: waiting for another build ($cache/.toolchain.lock) ..."
    flock "$TOOLCHAIN_LOCK_FD"
  fi
  TOOLCHAIN_PARTIAL=$cache/.partial
  rm -rf "$TOOLCHAIN_PARTIAL" && mkdir -p "$TOOLCHAIN_PARTIAL"
}

# Names of the steps built by this run, with their times (build.sh prints them at the end).
TOOLCHAIN_BUILT=()

step() {
  local name=$1 dir=$2; shift 2
  local f missing=0 t0=$SECONDS tmp
  for f in "$@"; do [[ -x $dir/$f ]] || missing=1; done
  if ((missing == 0)); then
    echo "cached  $name ($dir)"
    return 0
  fi
  [[ -n ${TOOLCHAIN_PARTIAL:-} ]] || { echo "toolchain: step $name before toolchain_lock" >&2; return 1; }
  echo "build   $name ..."
  tmp=$(mktemp -d "$TOOLCHAIN_PARTIAL/$name.XXXXXX")
  mkdir "$tmp/out" "$tmp/work"
  "build_$name" "$tmp/out" "$tmp/work"
  for f in "$@"; do
    [[ -x $tmp/out/$f ]] || { echo "toolchain: build_$name did not make $f" >&2; return 1; }
  done
  # A folder without every file can only come from a build before this library; it goes.
  rm -rf "$dir"
  mv -T "$tmp/out" "$dir"
  rm -rf "$tmp"
  TOOLCHAIN_BUILT+=("$name in $((SECONDS - t0)) s")
  echo "built   $name in $((SECONDS - t0)) s"
}
