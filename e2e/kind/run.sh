#!/usr/bin/env bash
# `make e2e-kind`: the end-to-end tests on a real kind cluster, every part built here.
#
#   1. docker: start dockerd if none answers (and stop it at the end), the runc wrapper
#      where privileged containers fail (docker-up.sh)
#   2. kind and its node image, built from Go modules and Debian packages (kind.sh build)
#   3. the images: Dockerfile targets `operator` and `runtime-cpu` on local bases, and the
#      S3 server (images.sh)
#   4. a kind cluster: control plane + two spot workers + one on-demand worker
#   5. the images loaded, the S3 server (versitygw) in the cluster, charts/spotrl installed
#   6. the README's first hour as written (tests/e2e/test_first_hour.py: helm install,
#      kubectl apply, a drain), then the chart installed for the rest of tests/e2e, with
#      SPOTRL_E2E_TARGET=kind. `SPOTRL_KIND_SUBSET=ci` (what CI runs) runs only the tests
#      marked kind_ci: a drain after a notice and an abrupt node loss, on the chart.
#   7. the cluster deleted (KEEP_CLUSTER=1 keeps it, and the next run reuses it: only
#      changed images are loaded again and the chart is upgraded; logs go to $ARTIFACTS
#      on failure)
#
# SPOTRL_KIND_PHASES=setup runs 1-5 and leaves the cluster (and dockerd) up, saying how to
# reach it in $ARTIFACTS/setup.env; SPOTRL_KIND_PHASES=tests then runs 6-7 on it, and
# SPOTRL_KIND_PHASES=down only 7.
#
# Needs the repository's .venv and toolchain (make install toolchain), root for dockerd.
# Extra arguments go to pytest. Prints the seconds of each phase (also in $ARTIFACTS/timings).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=$ROOT/e2e/kind
CLUSTER=${SPOTRL_KIND_CLUSTER:-spotrl-e2e}
KEEP_CLUSTER=${KEEP_CLUSTER:-0}
ARTIFACTS=${ARTIFACTS:-$ROOT/.e2e-kind}
PY=${PY:-$ROOT/.venv/bin/python}
SUBSET=${SPOTRL_KIND_SUBSET:-all}
PHASES=${SPOTRL_KIND_PHASES:-all}
case "$PHASES" in all | setup | tests | down) ;; *)
  echo "e2e-kind: SPOTRL_KIND_PHASES=$PHASES: say all, setup (build and start the cluster, leave it up), tests or down" >&2
  exit 2
  ;;
esac
TAG=e2e
OPERATOR_IMAGE=spotrl-operator:$TAG
RUNTIME_IMAGE=spotrl-runtime-cpu:$TAG
export DOCKER=/usr/bin/docker

[ -x "$PY" ] || { echo "e2e-kind: $PY missing: run \`make install\` first" >&2; exit 2; }
mkdir -p "$ARTIFACTS/bin"
SETUP_ENV=$ARTIFACTS/setup.env
if [ "$PHASES" = tests ] || [ "$PHASES" = down ]; then
  [ -f "$SETUP_ENV" ] || { echo "e2e-kind: $SETUP_ENV missing: run SPOTRL_KIND_PHASES=setup first" >&2; exit 2; }
else
  : >"$ARTIFACTS/timings"
  rm -f "$SETUP_ENV"
fi
export KUBECONFIG="$ARTIFACTS/kubeconfig"
t_phase=$SECONDS
phase() {
  local now=$SECONDS
  [ -n "${PHASE:-}" ] && echo "$PHASE $((now - t_phase))" | tee -a "$ARTIFACTS/timings"
  PHASE=$1
  t_phase=$now
  [ "$1" = end ] || echo "== $1"
}

if [ "$PHASES" = tests ] || [ "$PHASES" = down ]; then
  # shellcheck disable=SC1090
  source "$SETUP_ENV"
  PHASE=
else
  phase docker
  dockerd_started=$("$HERE/docker-up.sh")
