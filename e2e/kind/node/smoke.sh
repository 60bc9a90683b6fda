#!/usr/bin/env bash
# Smoke test of the kind node image: creates a cluster from e2e/kind/cluster.yaml and
# checks what the e2e tests rely on, then deletes it (KEEP_CLUSTER=1 keeps it).
#   - every node Ready; CoreDNS, kindnet, kube-proxy and local-path pods Running
#   - a pod on a worker resolves kubernetes.default.svc.cluster.local and reaches it
#   - a PVC of StorageClass "standard" binds and is writable
#   - `kind load docker-image` puts an image on the nodes
#   - `kubectl drain` of a worker evicts its pods
#   - `docker kill` of a worker's container turns its node NotReady
# Prints how long each step took. Run e2e/kind/kind.sh build first.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../../.." && pwd)
eval "$("$here/build.sh" --env)"
eval "$("$repo/e2e/toolchain/build.sh" --env)"
DOCKER=${DOCKER:-/usr/bin/docker}
export PATH=$(dirname "$DOCKER"):$PATH # kind calls `docker`: use the client matching dockerd
name=${SPOTRL_KIND_CLUSTER:-spotrl-smoke}
export KUBECONFIG=$(mktemp)
k() { "$KUBECTL" "$@"; }
t0=$SECONDS
lap() { echo "smoke: $* ($((SECONDS - t0)) s)"; t0=$SECONDS; }
cleanup() {
  local status=$?
  if ((status != 0)); then
    echo "smoke: FAILED; pods:" >&2
    k get pods -A -o wide >&2 || true
  fi
  if [[ ${KEEP_CLUSTER:-0} == 1 ]]; then
    echo "smoke: cluster $name kept; KUBECONFIG=$KUBECONFIG"
  else
    "$KIND" delete cluster --name "$name" >/dev/null 2>&1 || true
    rm -f "$KUBECONFIG"
  fi
  exit "$status"
}
trap cleanup EXIT

"$KIND" delete cluster --name "$name" >/dev/null 2>&1 || true
"$KIND" create cluster --name "$name" --image "$KIND_NODE_IMAGE" --config "$repo/e2e/kind/cluster.yaml"
lap "cluster created"
k wait --for=condition=Ready nodes --all --timeout=120s >/dev/null
lap "all nodes Ready"
k -n kube-system rollout status deploy/coredns ds/kindnet ds/kube-proxy --timeout=120s >/dev/null
k -n local-path-storage rollout status deploy/local-path-provisioner --timeout=120s >/dev/null
lap "CoreDNS, kindnet, kube-proxy, local-path-provisioner running"

k apply -f - >/dev/null <<'EOF'
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: smoke}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: standard
  resources: {requests: {storage: 1Gi}}
---
apiVersion: v1
kind: Pod
metadata: {name: smoke}
spec:
  nodeSelector: {karpenter.sh/capacity-type: spot}
  restartPolicy: Never
  containers:
    - name: smoke
      image: spotrl-local/local-path-helper:bookworm
      imagePullPolicy: Never
      command: [bash, -euc]
      args:
        - |
          getent hosts kubernetes.default.svc.cluster.local
          timeout 5 bash -c 'exec 3<>/dev/tcp/kubernetes.default.svc.cluster.local/443'
          echo ok >/data/smoke && cat /data/smoke
      volumeMounts: [{name: data, mountPath: /data}]
  volumes: [{name: data, persistentVolumeClaim: {claimName: smoke}}]
EOF
k wait --for=jsonpath='{.status.phase}'=Succeeded pod/smoke --timeout=120s >/dev/null
k logs smoke | sed 's/^/        /'
[[ $(k get pvc smoke -o jsonpath='{.status.phase}') == Bound ]]
lap "pod on $(k get pod smoke -o jsonpath='{.spec.nodeName}'): DNS, service and PVC ok"

# An image the nodes lack (one label more than the helper image, so another ID).
echo $'FROM spotrl-local/local-path-helper:bookworm\nLABEL spotrl.smoke=1' |
  $DOCKER build -q -t spotrl-local/smoke-load:1 - >/dev/null
"$KIND" load docker-image --name "$name" spotrl-local/smoke-load:1 >/dev/null
$DOCKER exec "$name-worker" crictl images | grep -q 'spotrl-local/smoke-load'
lap "kind load docker-image"

worker=$name-worker2
k create deployment smoke --image=spotrl-local/local-path-helper:bookworm --replicas=3 -- sleep infinity >/dev/null
k rollout status deploy/smoke --timeout=120s >/dev/null
k drain "$worker" --ignore-daemonsets --delete-emptydir-data --grace-period=1 --timeout=60s >/dev/null
[[ -z $(k get pods -l app=smoke --field-selector spec.nodeName="$worker" -o name) ]]
lap "drained $worker"

worker=$name-worker3
$DOCKER kill "$worker" >/dev/null
until [[ $(k get node "$worker" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}') == Unknown ]]; do
  ((SECONDS - t0 < 120)) || { echo "smoke: $worker still Ready 120 s after docker kill" >&2; exit 1; }
  sleep 2
done
lap "$worker NotReady after docker kill"
echo "smoke: all checks passed"
