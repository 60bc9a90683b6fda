# Sourced by e2e/toolchain/build.sh (the control plane) and e2e/kind/node/build.sh (the
# node's kubelet, kubeadm, kube-proxy): `build_kube_commands SRC OUT CMD...` builds
# k8s.io/kubernetes/cmd/CMD... at $KUBERNETES_VERSION into OUT, through a wrapper module
# in SRC whose replace lines (one per staging module) are read from the release's own
# go.mod, downloaded through the module proxy, never typed by hand.
# shellcheck shell=bash

build_kube_commands() {
  local src=$1 out=$2 gomod staging_tag cmd targets=()
  shift 2
  rm -rf "$src" && mkdir -p "$src"
  sed "s/@KUBERNETES_VERSION@/$KUBERNETES_VERSION/" "$(dirname "${BASH_SOURCE[0]}")/go.mod.in" >"$src/go.mod"
  gomod=$(go mod download -json "k8s.io/kubernetes@$KUBERNETES_VERSION" |
    sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
  [[ -f $gomod ]] || { echo "cannot find go.mod of k8s.io/kubernetes@$KUBERNETES_VERSION" >&2; return 1; }
  staging_tag=v0.${KUBERNETES_VERSION#v1.}
  sed -n 's#^[[:space:]]*\(k8s.io/[a-z0-9-]*\) => \./staging/src/k8s.io/[a-z0-9-]*$#replace \1 => \1 '"$staging_tag"'#p' \
    "$gomod" >>"$src/go.mod"
  echo "        $(grep -c '^replace' "$src/go.mod") staging replaces generated from the release's go.mod"
  local minor=${KUBERNETES_VERSION#v1.}
  minor=${minor%%.*}
  local pkg=k8s.io/component-base/version
  local ldflags="-s -w -X $pkg.gitVersion=$KUBERNETES_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$KUBERNETES_VERSION"
  for cmd in "$@"; do targets+=("k8s.io/kubernetes/cmd/$cmd"); done
  (cd "$src" && go build -trimpath -ldflags "$ldflags" -o "$out/" "${targets[@]}")
}