fi

# The toolchain's kubectl, helm; kind from kind.sh. Put on PATH for the tests too.
eval "$("$ROOT/e2e/toolchain/build.sh" --env)"
for tool in "$KUBECTL" "$HELM"; do
  [ -x "$tool" ] || { echo "e2e-kind: $tool missing: run \`make toolchain\` first" >&2; exit 2; }
done

cleanup() {
  status=$?
  if [ "$status" -ne 0 ] && [ -n "${KIND:-}" ]; then
    echo "e2e-kind: failed; cluster logs in $ARTIFACTS/logs" >&2
    "$KIND" export logs "$ARTIFACTS/logs" --name "$CLUSTER" >/dev/null 2>&1 || true
    "$KUBECTL" get rljobs,pods,events -A -o wide >"$ARTIFACTS/objects.txt" 2>&1 || true
  fi
  if [ "$PHASES" = setup ] && [ "$status" -eq 0 ]; then
    exit 0 # left up for SPOTRL_KIND_PHASES=tests
  fi
  if [ -n "${KIND:-}" ]; then
    if [ "$KEEP_CLUSTER" = 1 ]; then
      echo "e2e-kind: cluster $CLUSTER kept (KUBECONFIG=$KUBECONFIG); delete it with: $KIND delete cluster --name $CLUSTER"
    else
      "$KIND" delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    fi
  fi
  if [ "$dockerd_started" = started ] && [ "$KEEP_CLUSTER" != 1 ]; then
    "$HERE/docker-down.sh"
  fi
  [ "$KEEP_CLUSTER" = 1 ] || rm -f "$SETUP_ENV"
  exit "$status"
}
trap cleanup EXIT

if [ "$PHASES" != tests ]; then
  phase kind-build
  "$HERE/kind.sh" build
fi
eval "$("$HERE/kind.sh" env)"
ln -sf "$KUBECTL" "$ARTIFACTS/bin/kubectl"
ln -sf "$HELM" "$ARTIFACTS/bin/helm"
ln -sf "$KIND" "$ARTIFACTS/bin/kind"
ln -sf "$DOCKER" "$ARTIFACTS/bin/docker"
export PATH="$ARTIFACTS/bin:$PATH"
[ "$PHASES" = down ] && exit 0 # the trap deletes the cluster and stops the dockerd the setup started

# The setup's last phase (the chart, or the S3 server where the first hour installs the chart
# itself): SPOTRL_KIND_PHASES=setup stops after it, saying how to reach what it started.
if [ "$SUBSET" = ci ]; then last_setup=chart; else last_setup=s3; fi
setup_done() {
  if [ "$PHASES" = setup ] && [ "$1" = "$last_setup" ]; then
    phase end
    {
      echo "dockerd_started=$dockerd_started"
      echo "S3_ACCESS_KEY=$S3_ACCESS_KEY"
      echo "S3_SECRET_KEY=$S3_SECRET_KEY"
    } >"$SETUP_ENV"
    echo "e2e-kind: cluster $CLUSTER is up; SPOTRL_KIND_PHASES=tests runs the tests on it"
    exit 0
  fi
}

