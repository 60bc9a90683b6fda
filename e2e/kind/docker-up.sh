#!/usr/bin/env bash
# Makes sure a Docker engine answers: installs Debian's docker.io when dockerd is missing,
# starts dockerd when none runs (logging to $SPOTRL_DOCKER_LOG), and, only where a
# privileged container fails to start, registers e2e/kind/runc-wrapper as dockerd's
# default runtime (see that file for why). Prints "started" when it started dockerd, so
# the caller knows to stop it (docker-down.sh).
set -euo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
LOG=${SPOTRL_DOCKER_LOG:-/var/log/spotrl-dockerd.log}
WRAPPER=/usr/local/libexec/spotrl/runc-wrapper
DOCKER=/usr/bin/docker   # Debian's client matches its daemon (BuildKit without buildx)

"$HERE/../toolchain/system-packages.sh" docker-up dockerd:docker.io

wait_ready() {
  for _ in $(seq 60); do
    $DOCKER info >/dev/null 2>&1 && return 0
    sleep 1
  done
  echo "docker-up: dockerd did not answer within 60 s; see $LOG" >&2
  tail -20 "$LOG" >&2 || true
  return 1
}

start_dockerd() {
  mkdir -p "$(dirname "$LOG")"
  nohup dockerd >>"$LOG" 2>&1 &
  echo $! > /run/spotrl-dockerd.pid
  wait_ready
}

started=0
if ! $DOCKER info >/dev/null 2>&1; then
  start_dockerd
  started=1
fi

# A base image to probe with: the smallest thing that runs is a static binary.
if ! $DOCKER image inspect spotrl-probe:1 >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  cp /bin/true "$tmp/true" 2>/dev/null || cp /usr/bin/true "$tmp/true"
  # /bin/true needs libc; a directory with it and its loader is enough for a probe.
  for lib in $(ldd "$tmp/true" | grep -o '/[^ ]*'); do
    mkdir -p "$tmp$(dirname "$lib")"; cp -L "$lib" "$tmp$lib"
  done
  tar -C "$tmp" -c . | $DOCKER import --change 'CMD ["/true"]' - spotrl-probe:1 >/dev/null
  rm -rf "$tmp"
fi

if ! $DOCKER run --rm --privileged spotrl-probe:1 /true >/dev/null 2>&1; then
  echo "docker-up: privileged containers fail here; installing the runc wrapper" >&2
  install -D -m 0755 "$HERE/runc-wrapper" "$WRAPPER"
  mkdir -p /etc/docker
  python3 - "$WRAPPER" <<'PY'
import json, os, sys
path = "/etc/docker/daemon.json"
conf = json.load(open(path)) if os.path.exists(path) else {}
conf.setdefault("runtimes", {})["spotrl-runc"] = {"path": sys.argv[1]}
conf["default-runtime"] = "spotrl-runc"
json.dump(conf, open(path, "w"), indent=2)
PY
  # dockerd reloads its runtimes and default runtime on SIGHUP.
  pkill -HUP -x dockerd
  sleep 2
  $DOCKER run --rm --privileged spotrl-probe:1 /true >/dev/null \
    || { echo "docker-up: privileged containers still fail with the wrapper" >&2; exit 1; }
fi
[ "$started" = 1 ] && echo started
exit 0
