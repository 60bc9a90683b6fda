#!/usr/bin/env bash
# The kind nodes' containerd stores: our images unpacked once, on the host, and given to
# every node by hard links, instead of loaded into each node of each new cluster
# (`docker save | ctr import` of the runtime image into each node was the longest part of
# every run; docs/benchmarks.md).
#
#   e2e/kind/containerd-store.sh build NODE_IMAGE IMAGE...
#       make sure the store for these images is there; prints its path (and, on stderr, how
#       it was had)
#   e2e/kind/containerd-store.sh clone NAME COUNT STORE
#       COUNT clones of the store that build printed; prints the folder that holds them,
#       0 ... COUNT-1: mount clone i at /var/lib/containerd of the cluster's node i
#   e2e/kind/containerd-store.sh drop NAME
#       remove NAME's clones (when its cluster is deleted)
#
# A store is a containerd root (/var/lib/containerd) holding the node image's own images and
# IMAGE..., unpacked for the overlayfs snapshotter, written by the node's own containerd in
# a throwaway container. It is cached in $SPOTRL_KIND_STORES (default
# ~/.cache/spotrl/kind-stores), keyed by the node image's and the images' IDs.
#
# A new key (a code change rebuilds the runtime image) makes a new store from the node
# image's: minutes for the multi-GB runtime image on a small machine, which .ci/run spends
# beside the first suites. The layer blobs are dropped once unpacked (as containerd's
# discard_unpacked_layers does), so a store holds each image once.
#
# A clone hard-links every file and copies the two bolt databases, which containerd writes
# in place. That is safe because nothing writes a committed snapshot: a container writes to
# an upper directory of its own, and a removed snapshot is unlinked in its clone only. So
# the four nodes of a cluster take one store's disk, and a clone takes seconds.
# Needs root and Docker (the store is written by containerd in a privileged container).
set -euo pipefail
STORES=${SPOTRL_KIND_STORES:-${XDG_CACHE_HOME:-$HOME/.cache}/spotrl/kind-stores}
DOCKER=${DOCKER:-/usr/bin/docker}

fail() { echo "containerd-store: $*" >&2; exit 1; }
usage() { fail "usage: $0 build NODE_IMAGE IMAGE... | clone NAME COUNT STORE | drop NAME"; }

image_id() { $DOCKER image inspect -f '{{.Id}}' "$1" 2>/dev/null || fail "image $1 is missing (build it first)"; }

clone_tree() { # SRC DST: hard links, and copies of the bolt databases containerd writes in place
  cp -al "$1" "$2"
  local db
  while IFS= read -r -d '' db; do
    cp -p "$db" "$db.copy" && mv -f "$db.copy" "$db"
  done < <(find "$2" -name '*.db' -type f -print0)
  # Two containerds writing one database would corrupt it: none may be shared.
  [ -z "$(find "$2" -name '*.db' -type f -links +1)" ] || fail "a bolt database in $2 is still a hard link"
}

# The store is built by dockerd (`docker save`) and in a container (the unpack), which a `nice`
# on this script does not reach; .ci/run nices the build because it runs beside the first
# suites. With the kernel's autogroups, niceness orders the threads of one session only, and
# each session shares the CPU as one: dockerd (in the session that started it) gets this
# script's niceness per thread, and the container, a session of its own, as its autogroup's.

# dockerd_nice N: every thread of dockerd at niceness N.
dockerd_nice() {
  local pid task
  for pid in $(pgrep -x dockerd); do
    for task in /proc/"$pid"/task/*; do renice --priority "$1" -p "${task##*/}" >/dev/null 2>&1 || true; done
  done
}

# while_niced COMMAND...: runs it with dockerd at this script's niceness when that is higher
# than dockerd's, and gives dockerd its own back after, whatever it exits with.
while_niced() {
  local theirs rc=0
  theirs=$(ps -o ni= -p "$(pgrep -o -x dockerd)" 2>/dev/null | tr -d ' ')
  if [ -z "$theirs" ] || (($(nice) <= theirs)); then
    "$@"
    return
  fi
  trap "dockerd_nice $theirs" EXIT
  dockerd_nice "$(nice)"
  "$@" || rc=$?
  dockerd_nice "$theirs"
  trap - EXIT
  return "$rc"
}

