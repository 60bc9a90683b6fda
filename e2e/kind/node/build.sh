#!/usr/bin/env bash
# Builds kind and a kind node image for Kubernetes $KUBERNETES_VERSION from sources on
# this machine only: Go binaries from the Go module proxy, Debian userland from
# debootstrap, and every container image kubeadm and the node's add-ons run.
#
#   e2e/kind/node/build.sh          build what is missing, print what was built and how long
#   e2e/kind/node/build.sh --env    print KIND=... and KIND_NODE_IMAGE=... (builds nothing)
#
# Go outputs are cached in $SPOTRL_TOOLS_DIR (default ~/.cache/spotrl/tools) by version;
# images stay in dockerd, tagged (or labelled) with a hash of their inputs: versions.env
# and the files under e2e/kind/node that go into them. Versions are pinned in e2e/toolchain/versions.env.
#
# The node image (spotrl-local/kind-node:<k8s version>-<input hash>):
#   Debian $DEBIAN_SUITE (debootstrap) with systemd, containerd + runc, iptables and friends;
#   kubelet, kubeadm, kubectl; CNI plugins; crictl; rootfs/ (entrypoint, units, configs);
#   /kind/version and /kind/manifests/default-{cni,storage}.yaml, which `kind create`
#   reads; and, already imported into containerd, the images kubeadm asks for
#   (`kubeadm config images list`) plus kindnetd, local-path-provisioner and its helper.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
# shellcheck source=../../toolchain/versions.env
source "$repo/e2e/toolchain/versions.env"
cache=${SPOTRL_TOOLS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/spotrl/tools}
DOCKER=${DOCKER:-/usr/bin/docker} # Debian's client: it matches the daemon
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

kind_dir=$cache/kind-$KIND_VERSION
kube_dir=$cache/kubernetes-node-$KUBERNETES_VERSION
cni_dir=$cache/cni-plugins-$CNI_PLUGINS_VERSION
crictl_dir=$cache/crictl-$CRICTL_VERSION
coredns_dir=$cache/coredns-$COREDNS_VERSION
lpp_dir=$cache/local-path-provisioner-$LOCAL_PATH_PROVISIONER_VERSION

# Every input of the images: the pinned versions and the files they are made of.
input_hash=$(cd "$here" && { cat "$repo/e2e/toolchain/versions.env"
  find build.sh rootfs manifests pause kindnetd -type f -print0 | sort -z | xargs -0 sha256sum; } |
  sha256sum | cut -c1-12)
node_image=spotrl-local/kind-node:$KUBERNETES_VERSION-$input_hash

if [[ ${1:-} == --env ]]; then
  echo "KIND=$kind_dir/kind"
  echo "KIND_NODE_IMAGE=$node_image"
  exit 0
fi

fail() { echo "kind-node: $*" >&2; exit 1; }
[[ $(id -u) == 0 ]] || fail "needs root (debootstrap, and docker runs privileged containers)"
"$repo/e2e/toolchain/system-packages.sh" kind-node debootstrap:debootstrap
$DOCKER info >/dev/null 2>&1 || fail "docker does not answer: run e2e/kind/docker-up.sh"

mkdir -p "$cache"
exec 9>"$cache/.kind-node.lock"
flock 9 # one build at a time into the shared cache and dockerd

export GOFLAGS=-mod=mod GOTOOLCHAIN=local CGO_ENABLED=0
work=$cache/.kind-node-work
trap 'rm -rf "$work"' EXIT
built=()

