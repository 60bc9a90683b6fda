#!/usr/bin/env bash
# Builds SpotRL's images from the Dockerfile with BuildKit, on the local bases of
# base-image.sh (no registry is reachable here; with one, plain `docker build` works), and
# prints each image's build time and size. Also the S3 server and Kueue of the kind tests,
# spotrl-local/versitygw:<version> and spotrl-local/kueue:<version>, from the toolchain's
# static binaries.
#
#   e2e/kind/images.sh [TAG] [TARGET...]     default: TAG=e2e, targets operator runtime-cpu
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DOCKER=${DOCKER:-/usr/bin/docker}
TAG=${1:-e2e}
shift || true
targets=("$@")
((${#targets[@]})) || targets=(operator runtime-cpu)

args=()
while IFS= read -r line; do args+=(--build-arg "$line"); done < <("$ROOT/e2e/kind/base-image.sh")
for target in "${targets[@]}"; do
  t0=$SECONDS
  DOCKER_BUILDKIT=1 $DOCKER build --progress=plain "${args[@]}" --target "$target" \
    -t "spotrl-$target:$TAG" "$ROOT" >"${TMPDIR:-/tmp}/spotrl-build-$target.log" 2>&1 || {
    echo "images: building $target failed; the log:" >&2
    tail -40 "${TMPDIR:-/tmp}/spotrl-build-$target.log" >&2
    exit 1
  }
  size=$($DOCKER image inspect -f '{{.Size}}' "spotrl-$target:$TAG")
  echo "images: spotrl-$target:$TAG in $((SECONDS - t0)) s, $((size / 1000000)) MB"
done

# The S3 server and Kueue's manager for the kind cluster: the static binaries the test control
# plane runs, each alone in an image (not before the toolchain is built:
# SPOTRL_IMAGES_SKIP_S3=1, as .ci/run's early prebuild).
[ "${SPOTRL_IMAGES_SKIP_S3:-0}" = 1 ] && exit 0
eval "$("$ROOT/e2e/toolchain/build.sh" --env | grep '^VERSITYGW=\|^KUEUE=')"
# shellcheck source=../toolchain/versions.env
source "$ROOT/e2e/toolchain/versions.env"
binary_image() { # TAG BINARY [USER]: FROM scratch, the binary as its entrypoint
  local tag=$1 binary=$2 user=${3:-} ctx name
  if ! $DOCKER image inspect "$tag" >/dev/null 2>&1; then
    [ -x "$binary" ] || { echo "images: $binary missing: run \`make toolchain\` first" >&2; exit 1; }
    ctx=$(mktemp -d)
    name=$(basename "$binary")
    cp "$binary" "$ctx/$name"
    {
      printf 'FROM scratch\nCOPY %s /%s\n' "$name" "$name"
      [ -z "$user" ] || printf 'USER %s\n' "$user"
      printf 'ENTRYPOINT ["/%s"]\n' "$name"
    } >"$ctx/Dockerfile"
    $DOCKER build -q -t "$tag" "$ctx" >/dev/null
    rm -rf "$ctx"
  fi
  echo "images: $tag"
}
binary_image "spotrl-local/versitygw:$VERSITYGW_VERSION" "$VERSITYGW"
binary_image "spotrl-local/kueue:$KUEUE_VERSION" "$KUEUE" 65532
