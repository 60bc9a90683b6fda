#!/usr/bin/env bash
# kind for the e2e tests, built here (no registry is needed): the kind binary and its
# node image for the pinned Kubernetes version (e2e/toolchain/versions.env).
#
#   e2e/kind/kind.sh build   build what is missing (kind, node image); cached runs take seconds
#   e2e/kind/kind.sh env     print KIND=<path> and KIND_NODE_IMAGE=<tag> (builds nothing)
#
# Then: $KIND create cluster --image "$KIND_NODE_IMAGE" --config e2e/kind/cluster.yaml
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

case ${1:-} in
  build) exec "$here/node/build.sh" ;;
  env) exec "$here/node/build.sh" --env ;;
  *)
    echo "usage: $0 build|env" >&2
    exit 2
    ;;
esac