# step NAME CHECK... : runs build_NAME unless every CHECK is already there: an executable
# path, image:NAME (an image) or image:NAME#HASH (an image labelled spotrl.input=HASH).
step() {
  local name=$1; shift
  local missing=0 c
  for c in "$@"; do
    if [[ $c == image:*#* ]]; then
      c=${c#image:}
      [[ $($DOCKER image inspect -f '{{index .Config.Labels "spotrl.input"}}' "${c%#*}" 2>/dev/null) == "${c#*#}" ]] || missing=1
    elif [[ $c == image:* ]]; then
      $DOCKER image inspect "${c#image:}" >/dev/null 2>&1 || missing=1
    else
      [[ -x $c ]] || missing=1
    fi
  done
  if ((missing == 0)); then
    echo "cached  $name"
    return
  fi
  local t0=$SECONDS
  echo "build   $name ..."
  rm -rf "$work" && mkdir -p "$work"
  "build_$name"
  built+=("$name $((SECONDS - t0))s")
  echo "built   $name in $((SECONDS - t0)) s"
}

# ---- Go binaries ---------------------------------------------------------------------

build_kind() {
  GOBIN=$kind_dir go install -trimpath -ldflags "-s -w" "sigs.k8s.io/kind@$KIND_VERSION"
}

# kubelet, kubeadm, kube-proxy: the same wrapper-module build as the control plane's.
# shellcheck source=../../toolchain/kube/build-kube.sh
source "$repo/e2e/toolchain/kube/build-kube.sh"
build_kube() {
  build_kube_commands "$cache/src/kubernetes-node-$KUBERNETES_VERSION" "$kube_dir" kubelet kubeadm kube-proxy
}

cni_plugins=(main/bridge main/loopback main/ptp main/host-device ipam/host-local meta/portmap)
build_cni() {
  local p args=()
  for p in "${cni_plugins[@]}"; do
    args+=("github.com/containernetworking/plugins/plugins/$p@$CNI_PLUGINS_VERSION")
  done
  GOBIN=$cni_dir go install -trimpath -ldflags "-s -w" "${args[@]}"
}

build_crictl() {
  GOBIN=$crictl_dir go install -trimpath -ldflags "-s -w" "sigs.k8s.io/cri-tools/cmd/crictl@$CRICTL_VERSION"
}

build_coredns() {
  GOBIN=$coredns_dir go install -trimpath -ldflags "-s -w" "github.com/coredns/coredns@$COREDNS_VERSION"
}

build_lpp() {
  GOBIN=$lpp_dir go install -trimpath -ldflags "-s -w" \
    "github.com/rancher/local-path-provisioner@$LOCAL_PATH_PROVISIONER_VERSION"
}

# ---- Debian root file systems (debootstrap) ------------------------------------------

# The node: systemd as init, containerd + runc, and what kubelet, kube-proxy and kind
# call on a node.
node_packages=systemd,containerd,runc,iptables,nftables,iproute2,conntrack,ethtool,socat
node_packages+=,kmod,libseccomp2,pigz,ca-certificates,procps,e2fsprogs,netbase,bash
# Images that need a shell or iptables (kube-proxy, kindnetd, the local-path helper).
slim_packages=iptables,nftables,iproute2,conntrack,ca-certificates,netbase
slim_base=spotrl-local/debian-slim:$(echo "$DEBIAN_SUITE $slim_packages" | sha256sum | cut -c1-12)

# debootstrap_image TAG PACKAGES [CUSTOMIZE]: a minbase Debian with PACKAGES, changed
# by the function CUSTOMIZE (given the root), trimmed and imported into docker as TAG.
debootstrap_image() {
  local tag=$1 packages=$2 customize=${3:-} root=$work/rootfs
  mkdir -p "$cache/debootstrap-debs"
  debootstrap --variant=minbase --include="$packages" --cache-dir="$cache/debootstrap-debs" \
    "$DEBIAN_SUITE" "$root" "$MIRROR" >"$work/debootstrap.log" 2>&1 ||
    { tail -20 "$work/debootstrap.log" >&2; fail "debootstrap failed (log above)"; }
  [[ -z $customize ]] || "$customize" "$root"
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/log/* \
    "$root"/usr/share/{doc,man,info,locale}/* "$root"/tmp/*
  tar -C "$root" --numeric-owner -c . |
    $DOCKER import --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$tag" >/dev/null
}

customize_node() {
  local root=$1
  ln -sf /lib/systemd/systemd "$root/sbin/init"
  : >"$root/etc/machine-id" # the entrypoint makes one per node
  # Only what a node needs starts at boot: drop every unit Debian enabled, and mask
  # those that manage hardware, kernel modules or consoles, which a container leaves
  # to the host.
  rm -f "$root"/etc/systemd/system/*.wants/*
  local unit
  for unit in systemd-udevd.service systemd-udev-trigger.service systemd-modules-load.service \
    systemd-binfmt.service systemd-firstboot.service systemd-remount-fs.service \
    systemd-logind.service getty.target console-getty.service \
    sys-kernel-debug.mount sys-kernel-tracing.mount sys-kernel-config.mount \
    sys-fs-fuse-connections.mount dev-hugepages.mount proc-sys-fs-binfmt_misc.automount; do
    ln -sf /dev/null "$root/etc/systemd/system/$unit"
  done
  # The CRI's base OCI spec: containerd's default without RLIMIT_NOFILE=1024, so pods
  # inherit the node's open-file limits.
  mkdir -p "$root/etc/containerd"
  chroot "$root" ctr oci spec | python3 -c '
import json, sys
spec = json.load(sys.stdin)
spec["process"].pop("rlimits", None)
json.dump(spec, sys.stdout, indent=2)' >"$root/etc/containerd/cri-base.json"
}

node_base=spotrl-local/kind-node-base:$( (echo "$DEBIAN_SUITE $node_packages"; declare -f customize_node) | sha256sum | cut -c1-12)
build_node_base() { debootstrap_image "$node_base" "$node_packages" customize_node; }
build_slim_base() { debootstrap_image "$slim_base" "$slim_packages"; }

# ---- Container images ----------------------------------------------------------------

# image NAME BASE BINARY [ENTRYPOINT]: BASE (scratch or an image) with BINARY in
# /usr/local/bin, labelled with the input hash, tagged NAME.
image() {
  local name=$1 base=$2 binary=$3 entrypoint=${4:-} ctx
  ctx=$work/image-${name//[^a-zA-Z0-9]/_}
  mkdir -p "$ctx"
  cp "$binary" "$ctx/"
  {
    echo "FROM $base"
    echo "COPY $(basename "$binary") /usr/local/bin/"
    echo "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
    echo "LABEL spotrl.input=$input_hash"
    [[ -z $entrypoint ]] || echo "ENTRYPOINT [\"/usr/local/bin/$entrypoint\"]"
  } >"$ctx/Dockerfile"
  DOCKER_BUILDKIT=0 $DOCKER build -q -t "$name" "$ctx" >/dev/null ||
    fail "docker build of $name failed"
}

# The names kubeadm asks for; our own add-ons live under spotrl-local/.
kube_images() { "$kube_dir/kubeadm" config images list --kubernetes-version "$KUBERNETES_VERSION" 2>/dev/null; }
kindnetd_image=spotrl-local/kindnetd:$input_hash
lpp_image=spotrl-local/local-path-provisioner:$LOCAL_PATH_PROVISIONER_VERSION
lpp_helper_image=spotrl-local/local-path-helper:$DEBIAN_SUITE

build_images() {
  local ref tool
  eval "$("$repo/e2e/toolchain/build.sh" --env)" # KUBE_APISERVER=..., ETCD=...
  (cd "$here/pause" && go build -trimpath -ldflags "-s -w" -o "$work/pause" .)
  (cd "$here/kindnetd" && go build -trimpath -ldflags "-s -w" -o "$work/kindnetd" .)
  while read -r ref; do
    case $ref in
      */kube-apiserver:*) image "$ref" scratch "$KUBE_APISERVER" ;;
      */kube-controller-manager:*) image "$ref" scratch "$KUBE_CONTROLLER_MANAGER" ;;
      */kube-scheduler:*) image "$ref" scratch "$KUBE_SCHEDULER" ;;
      */kube-proxy:*) image "$ref" "$slim_base" "$kube_dir/kube-proxy" ;;
      */etcd:*) image "$ref" scratch "$ETCD" ;; # etcd $ETCD_VERSION under kubeadm's tag
      */coredns:*) image "$ref" scratch "$coredns_dir/coredns" coredns ;; # $COREDNS_VERSION
      */pause:*) image "$ref" scratch "$work/pause" pause ;;
      *) fail "kubeadm asks for an image this script does not know how to build: $ref" ;;
    esac
    echo "        $ref"
  done < <(kube_images)
  image "$kindnetd_image" "$slim_base" "$work/kindnetd" kindnetd
  image "$lpp_image" scratch "$lpp_dir/local-path-provisioner" local-path-provisioner
  # The provisioner's helper pod runs `sh -c` with its setup/teardown scripts.
  DOCKER_BUILDKIT=0 $DOCKER build -q -t "$lpp_helper_image" - >/dev/null <<EOF
