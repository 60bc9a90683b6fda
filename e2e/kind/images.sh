#!/usr/bin/env bash
# Builds SpotRL's images from the Dockerfile with BuildKit, on the local bases of
# base-image.sh (no registry is reachable here; with one, plain `docker build` works), and
# prints each image's build time and size. Also the S3 server of the kind tests,
# spotrl-local/versitygw:<version>, from the toolchain's static versitygw binary.
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

# The S3 server for the kind cluster: the binary the test control plane runs, in an image
# (not before the toolchain is built: SPOTRL_IMAGES_SKIP_S3=1, as .ci/run's early prebuild).
[ "${SPOTRL_IMAGES_SKIP_S3:-0}" = 1 ] && exit 0
eval "$("$ROOT/e2e/toolchain/build.sh" --env | grep '^VERSITYGW=')"
# shellcheck source=../toolchain/versions.env
source "$ROOT/e2e/toolchain/versions.env"
s3_tag=spotrl-local/versitygw:$VERSITYGW_VERSION
if ! $DOCKER image inspect "$s3_tag" >/dev/null 2>&1; then
  [ -x "$VERSITYGW" ] || { echo "images: $VERSITYGW missing: run \`make toolchain\` first" >&2; exit 1; }
  ctx=$(mktemp -d)
  cp "$VERSITYGW" "$ctx/versitygw"
  printf 'FROM scratch\nCOPY versitygw /versitygw\nENTRYPOINT ["/versitygw"]\n' >"$ctx/Dockerfile"
  $DOCKER build -q -t "$s3_tag" "$ctx" >/dev/null
  rm -rf "$ctx"
fi
echo "images: $s3_tag"
