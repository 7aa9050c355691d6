#!/usr/bin/env bash
# The operator scenario on a kind cluster, for machines with a Docker engine (not run in our CI: our machines
# have no Docker engine; CI uses the kwok + real control plane harness in e2e/ instead).
#
#   bash e2e/kind/run.sh            # create cluster, build and load images, install, run the scenario
#   KEEP=1 bash e2e/kind/run.sh     # keep the cluster afterwards
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cluster=${KIND_CLUSTER:-naiad-e2e}
ns=naiad-kind
py=${PYTHON:-$root/.venv/bin/python}

need() { command -v "$1" >/dev/null || { echo "needs $1" >&2; exit 2; }; }
need docker; need kind; need kubectl; need helm

cleanup() { [ -n "${KEEP:-}" ] || kind delete cluster --name "$cluster" >/dev/null 2>&1 || true; }
trap cleanup EXIT

echo "== cluster"
kind create cluster --name "$cluster" --config "$root/e2e/kind/cluster.yaml" --wait 120s

echo "== images"
docker build -q -f "$root/Dockerfile.server" -t naiad-server:e2e "$root"
docker build -q -f "$root/Dockerfile.operator" -t naiad-operator:e2e "$root"
kind load docker-image --name "$cluster" naiad-server:e2e naiad-operator:e2e

echo "== model repository on the node (hostPath /models-src, see cluster.yaml)"
make -C "$root" examples >/dev/null

echo "== operator"
helm install naiad "$root/helm/naiad" --namespace naiad-system --create-namespace --wait \
  --set image.repository=naiad-operator --set image.tag=e2e --set image.pullPolicy=Never \
  --set serverImage.repository=naiad-server --set serverImage.tag=e2e --set serverImage.pullPolicy=Never

echo "== scenario"
kubectl create namespace "$ns" --dry-run=client -o yaml | kubectl apply -f -
kubectl -n "$ns" apply -f "$root/e2e/kind/model-store.yaml"
kubectl -n "$ns" apply -f "$root/e2e/kind/inferencemodel.yaml"
kubectl -n "$ns" wait --for=jsonpath='{.status.phase}'=Available im/fc-model --timeout=300s
kubectl -n "$ns" get im,isrv,pods,svc

kubectl -n "$ns" port-forward svc/fc-model 18000:8000 18001:8001 >/dev/null 2>&1 &
pf=$!
trap 'kill $pf 2>/dev/null || true; cleanup' EXIT
sleep 3
"$py" - <<'PY'
import numpy as np, requests, tritonclient.grpc as grpcclient
body = {"inputs": [{"name": "input__0", "shape": [2, 3], "datatype": "INT64", "data": [[1, 2, 3], [4, 5, 6]]}]}
out = requests.post("http://127.0.0.1:18000/v2/models/fc_model_pt/infer", json=body, timeout=30).json()
assert [o["shape"] for o in out["outputs"]] == [[2, 3, 4], [2, 3, 8]], out
c = grpcclient.InferenceServerClient("127.0.0.1:18001")
i = grpcclient.InferInput("input__0", [2, 3], "INT64")
i.set_data_from_numpy(np.array([[1, 2, 3], [4, 5, 6]], dtype=np.int64))
assert c.infer("fc_model_pt", [i]).as_numpy("output__1").shape == (2, 3, 8)
print("inference through the model Service: HTTP and gRPC ok")
PY

echo "== config change reloads live (same pods)"
before=$(kubectl -n "$ns" get pods -l naiad.dev/server=fc-model-server -o jsonpath='{.items[*].metadata.uid}')
kubectl -n "$ns" patch im fc-model --type merge -p '{"spec":{"config":{"max_batch_size":8}}}'
sleep 10
kubectl -n "$ns" wait --for=jsonpath='{.status.phase}'=Available im/fc-model --timeout=120s
after=$(kubectl -n "$ns" get pods -l naiad.dev/server=fc-model-server -o jsonpath='{.items[*].metadata.uid}')
[ "$before" = "$after" ] || { echo "pods were replaced by a config change" >&2; exit 1; }

echo "== delete: unload and clean up"
kubectl -n "$ns" delete im fc-model --wait=true --timeout=120s
left=$(kubectl -n "$ns" get deploy,svc,hpa -o name | grep -c fc-model || true)
[ "$left" = 0 ] || { echo "orphans left: $left" >&2; kubectl -n "$ns" get deploy,svc,hpa; exit 1; }
echo "kind scenario passed"
