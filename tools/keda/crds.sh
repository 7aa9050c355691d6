#!/usr/bin/env bash
# KEDA's CRDs (keda.sh: ScaledObject, ScaledJob, the two TriggerAuthentications; eventing.keda.sh: the two
# CloudEventSources, which its operator also watches) and the HTTP add-on's HTTPScaledObject (http.keda.sh) from
# the Go modules that tools/go/keda builds them from (the same pins), fetched once through the Go module proxy
# (checked against the Go checksum database) into
#
#   ${NAIAD_TOOLS_CACHE:-$HOME/.cache/naiad-tools}/keda-<versions>/crds
#
# The directory is printed as the last line of stdout. The e2e cluster applies them before it runs KEDA
# (e2e/keda.py), so that a pool at zero pods wakes through the add-on's interceptor.
#
# Environment: GO (go binary), NAIAD_TOOLS_CACHE (cache root).
set -euo pipefail

KEDA=github.com/kedacore/keda/v2@v2.21.0            # keep tools/go/keda/go.mod in step
ADD_ON=github.com/kedacore/http-add-on@v0.12.0       # the one add-on release the proxy here serves

GO="${GO:-}"
if [[ -z "$GO" ]]; then
  if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
  elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
  else echo "crds.sh: no Go toolchain found (set GO=...)" >&2; exit 3
  fi
fi

dest="${NAIAD_TOOLS_CACHE:-$HOME/.cache/naiad-tools}/keda-${KEDA##*@}-${ADD_ON##*@}"
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

keda_dir="$(go_module_dir "$KEDA")"
add_on_dir="$(go_module_dir "$ADD_ON")"
[[ -d "$keda_dir" && -d "$add_on_dir" ]] || { echo "crds.sh: $KEDA or $ADD_ON did not download" >&2; exit 4; }
install -m 0644 "$keda_dir"/config/crd/bases/*.yaml "$dest/crds/"
install -m 0644 "$add_on_dir"/config/crd/bases/http.keda.sh_httpscaledobjects.yaml "$dest/crds/"
touch "$dest/.complete"
echo "[tools/keda] $KEDA and $ADD_ON CRDs in $dest/crds" >&2
echo "$dest/crds"
