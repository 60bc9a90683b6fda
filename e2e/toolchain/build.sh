#!/usr/bin/env bash
# Builds the test control plane's binaries from the Go module proxy, and the security
# scanners (kube-score from its Go module, checkov from PyPI in a venv of its own), into a
# cache folder outside the work tree, keyed by version, and skips whatever is already there.
#
#   e2e/toolchain/build.sh          build what is missing, print what was built and how long
#   e2e/toolchain/build.sh --env    print NAME=PATH lines for the tools (nothing is built)
#
# Cache: $SPOTRL_TOOLS_DIR (default ~/.cache/spotrl/tools). One build at a time (a lock in
# the cache); each tool is built in a scratch folder and renamed into place (lib.sh). Go's
# own build and module caches (GOCACHE, GOMODCACHE) make a rebuild after a version bump
# incremental; uv's wheel cache (~/.cache/uv) does the same for checkov.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"
# shellcheck source=scanners.env
source "$here/scanners.env"
cache=${SPOTRL_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/spotrl/tools}

kube_dir=$cache/kubernetes-$KUBERNETES_VERSION
etcd_dir=$cache/etcd-$ETCD_VERSION
helm_dir=$cache/helm-$HELM_VERSION
s3_dir=$cache/versitygw-$VERSITYGW_VERSION
# -b2: the folder also holds the roles of Kueue's manager (a new layout is a new folder).
kueue_dir=$cache/kueue-$KUEUE_VERSION-b2
kube_score_dir=$cache/kube-score-$KUBE_SCORE_VERSION
karpenter_dir=$cache/karpenter-crds-$KARPENTER_VERSION
# checkov's folder is keyed by its locked requirements too: a re-lock is a new folder.
checkov_lock=$here/checkov/requirements.txt
checkov_dir=$cache/checkov-$CHECKOV_VERSION-$(sha256sum "$checkov_lock" | cut -c1-8)

if [[ ${1:-} == --env ]]; then
  echo "KUBE_APISERVER=$kube_dir/kube-apiserver"
  echo "KUBE_CONTROLLER_MANAGER=$kube_dir/kube-controller-manager"
  echo "KUBE_SCHEDULER=$kube_dir/kube-scheduler"
  echo "KUBECTL=$kube_dir/kubectl"
  echo "ETCD=$etcd_dir/etcd"
  echo "HELM=$helm_dir/helm"
  echo "VERSITYGW=$s3_dir/versitygw"
  echo "KUEUE=$kueue_dir/kueue"
  echo "KUEUE_MANIFESTS=$kueue_dir/manifests"
  echo "KARPENTER_CRDS=$karpenter_dir/crds"
  echo "KUBE_SCORE=$kube_score_dir/kube-score"
  echo "CHECKOV=$checkov_dir/checkov"
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

# Kueue's manager from its module, and from the same module's source its CRDs (the v1beta2
# bases: no conversion webhook), its webhook configurations (pointed at the manager by the
# harness) and its manager's ClusterRole (for Kueue in a kind cluster).
build_kueue() {
  local out=$1 src
  GOBIN=$out go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION"
  src=$(go mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" | sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
  [[ -d $src/config/components/crd/bases ]] || { echo "toolchain: no CRDs in $src" >&2; return 1; }
  mkdir -p "$out/manifests/crds"
  cp "$src"/config/components/crd/bases/*.yaml "$out/manifests/crds/"
  cp "$src/config/components/webhook/manifests.yaml" "$out/manifests/webhooks.yaml"
  mkdir -p "$out/manifests/rbac"
  cp "$src"/config/components/rbac/{role,manager_secrets_role}.yaml "$out/manifests/rbac/"
}

# Karpenter's CRDs: the module zip from the Go module proxy, checked against its pinned sha256.
build_karpenter() {
  local out=$1 zip=$2/module.zip proxy
  proxy=$(go env GOPROXY | tr ',' '\n' | grep -m1 '^http')
  curl -fsSL --retry 3 "$proxy/github.com/aws/karpenter-provider-aws/@v/$KARPENTER_VERSION.zip" -o "$zip"
  echo "$KARPENTER_ZIP_SHA256  $zip" | sha256sum -c --quiet
  mkdir -p "$out/crds"
  python3 - "$zip" "$out/crds" "github.com/aws/karpenter-provider-aws@$KARPENTER_VERSION/pkg/apis/crds/" <<'PY'
import sys, zipfile
from pathlib import Path
zip_path, out, prefix = sys.argv[1:]
with zipfile.ZipFile(zip_path) as z:
    names = [n for n in z.namelist() if n.startswith(prefix) and n.endswith(".yaml")]
    for n in names:
        (Path(out) / Path(n).name).write_bytes(z.read(n))
if not names:
    sys.exit(f"toolchain: no CRDs under {prefix}")
PY
}

build_kube_score() {
  GOBIN=$1 go install -trimpath -ldflags "-s -w -X main.version=$KUBE_SCORE_VERSION" \
    "github.com/zegl/kube-score/cmd/kube-score@$KUBE_SCORE_VERSION"
}

# checkov's dependencies conflict with ours, so it gets a venv of its own: uv installs the
# exact versions of checkov/requirements.txt (its wheel cache is shared with `make install`).
# The venv is relocatable (it is renamed into place); `checkov` is a wrapper that keeps it
# offline.
build_checkov() {
  local out=$1 uv
  uv=$(command -v uv) || { echo "toolchain: uv is missing (python3 -m pip install uv)" >&2; return 1; }
  grep -qE "^checkov==$CHECKOV_VERSION( |$)" "$checkov_lock" || {
    echo "toolchain: $checkov_lock does not pin checkov==$CHECKOV_VERSION; run e2e/toolchain/checkov/lock.sh" >&2
    return 1
  }
  "$uv" venv -q --relocatable --python python3.11 "$out/venv"
  "$uv" pip sync -q --python "$out/venv/bin/python" "$checkov_lock"
  cat >"$out/checkov" <<'EOF'
#!/bin/sh
# checkov from its own venv, offline: no version check against PyPI, no download of the
# platform's check mapping (pass --skip-download as well).
export CKV_SKIP_PACKAGE_UPDATE_CHECK=True BC_SKIP_MAPPING=TRUE
exec "$(dirname "$0")/venv/bin/python" -m checkov.main "$@"
EOF
  chmod +x "$out/checkov"
}

t_all=$SECONDS
toolchain_lock "$cache"
step etcd "$etcd_dir" etcd
step versitygw "$s3_dir" versitygw
step helm "$helm_dir" helm
step kubernetes "$kube_dir" kube-apiserver kube-controller-manager kube-scheduler kubectl
step kube_score "$kube_score_dir" kube-score
step kueue "$kueue_dir" kueue
step karpenter "$karpenter_dir" crds
step checkov "$checkov_dir" checkov venv/bin/python
if ((${#TOOLCHAIN_BUILT[@]})); then
  echo "toolchain: built ${TOOLCHAIN_BUILT[*]}; total $((SECONDS - t_all)) s"
else
  echo "toolchain: everything cached ($cache)"
fi
