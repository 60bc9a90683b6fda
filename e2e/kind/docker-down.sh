#!/usr/bin/env bash
# Stops the dockerd that docker-up.sh started (and nothing else).
set -euo pipefail
pidfile=/run/spotrl-dockerd.pid
[ -f "$pidfile" ] || exit 0
pid=$(cat "$pidfile")
if kill -0 "$pid" 2>/dev/null; then
  kill "$pid"
  for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
fi
rm -f "$pidfile"
