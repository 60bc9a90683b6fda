#!/usr/bin/env bash
# Builds the test control plane's binaries from the Go module proxy into a cache folder
# outside the work tree, keyed by version, and skips whatever is already there.
#
#   e2e/toolchain/build.sh          build what is missing, print what was built and how long
#   e2e/toolchain/build.sh --env    print NAME=PATH lines for the binaries (nothing is built)
#
# Cache: $SPOTRL_TOOLS_DIR (default ~/.cache/spotrl/tools). One build at a time (a lock in
# the cache); each tool is built in a scratch folder and renamed into place (lib.sh). Go's
# own build and module caches (GOCACHE, GOMODCACHE) make a rebuild after a version bump
# incremental.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
cache=${SPOTRL_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/spotrl/tools}

kube_dir=$cache/kubernetes-$KUBERNETES_VERSION
etcd_dir=$cache/etcd-$ETCD_VERSION
helm_dir=$cache/helm-$HELM_VERSION
s3_dir=$cache/versitygw-$VERSITYGW_VERSION

if [[ ${1:-} == --env ]]; then
  echo "KUBE_APISERVER=$kube_dir/kube-apiserver"
  echo "KUBE_CONTROLLER_MANAGER=$kube_dir/kube-controller-manager"
  echo "KUBE_SCHEDULER=$kube_dir/kube-scheduler"
  echo "KUBECTL=$kube_dir/kubectl"
  echo "ETCD=$etcd_dir/etcd"
  echo "HELM=$helm_dir/helm"
  echo "VERSITYGW=$s3_dir/versitygw"
  exit 0
fi

export GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0

# shellcheck source=lib.sh
source "$here/lib.sh"
# shellcheck source=kube/build-kube.sh
source "$here/kube/build-kube.sh"

# build_NAME OUT WORK: the tool's files into OUT; WORK is scratch (both fresh, see lib.sh).
build_kubernetes() {
  build_kube_commands "$2/src" "$1" kube-apiserver kube-controller-manager kube-scheduler kubectl
}

build_etcd() {
  local out=$1 src=$2/src
  mkdir -p "$src"
  sed "s/@ETCD_VERSION@/$ETCD_VERSION/" "$here/etcd/go.mod.in" >"$src/go.mod"
  cp "$here/etcd/main.go" "$src/"
  (cd "$src" && go build -trimpath -ldflags "-s -w" -o "$out/etcd" .)
}

build_helm() {
  GOBIN=$1 go install -trimpath \
    -ldflags "-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION" \
    "helm.sh/helm/v3/cmd/helm@$HELM_VERSION"
}

build_versitygw() {
  GOBIN=$1 go install -trimpath -ldflags "-s -w -X main.Version=$VERSITYGW_VERSION" \
    "github.com/versity/versitygw/cmd/versitygw@$VERSITYGW_VERSION"
}

t_all=$SECONDS
toolchain_lock "$cache"
step etcd "$etcd_dir" etcd
step versitygw "$s3_dir" versitygw
step helm "$helm_dir" helm
step kubernetes "$kube_dir" kube-apiserver kube-controller-manager kube-scheduler kubectl
if ((${#TOOLCHAIN_BUILT[@]})); then
  echo "toolchain: built ${TOOLCHAIN_BUILT[*]}; total $((SECONDS - t_all)) s"
else
  echo "toolchain: everything cached ($cache)"
fi
