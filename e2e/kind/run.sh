#!/usr/bin/env bash
# `make e2e-kind`: the end-to-end tests on a real kind cluster (for machines with Docker).
#
#   1. build the images (Dockerfile targets `operator` and `runtime-cpu`)
#   2. create a kind cluster: control plane + two spot workers + one on-demand worker
#   3. load the images, start an S3 server (versitygw) in the cluster
#   4. install the Helm chart (operator on the on-demand worker, images from step 1)
#   5. run tests/e2e/test_preemption.py with SPOTRL_E2E_TARGET=kind
#   6. delete the cluster (KEEP_CLUSTER=1 keeps it; logs go to $ARTIFACTS on failure)
#
# Needs docker, kind, kubectl and helm on PATH, and the repository's .venv (make install).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
CLUSTER=${SPOTRL_KIND_CLUSTER:-spotrl-e2e}
KEEP_CLUSTER=${KEEP_CLUSTER:-0}
ARTIFACTS=${ARTIFACTS:-$ROOT/.e2e-kind}
PY=${PY:-$ROOT/.venv/bin/python}
TAG=e2e
OPERATOR_IMAGE=spotrl-operator:$TAG
RUNTIME_IMAGE=spotrl-runtime-cpu:$TAG

for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "e2e-kind: $tool is not on PATH" >&2; exit 2; }
done
[ -x "$PY" ] || { echo "e2e-kind: $PY missing: run \`make install\` first" >&2; exit 2; }
mkdir -p "$ARTIFACTS"
export KUBECONFIG="$ARTIFACTS/kubeconfig"

cleanup() {
  status=$?
  if [ "$status" -ne 0 ]; then
    echo "e2e-kind: failed; exporting cluster logs to $ARTIFACTS/logs" >&2
    kind export logs "$ARTIFACTS/logs" --name "$CLUSTER" >/dev/null 2>&1 || true
    kubectl get rljobs,pods,events -A -o wide > "$ARTIFACTS/objects.txt" 2>&1 || true
  fi
  if [ "$KEEP_CLUSTER" = 1 ]; then
    echo "e2e-kind: cluster $CLUSTER kept (KUBECONFIG=$KUBECONFIG); delete it with: kind delete cluster --name $CLUSTER"
  else
    kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  fi
  exit "$status"
}
trap cleanup EXIT

echo "== images"
docker build --target operator -t "$OPERATOR_IMAGE" "$ROOT"
docker build --target runtime-cpu -t "$RUNTIME_IMAGE" "$ROOT"

echo "== cluster $CLUSTER"
kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
kind create cluster --name "$CLUSTER" --config "$ROOT/e2e/kind/cluster.yaml" --kubeconfig "$KUBECONFIG" --wait 180s
kind load docker-image --name "$CLUSTER" "$OPERATOR_IMAGE" "$RUNTIME_IMAGE"
kubectl get nodes -L karpenter.sh/capacity-type

echo "== S3 server"
S3_ACCESS_KEY=spotrl-$(head -c 4 /dev/urandom | od -An -tx1 | tr -d ' \n')
S3_SECRET_KEY=$(head -c 20 /dev/urandom | od -An -tx1 | tr -d ' \n')
kubectl apply -f "$ROOT/e2e/kind/s3.yaml"
kubectl -n spotrl-e2e create secret generic s3-root \
  --from-literal=AWS_ACCESS_KEY_ID="$S3_ACCESS_KEY" --from-literal=AWS_SECRET_ACCESS_KEY="$S3_SECRET_KEY"
kubectl -n spotrl-e2e rollout status deployment/s3 --timeout=180s
for _ in $(seq 60); do
  curl -s -o /dev/null http://127.0.0.1:30070/ && break
  sleep 2
done

echo "== chart"
helm install spotrl "$ROOT/charts/spotrl" --namespace spotrl-system --create-namespace \
  --set image.repository=spotrl-operator --set image.tag=$TAG --set image.pullPolicy=Never \
  --set runtimeImage.repository=spotrl-runtime-cpu --set runtimeImage.tag=$TAG --set runtimeImage.pullPolicy=Never \
  --set-string 'nodeSelector.karpenter\.sh/capacity-type=on-demand' \
  --set leaderElection.leaseSeconds=6 --set reconcileInterval=1 \
  --wait --timeout 180s
kubectl -n spotrl-system get pods -o wide

echo "== tests"
export SPOTRL_E2E_TARGET=kind
export SPOTRL_KIND_CLUSTER=$CLUSTER
export SPOTRL_E2E_OPERATOR_NAMESPACE=spotrl-system
export SPOTRL_E2E_S3_HOST_ENDPOINT=http://127.0.0.1:30070
export SPOTRL_E2E_S3_POD_ENDPOINT=http://s3.spotrl-e2e.svc.cluster.local:7070
export SPOTRL_E2E_S3_ACCESS_KEY=$S3_ACCESS_KEY
export SPOTRL_E2E_S3_SECRET_KEY=$S3_SECRET_KEY
cd "$ROOT"
"$PY" -m pytest tests/e2e/test_preemption.py -v -p no:cacheprovider --timeout 1800 \
  --junitxml "$ARTIFACTS/junit.xml" "$@"