# unpack NODE_IMAGE ROOT LAYERS IMAGE...: the node image's containerd root into ROOT, then the
# images unpacked into it by the node's own containerd, their layer blobs (LAYERS) dropped.
unpack() {
  local node_image=$1 root=$2 layers=$3
  shift 3
  # (Called where set -e does not apply: each step's failure is returned.)
  $DOCKER run --rm --entrypoint tar "$node_image" -C /var/lib/containerd -cf - . | tar -xpf - -C "$root" || return
  # docker save writes the layers uncompressed: each blob's digest is its diff ID, which is
  # how the blobs are dropped after the unpack.
  $DOCKER save "$@" | $DOCKER run --rm -i --privileged --network none --entrypoint /bin/bash \
    -v "$root:/var/lib/containerd" -e "LAYERS=$layers" -e "NICE=$(nice)" "$node_image" -euc '
      echo "$NICE" >/proc/self/autogroup || true # the container is a session: its niceness is its autogroup'"'"'s
      printf "version = 2\ndisabled_plugins = [\"io.containerd.grpc.v1.cri\"]\n" >/tmp/config.toml
      containerd --config /tmp/config.toml >/tmp/containerd.log 2>&1 & pid=$!
      for _ in $(seq 100); do ctr version >/dev/null 2>&1 && break; sleep 0.1; done
      ctr -n k8s.io images import --snapshotter overlayfs - >/dev/null
      ctr -n k8s.io content rm $LAYERS >/dev/null 2>&1 || true
      kill $pid; wait $pid || true'
}

# store NODE_IMAGE IMAGE...: sets $store to the store's root, building it when missing.
# The caller holds the lock.
store() {
  local node_image=$1 node_id ids=() image key dir tmp t0=$SECONDS layers=()
  shift
  node_id=$(image_id "$node_image")
  for image in "$@"; do ids+=("$image=$(image_id "$image")"); done
  key=$(printf '%s\n' "$node_id" "${ids[@]}" | sha256sum | cut -c1-16)
  dir=$STORES/$key
  store=$dir/root
  if [ -f "$dir/complete" ]; then
    how="cached"
    return
  fi
  tmp=$STORES/.building-$key
  rm -rf "$tmp"
  # Always from the node image's own store. (Starting from the previous store, so that only
  # changed layers are unpacked, saved a third, but a store made that way after a garbage
  # collection once lacked a parent snapshot: "parent snapshot ... does not exist".)
  mkdir -p "$tmp/root"
  how="from the node image"
  for image in "$@"; do
    read -r -a more <<<"$($DOCKER image inspect -f '{{range .RootFS.Layers}}{{.}} {{end}}' "$image")"
    layers+=("${more[@]}")
  done
  while_niced unpack "$node_image" "$tmp/root" "${layers[*]}" "$@" || fail "unpacking $* into the store failed"
  printf '%s\n' "${ids[@]}" >"$tmp/images"
  rm -rf "$dir"
  mv "$tmp" "$dir"
  touch "$dir/complete"
  how="$how in $((SECONDS - t0)) s"
  # Older stores go. (Their clones are hard links, and stay until their clusters go.)
  for old in "$STORES"/*/; do
    old=${old%/}
    [ "$old" = "$dir" ] || [ "$(basename "$old")" = clones ] || rm -rf "$old"
  done
}

cmd=${1:-}
shift || true
mkdir -p "$STORES/clones"
exec 9>"$STORES/.lock"
case "$cmd" in
  build)
    (($# >= 2)) || usage
    flock 9
    store "$@"
    echo "containerd-store: $store ($how)" >&2
    echo "$store"
    ;;
  clone)
    (($# == 3)) || usage
    name=$1 count=$2 store=$3
    [[ $count =~ ^[0-9]+$ ]] || fail "COUNT must be a number, not '$count'"
    flock 9
    [ -f "$(dirname "$store")/complete" ] || fail "$store is not a complete store (run build first)"
    clones=$STORES/clones/$name
    rm -rf "$clones"
    mkdir -p "$clones"
    for ((i = 0; i < count; i++)); do clone_tree "$store" "$clones/$i"; done
    echo "$clones"
    ;;
  drop)
    (($# == 1)) || usage
    flock 9
    rm -rf "${STORES:?}/clones/$1"
    ;;
  *) usage ;;
esac
