#!/usr/bin/env bash
# `make e2e-kind`: the end-to-end tests on a real kind cluster, every part built here.
#
#   1. docker: start dockerd if none answers (and stop it at the end), the runc wrapper
#      where privileged containers fail (docker-up.sh)
#   2. kind and its node image, built from Go modules and Debian packages (kind.sh build)
#   3. the images: Dockerfile targets `operator` and `runtime-cpu` on local bases, and the
#      S3 server (images.sh)
#   4. a kind cluster: control plane + two spot workers + one on-demand worker
#   4a. before the cluster, the store: one containerd root with the images unpacked, cached
#      by the images' IDs; each node's /var/lib/containerd is a hard-linked clone of it, so
#      no image is loaded into a node (containerd-store.sh)
#   5. the S3 server (versitygw) and Kueue (its manager from the toolchain's binary) in the
#      cluster, charts/spotrl installed with kueue.enabled
#   6. the README's first hour as written (tests/e2e/test_first_hour.py: helm install,
#      kubectl apply, a drain), then the chart installed for the rest of tests/e2e, with
#      SPOTRL_E2E_TARGET=kind. `SPOTRL_KIND_SUBSET=ci` (what CI runs) runs the first hour and
#      only the tests marked kind_ci: a drain after a notice, the leading operator's pod
#      killed mid-barrier, an abrupt node loss, retention Delete, and Kueue: a job over the
#      quota kept Queued, a higher priority preempting through a barrier cut.
#   7. the cluster deleted (KEEP_CLUSTER=1 keeps it, and the next run reuses it while the
#      images are the same, and makes a new one from the new store when they are not; the
#      chart is upgraded; logs go to $ARTIFACTS on failure)
#
# The log of every SpotRL pod (operators, controllers, workers; init containers too), kept by
# the tests as it is written, however the pod ends (force-deleted, replaced after a crash),
# which `kind export logs` cannot: $ARTIFACTS/pod-logs/<namespace>/<pod>/<container>.log
# (spotrl_e2e.podlogs; fresh for each run that runs tests).
#
# SPOTRL_KIND_PHASES=setup runs 1-5 and leaves the cluster (and dockerd) up, saying how to
# reach it in $ARTIFACTS/setup.env; SPOTRL_KIND_PHASES=tests then runs 6-7 on it, and
# SPOTRL_KIND_PHASES=down only 7. SPOTRL_KIND_PHASES=prepare builds what 1-4a need (the
# toolchain too, when missing) and starts nothing but dockerd, which it leaves running:
# .ci/run prepares beside the venv and the first suites, so make test's kind phase finds
# everything cached.
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
case "$PHASES" in all | prepare | setup | tests | down) ;; *)
  echo "e2e-kind: SPOTRL_KIND_PHASES=$PHASES: say all, prepare (build, start nothing), setup (build and start the cluster, leave it up), tests or down" >&2
  exit 2
  ;;
esac
TAG=e2e
OPERATOR_IMAGE=spotrl-operator:$TAG
RUNTIME_IMAGE=spotrl-runtime-cpu:$TAG
export DOCKER=/usr/bin/docker

[ "$PHASES" = prepare ] || [ -x "$PY" ] || { echo "e2e-kind: $PY missing: run \`make install\` first" >&2; exit 2; }
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
if [ "$PHASES" = prepare ]; then
  phase toolchain
  "$ROOT/e2e/toolchain/build.sh"
fi

# The toolchain's kubectl, helm; kind from kind.sh. Put on PATH for the tests too.
eval "$("$ROOT/e2e/toolchain/build.sh" --env)"
for tool in "$KUBECTL" "$HELM"; do
  [ -x "$tool" ] || { echo "e2e-kind: $tool missing: run \`make toolchain\` first" >&2; exit 2; }
done

