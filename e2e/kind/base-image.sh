#!/usr/bin/env bash
# Builds the local stand-ins for the Dockerfile's public bases on machines that reach no
# container registry, and prints the build arguments that select them:
#   PYTHON_BASE  for python:3.11-slim: a Debian bookworm root filesystem from debootstrap
#                (its python3 is 3.11) with python3-venv and CA certificates
#   UV_IMAGE     for ghcr.io/astral-sh/uv: the same uv version, from PyPI, at /uv
# Each is skipped when its image exists. The Python base trusts what this machine trusts:
# the certificates in the host's /usr/local/share/ca-certificates (a TLS-inspecting egress
# proxy's, here) are added to its store, and SSL_CERT_FILE points uv and pip at it.
set -euo pipefail
TAG=${SPOTRL_PYTHON_BASE:-spotrl-local/python:3.11-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
DOCKER=${DOCKER:-/usr/bin/docker}
LOCK=${SPOTRL_IMAGE_LOCK:-/tmp/spotrl-images.lock}

exec 9>"$LOCK"
flock 9
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
UV_VERSION=$(sed -n 's/^ARG UV_IMAGE=.*:\(.*\)$/\1/p' "$ROOT/Dockerfile")
UV_TAG=spotrl-local/uv:$UV_VERSION

build_uv() {
  $DOCKER image inspect "$UV_TAG" >/dev/null 2>&1 && return 0
  printf 'FROM %s AS pypi\nRUN python3 -m venv /v && /v/bin/pip install -q --disable-pip-version-check uv==%s\nFROM scratch\nCOPY --from=pypi /v/bin/uv /uv\n' \
    "$TAG" "$UV_VERSION" | DOCKER_BUILDKIT=1 $DOCKER build -q -t "$UV_TAG" - >/dev/null
  echo "base-image: built $UV_TAG from PyPI" >&2
}

if $DOCKER image inspect "$TAG" >/dev/null 2>&1; then
  build_uv
  echo "PYTHON_BASE=$TAG"
  echo "UV_IMAGE=$UV_TAG"
  exit 0
fi
"$(dirname "${BASH_SOURCE[0]}")/../toolchain/system-packages.sh" base-image debootstrap:debootstrap
t0=$SECONDS
root=$(mktemp -d /var/tmp/spotrl-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  bookworm "$root" "$MIRROR" >&2
cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2>/dev/null || true
chroot "$root" update-ca-certificates >/dev/null
# What the slim Python image also leaves out: package lists, caches, docs.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
  "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
tar -C "$root" --numeric-owner -c . | $DOCKER import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'CMD ["python3"]' - "$TAG" >/dev/null
echo "base-image: built $TAG in $((SECONDS - t0)) s" >&2
build_uv
echo "PYTHON_BASE=$TAG"
echo "UV_IMAGE=$UV_TAG"
