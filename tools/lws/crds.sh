#!/usr/bin/env bash
# LeaderWorkerSet's CRD (leaderworkerset.x-k8s.io/v1) and its admission webhooks' manifests from the Go module that
# tools/go/lws builds the controller from (the same pin), fetched once through the Go module proxy (checked against
# the Go checksum database) into
#
#   ${NAIAD_TOOLS_CACHE:-$HOME/.cache/naiad-tools}/lws-<version>/{crds,webhook}
#
# The directory is printed as the last line of stdout. The e2e cluster applies the CRD and registers the webhooks
# at the controller's local address (e2e/lws.py), so that the operator's LeaderWorkerSets get their pods.
#
# Environment: GO (go binary), NAIAD_TOOLS_CACHE (cache root).
set -euo pipefail

MODULE=sigs.k8s.io/lws
VERSION=v0.7.0  # the proxy lists no versions of this module (403), but serves this release; keep tools/go/lws in step

GO="${GO:-}"
if [[ -z "$GO" ]]; then
  if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
  elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
  else echo "crds.sh: no Go toolchain found (set GO=...)" >&2; exit 3
  fi
fi

dest="${NAIAD_TOOLS_CACHE:-$HOME/.cache/naiad-tools}/lws-$VERSION"
if [[ -f "$dest/.complete" ]]; then echo "$dest"; exit 0; fi
mkdir -p "$dest/crds" "$dest/webhook"
exec 9>"$dest/.lock"
flock 9
if [[ -f "$dest/.complete" ]]; then echo "$dest"; exit 0; fi
# the module's files come from a module cache of this script's own, removed when it ends (tools/go/caches.sh)
# shellcheck source=../go/caches.sh
source "$(dirname "${BASH_SOURCE[0]}")/../go/caches.sh"
trap 'rm -rf "$dest/.go-caches"' EXIT
go_private_caches "$dest/.go-caches"

dir="$(go_module_dir "$MODULE@$VERSION")"
[[ -d "$dir" ]] || { echo "crds.sh: $MODULE@$VERSION did not download" >&2; exit 4; }
install -m 0644 "$dir/config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml" "$dest/crds/"
install -m 0644 "$dir/config/webhook/manifests.yaml" "$dest/webhook/manifests.yaml"
touch "$dest/.complete"
echo "[tools/lws] $MODULE@$VERSION CRD and webhook manifests in $dest" >&2
echo "$dest"