cleanup() {
  status=$?
  [ "$PHASES" != prepare ] || exit "$status" # it started no cluster, and leaves dockerd up
  if [ "$status" -ne 0 ] && [ -n "${KIND:-}" ]; then
    echo "e2e-kind: failed; cluster logs in $ARTIFACTS/logs, every SpotRL pod's in $ARTIFACTS/pod-logs" >&2
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
      "$HERE/containerd-store.sh" drop "$CLUSTER" || true
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

  phase store
  # Every node's /var/lib/containerd is a clone of one store that holds our images unpacked
  # (containerd-store.sh): no image is loaded into a node. A kept cluster is reused only if
  # it was made from the store of these very images.
  source "$ROOT/e2e/toolchain/versions.env"
  images=("spotrl-local/versitygw:$VERSITYGW_VERSION" "spotrl-local/kueue:$KUEUE_VERSION" "$OPERATOR_IMAGE" "$RUNTIME_IMAGE")
  store=$("$HERE/containerd-store.sh" build "$KIND_NODE_IMAGE" "${images[@]}")
  if [ "$PHASES" = prepare ]; then
    phase end
    exit 0
  fi

  phase cluster
  if kind get clusters 2>/dev/null | grep -qx "$CLUSTER" && [ "$KEEP_CLUSTER" = 1 ] &&
    kubectl get nodes >/dev/null 2>&1 && [ "$(cat "$ARTIFACTS/cluster-store" 2>/dev/null)" = "$store" ]; then
    echo "reusing the kept cluster $CLUSTER"
  else
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
    clones=$("$HERE/containerd-store.sh" clone "$CLUSTER" "$(grep -c '^  - role:' "$HERE/cluster.yaml")" "$store")
    # cluster.yaml, with each node's clone mounted at its /var/lib/containerd.
    "$PY" - "$HERE/cluster.yaml" "$clones" >"$ARTIFACTS/cluster.yaml" <<'EOF'
import sys

import yaml

config = yaml.safe_load(open(sys.argv[1]))
for i, node in enumerate(config["nodes"]):
    mount = {"hostPath": f"{sys.argv[2]}/{i}", "containerPath": "/var/lib/containerd"}
    node.setdefault("extraMounts", []).append(mount)
yaml.safe_dump(config, sys.stdout, sort_keys=False)
EOF
    kind create cluster --name "$CLUSTER" --image "$KIND_NODE_IMAGE" --config "$ARTIFACTS/cluster.yaml" \
      --kubeconfig "$KUBECONFIG" --wait 300s
    echo "$store" >"$ARTIFACTS/cluster-store"
  fi
  kubectl get nodes -L karpenter.sh/capacity-type

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

  phase kueue
  # Kueue's manager, CRDs, roles, certificate and webhooks; before the chart, whose operator
  # (kueue.enabled) watches Kueue's Workloads from its start.
  PYTHONPATH="$ROOT/e2e" "$PY" -m spotrl_e2e.kueue install --manifests "$KUEUE_MANIFESTS" --image "spotrl-local/kueue:$KUEUE_VERSION" \
    --workdir "$ARTIFACTS/kueue"
fi

export SPOTRL_E2E_TARGET=kind
export SPOTRL_KIND_CLUSTER=$CLUSTER
export SPOTRL_E2E_OPERATOR_NAMESPACE=spotrl-system
export SPOTRL_E2E_S3_HOST_ENDPOINT=http://127.0.0.1:30070
export SPOTRL_E2E_S3_POD_ENDPOINT=http://s3.spotrl-e2e.svc.cluster.local:7070
export SPOTRL_E2E_S3_ACCESS_KEY=$S3_ACCESS_KEY
export SPOTRL_E2E_S3_SECRET_KEY=$S3_SECRET_KEY
export SPOTRL_E2E_POD_LOGS=$ARTIFACTS/pod-logs # where the tests keep every SpotRL pod's log (kind_cluster)
export SPOTRL_E2E_CHART_IMAGES="--set image.repository=spotrl-operator --set image.tag=$TAG --set image.pullPolicy=Never \
--set runtimeImage.repository=spotrl-runtime-cpu --set runtimeImage.tag=$TAG --set runtimeImage.pullPolicy=Never"
select=()
[ "$SUBSET" = ci ] && select=(-m kind_ci)
cd "$ROOT"
pytest_args=(-v -p no:cacheprovider --timeout 1800 --durations 0 "${select[@]}" "$@")
[ "$PHASES" = tests ] || setup_done s3
rm -rf "$SPOTRL_E2E_POD_LOGS" # this run's pods only (a file is appended to across the run's pytest sessions)

if [ "$PHASES" != setup ]; then
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
    --set leaderElection.leaseSeconds=6 --set reconcileInterval=1 --set kueue.enabled=true \
    --set nodeLostSeconds=2 `# below the pods' 5 s unreachable toleration (cluster.yaml), as 30 s is below 300 s` \
    --wait --timeout 180s
  kubectl -n spotrl-system get pods -o wide
  setup_done chart
fi

phase tests
"$PY" -m pytest tests/e2e/test_preemption.py tests/e2e/test_kueue.py --junitxml "$ARTIFACTS/junit.xml" "${pytest_args[@]}"
phase end