FROM $slim_base
LABEL spotrl.input=$input_hash
EOF
  echo "        $kindnetd_image $lpp_image $lpp_helper_image"
}

all_images() { kube_images; echo "$kindnetd_image"; echo "$lpp_image"; echo "$lpp_helper_image"; }

# ---- The node image ------------------------------------------------------------------

build_node() {
  local root=$work/ctx/root images pause
  mapfile -t images < <(all_images)
  pause=$(kube_images | grep '/pause:')
  mkdir -p "$root"/{usr/bin,usr/local/bin,opt/cni/bin,kind/manifests,etc/kubernetes/manifests,var/lib/containerd}
  cp -a "$here/rootfs/." "$root/"
  sed -i "s#@PAUSE_IMAGE@#$pause#" "$root/etc/containerd/config.toml"
  mkdir -p "$root/etc/systemd/system/multi-user.target.wants"
  ln -s /etc/systemd/system/containerd.service "$root/etc/systemd/system/multi-user.target.wants/"
  ln -s /etc/systemd/system/kubelet.service "$root/etc/systemd/system/multi-user.target.wants/"
  cp "$kube_dir"/{kubelet,kubeadm} "$root/usr/bin/"
  cp "$cache/kubernetes-$KUBERNETES_VERSION/kubectl" "$root/usr/bin/"
  cp "$crictl_dir/crictl" "$root/usr/local/bin/"
  cp "$cni_dir"/* "$root/opt/cni/bin/"
  echo "$KUBERNETES_VERSION" >"$root/kind/version"
  sed "s#@KINDNETD_IMAGE@#$kindnetd_image#" "$here/manifests/default-cni.yaml" >"$root/kind/manifests/default-cni.yaml"
  sed -e "s#@LOCAL_PATH_PROVISIONER_IMAGE@#$lpp_image#" -e "s#@LOCAL_PATH_HELPER_IMAGE@#$lpp_helper_image#" \
    "$here/manifests/default-storage.yaml" >"$root/kind/manifests/default-storage.yaml"

  # Import the images into the node's containerd store (/var/lib/containerd) with the
  # node's own containerd, run once in a throwaway container. Layers stay packed; the
  # CRI unpacks an image the first time a container uses it.
  $DOCKER save -o "$work/images.tar" "${images[@]}"
  $DOCKER run --rm --privileged --entrypoint /bin/bash \
    -v "$root/var/lib/containerd:/var/lib/containerd" -v "$work/images.tar:/images.tar:ro" \
    "$node_base" -euc '
      printf "version = 2\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n" >/tmp/config.toml
      containerd --config /tmp/config.toml >/tmp/containerd.log 2>&1 & pid=$!
      for _ in $(seq 100); do ctr version >/dev/null 2>&1 && break; sleep 0.1; done
      ctr --namespace k8s.io images import --no-unpack /images.tar >/dev/null
      ctr --namespace k8s.io images ls -q | grep -v "^sha256:" | sed "s/^/        imported /"
      kill $pid; wait $pid || true' || fail "importing the images into the node's containerd failed"
  rm "$work/images.tar"

  cat >"$work/ctx/Dockerfile" <<EOF
FROM $node_base
COPY root/ /
ENV container=docker
LABEL spotrl.input=$input_hash
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]
EOF
  DOCKER_BUILDKIT=0 $DOCKER build -q -t "$node_image" "$work/ctx" >/dev/null || fail "docker build of $node_image failed"
  $DOCKER tag "$node_image" "spotrl-local/kind-node:$KUBERNETES_VERSION"
  # Earlier builds' node and kindnetd images (about 1 GB each) go, unless a container uses them.
  $DOCKER images --format '{{.Repository}}:{{.Tag}}' spotrl-local/kind-node | grep -v -e "^$node_image\$" \
    -e ":$KUBERNETES_VERSION\$" | xargs -r $DOCKER rmi >/dev/null 2>&1 || true
  $DOCKER images --format '{{.Repository}}:{{.Tag}}' spotrl-local/kindnetd | grep -v "^$kindnetd_image\$" |
    xargs -r $DOCKER rmi >/dev/null 2>&1 || true
}

t_all=$SECONDS
tc=$("$repo/e2e/toolchain/build.sh") || { echo "$tc" >&2; fail "e2e/toolchain/build.sh failed"; }
grep -q '^built' <<<"$tc" && echo "$tc"
step kind "$kind_dir/kind"
step kube "$kube_dir/kubelet" "$kube_dir/kubeadm" "$kube_dir/kube-proxy"
step cni "${cni_plugins[@]/#*\//$cni_dir/}"
step crictl "$crictl_dir/crictl"
step coredns "$coredns_dir/coredns"
step lpp "$lpp_dir/local-path-provisioner"
step node_base "image:$node_base"
step slim_base "image:$slim_base"
images_check=()
while read -r ref; do images_check+=("image:$ref#$input_hash"); done < <(all_images)
step images "${images_check[@]}"
step node "image:$node_image#$input_hash"
if ((${#built[@]})); then
  echo "kind-node: built ${built[*]}; total $((SECONDS - t_all)) s"
else
  echo "kind-node: everything cached ($((SECONDS - t_all)) s)"
fi
echo "kind-node: $node_image ($($DOCKER image inspect -f '{{.Size}}' "$node_image" | awk '{printf "%.0f MB", $1/1e6}'))"