if [ "$PHASES" != tests ]; then
  phase images
  "$HERE/images.sh" "$TAG" operator runtime-cpu

  phase cluster
  if kind get clusters 2>/dev/null | grep -qx "$CLUSTER" && [ "$KEEP_CLUSTER" = 1 ] &&
    kubectl get nodes >/dev/null 2>&1; then
    echo "reusing the kept cluster $CLUSTER"
  else
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    kind create cluster --name "$CLUSTER" --image "$KIND_NODE_IMAGE" --config "$HERE/cluster.yaml" \
      --kubeconfig "$KUBECONFIG" --wait 300s
  fi
  kubectl get nodes -L karpenter.sh/capacity-type

  phase load
  # Each image only where its pods run: the S3 server on the control plane, the operator on
  # the workers, the runtime on the workers (in the CI subset only the spot workers, where its
  # tests place their jobs). Not `kind load`: that writes a tar of the image and imports it
  # into every node at once, which for the 5.6 GB runtime image needs ~40 GB of disk at the
  # peak. Here one `docker save` is piped (tee) into the containerd of as many nodes at a time
  # as the free disk allows (an import holds the image twice until it is unpacked): dockerd
  # spends ~55 s of CPU writing the runtime image's tar, once for all of them rather than once
  # a node. The layer blobs are then dropped from each node's content store (what
  # containerd's discard_unpacked_layers does for pulls), so each node keeps one copy, as
  # snapshots.
  needs() { # image node: does the node lack this build of the image? (an older one goes)
    local want have
    want=$($DOCKER image inspect -f '{{.Id}}' "$1")
    have=$($DOCKER exec "$2" crictl inspecti -o go-template --template '{{.status.id}}' "$1" 2>/dev/null || true)
    [ "$have" = "$want" ] && return 1
    # A kept cluster with an older build: remove that first (the disk holds one copy).
    if [ -n "$have" ]; then $DOCKER exec "$2" crictl rmi "$1" >/dev/null || true; fi
    return 0
  }
  load_into() { # image node...: one save, tee'd into each node's import
    local image=$1 fifos=() dir pids=() node rc=0 layers
    shift
    dir=$(mktemp -d)
    for node in "$@"; do
      mkfifo "$dir/$node"
      fifos+=("$dir/$node")
      $DOCKER exec -i "$node" ctr -n k8s.io images import --digests --snapshotter overlayfs - <"$dir/$node" >/dev/null &
      pids+=($!)
    done
    $DOCKER save "$image" | tee "${fifos[@]}" >/dev/null || rc=$?
    for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
    rm -rf "$dir"
    ((rc == 0)) || { echo "e2e-kind: loading $image into $* failed (exit $rc)" >&2; return "$rc"; }
    layers=$($DOCKER image inspect "$image" -f '{{range .RootFS.Layers}}{{.}} {{end}}')
    for node in "$@"; do
      # shellcheck disable=SC2086
      $DOCKER exec "$node" ctr -n k8s.io content rm $layers >/dev/null 2>&1 || true
      echo "loaded $image into $node"
    done
  }
  load() {
    local image=$1 size free at_once t0=$SECONDS node lacking=()
    shift
    for node in "$@"; do needs "$image" "$node" && lacking+=("$node"); done
    ((${#lacking[@]})) || { echo "$image: already on $*"; return 0; }
    size=$($DOCKER image inspect -f '{{.Size}}' "$image")
    free=$(($(df -B1 --output=avail /var/lib/docker | tail -1) - 4 * 1024 ** 3))
    at_once=$((free / (2 * size + 1)))
    ((at_once >= 1)) || { echo "e2e-kind: too little disk to load $image ($((2 * size / 1024 ** 3)) GB needed)" >&2; return 1; }
    while ((${#lacking[@]})); do
      load_into "$image" "${lacking[@]:0:at_once}" || return
      lacking=("${lacking[@]:at_once}")
    done
    echo "$image: $((SECONDS - t0)) s, up to $at_once node(s) from one save"
  }
  source "$ROOT/e2e/toolchain/versions.env"
  read -r -a workers <<<"$(kubectl get nodes -l '!node-role.kubernetes.io/control-plane' -o jsonpath='{.items[*].metadata.name}')"
  read -r -a runtime_nodes <<<"$(kubectl get nodes -l karpenter.sh/capacity-type=spot -o jsonpath='{.items[*].metadata.name}')"
  [ "$SUBSET" = ci ] || runtime_nodes=("${workers[@]}")
  load "spotrl-local/versitygw:$VERSITYGW_VERSION" "$CLUSTER-control-plane"
  load "$OPERATOR_IMAGE" "${workers[@]}"
  load "$RUNTIME_IMAGE" "${runtime_nodes[@]}"

  phase s3
  kubectl apply -f "$HERE/s3.yaml"
  if kubectl -n spotrl-e2e get secret s3-root >/dev/null 2>&1; then
    S3_ACCESS_KEY=$(kubectl -n spotrl-e2e get secret s3-root -o jsonpath='{.data.AWS_ACCESS_KEY_ID}' | base64 -d)
    S3_SECRET_KEY=$(kubectl -n spotrl-e2e get secret s3-root -o jsonpath='{.data.AWS_SECRET_ACCESS_KEY}' | base64 -d)
  else
    S3_ACCESS_KEY=spotrl-$(head -c 4 /dev/urandom | od -An -tx1 | tr -d ' \n')
    S3_SECRET_KEY=$(head -c 20 /dev/urandom | od -An -tx1 | tr -d ' \n')
    kubectl -n spotrl-e2e create secret generic s3-root \
      --from-literal=AWS_ACCESS_KEY_ID="$S3_ACCESS_KEY" --from-literal=AWS_SECRET_ACCESS_KEY="$S3_SECRET_KEY"
  fi
  kubectl -n spotrl-e2e rollout status deployment/s3 --timeout=180s
  for _ in $(seq 60); do
    curl -s -o /dev/null http://127.0.0.1:30070/ && break
    sleep 2
  done
fi

export SPOTRL_E2E_TARGET=kind
export SPOTRL_KIND_CLUSTER=$CLUSTER
export SPOTRL_E2E_OPERATOR_NAMESPACE=spotrl-system
export SPOTRL_E2E_S3_HOST_ENDPOINT=http://127.0.0.1:30070
export SPOTRL_E2E_S3_POD_ENDPOINT=http://s3.spotrl-e2e.svc.cluster.local:7070
export SPOTRL_E2E_S3_ACCESS_KEY=$S3_ACCESS_KEY
export SPOTRL_E2E_S3_SECRET_KEY=$S3_SECRET_KEY
export SPOTRL_E2E_CHART_IMAGES="--set image.repository=spotrl-operator --set image.tag=$TAG --set image.pullPolicy=Never \
--set runtimeImage.repository=spotrl-runtime-cpu --set runtimeImage.tag=$TAG --set runtimeImage.pullPolicy=Never"
select=()
[ "$SUBSET" = ci ] && select=(-m kind_ci)
cd "$ROOT"
pytest_args=(-v -p no:cacheprovider --timeout 1800 --durations 0 "${select[@]}" "$@")
[ "$PHASES" = tests ] || setup_done s3

if [ "$SUBSET" != ci ] && [ "$PHASES" != setup ]; then
  phase first-hour
  # The README's commands on the fresh cluster: they install (and uninstall) the chart.
  helm uninstall spotrl -n spotrl-system --wait >/dev/null 2>&1 || true
  "$PY" -m pytest tests/e2e/test_first_hour.py --junitxml "$ARTIFACTS/junit-first-hour.xml" "${pytest_args[@]}"
fi

if [ "$PHASES" != tests ] || [ "$last_setup" != chart ]; then
  phase chart
  helm upgrade --install spotrl "$ROOT/charts/spotrl" --namespace spotrl-system --create-namespace \
    --set image.repository=spotrl-operator --set image.tag=$TAG --set image.pullPolicy=Never \
    --set runtimeImage.repository=spotrl-runtime-cpu --set runtimeImage.tag=$TAG --set runtimeImage.pullPolicy=Never \
    --set-string 'nodeSelector.karpenter\.sh/capacity-type=on-demand' \
    --set leaderElection.leaseSeconds=6 --set reconcileInterval=1 \
    --wait --timeout 180s
  kubectl -n spotrl-system get pods -o wide
  setup_done chart
fi

phase tests
"$PY" -m pytest tests/e2e/test_preemption.py --junitxml "$ARTIFACTS/junit.xml" "${pytest_args[@]}"
phase end
