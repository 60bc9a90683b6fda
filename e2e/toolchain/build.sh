#!/usr/bin/env bash
# Builds the test control plane's binaries from the Go module proxy into a cache folder
# outside the work tree, keyed by version, and skips whatever is already there.
#
#   e2e/toolchain/build.sh          build what is missing, print what was built and how long
#   e2e/toolchain/build.sh --env    print NAME=PATH lines for the binaries (nothing is built)
#
# Cache: $SPOTRL_TOOLS_DIR (default ~/.cache/spotrl/tools). Go's own build and module
# caches (GOCACHE, GOMODCACHE) make a rebuild after a version bump incremental.
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
built=()

# step NAME DIR BINARY... : runs build_NAME unless every binary is already in DIR.
step() {
  local name=$1 dir=$2; shift 2
  local missing=0 b
  for b in "$@"; do [[ -x $dir/$b ]] || missing=1; done
  if ((missing == 0)); then
    echo "cached  $name ($dir)"
    return
  fi
  local t0=$SECONDS
  echo "build   $name ..."
  mkdir -p "$dir"
  "build_$name" "$dir"
  built+=("$name in $((SECONDS - t0)) s")
  echo "built   $name in $((SECONDS - t0)) s"
}

# shellcheck source=kube/build-kube.sh
source "$here/kube/build-kube.sh"

build_kubernetes() {
  build_kube_commands "$cache/src/kubernetes-$KUBERNETES_VERSION" "$1" \
    kube-apiserver kube-controller-manager kube-scheduler kubectl
}

build_etcd() {
  local out=$1 src=$cache/src/etcd-$ETCD_VERSION
  rm -rf "$src" && mkdir -p "$src"
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
step etcd "$etcd_dir" etcd
step versitygw "$s3_dir" versitygw
step helm "$helm_dir" helm
step kubernetes "$kube_dir" kube-apiserver kube-controller-manager kube-scheduler kubectl
if ((${#built[@]})); then
  echo "toolchain: built ${built[*]}; total $((SECONDS - t_all)) s"
else
  echo "toolchain: everything cached ($cache)"
fi
