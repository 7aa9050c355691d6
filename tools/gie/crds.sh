#!/usr/bin/env bash
# The Gateway API Inference Extension's CRDs (InferencePool, inference.networking.k8s.io/v1) from its Go module,
# pinned below, fetched once through the Go module proxy (checked against the Go checksum database) into
#
#   ${NAIAD_TOOLS_CACHE:-$HOME/.cache/naiad-tools}/gie-<version>/crds
#
# The directory is printed as the last line of stdout. The e2e cluster applies them so that the operator renders an
# InferencePool per LLM InferenceModel (tests/operator/test_operator_llm_cluster.py).
#
# Environment: GO (go binary), NAIAD_TOOLS_CACHE (cache root).
set -euo pipefail

MODULE=sigs.k8s.io/gateway-api-inference-extension
VERSION=v1.6.0  # the newest release the module proxy serves here (v1.7.0 answers 403)
FILES=(config/crd/bases/inference.networking.k8s.io_inferencepools.yaml)

GO="${GO:-}"
if [[ -z "$GO" ]]; then
  if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
  elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
  else echo "crds.sh: no Go toolchain found (set GO=...)" >&2; exit 3
  fi
fi

dest="${NAIAD_TOOLS_CACHE:-$HOME/.cache/naiad-tools}/gie-$VERSION"
if [[ -f "$dest/.complete" ]]; then echo "$dest/crds"; exit 0; fi
mkdir -p "$dest/crds"
exec 9>"$dest/.lock"
flock 9
if [[ -f "$dest/.complete" ]]; then echo "$dest/crds"; exit 0; fi
# the module's files come from a module cache of this script's own, removed when it ends (tools/go/caches.sh)
# shellcheck source=../go/caches.sh
source "$(dirname "${BASH_SOURCE[0]}")/../go/caches.sh"
trap 'rm -rf "$dest/.go-caches"' EXIT
go_private_caches "$dest/.go-caches"

dir="$(go_module_dir "$MODULE@$VERSION")"
[[ -d "$dir" ]] || { echo "crds.sh: $MODULE@$VERSION did not download" >&2; exit 4; }
for f in "${FILES[@]}"; do
  install -m 0644 "$dir/$f" "$dest/crds/$(basename "$f")"
done
touch "$dest/.complete"
echo "[tools/gie] $MODULE@$VERSION CRDs in $dest/crds" >&2
echo "$dest/crds"
