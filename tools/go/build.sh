#!/usr/bin/env bash
# Build one Go tool pinned under tools/go/<name>/ (go.mod, go.sum, tools.go importing it, packages.txt) once,
# from the Go module proxy, into a cache outside the repository:
#
#   ${NAIAD_TOOLS_CACHE:-$HOME/.cache/naiad-tools}/<name>-<hash>/bin
#
# The hash covers the tool's go.mod/go.sum/packages.txt, its own .go sources (not tools.go), this script and the Go version: an unchanged pin is a
# no-op, a changed one builds anew. packages.txt holds one `<package path> <binary name>` per line. The bin
# directory is printed as the last line of stdout; progress goes to stderr. Used by the Makefile's `tools`
# target, so every test tier finds its servers (MinIO, h2spec, the OpenTelemetry Collector) already built.
#
# Environment: GO (go binary), NAIAD_TOOLS_CACHE (cache root), NAIAD_TOOLS_FORCE=1 (rebuild).
set -euo pipefail

name="${1:?usage: tools/go/build.sh <name>}"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
src="$here/$name"
[[ -f "$src/go.mod" && -f "$src/packages.txt" ]] || { echo "build.sh: no tool '$name' under $here" >&2; exit 2; }

GO="${GO:-}"
if [[ -z "$GO" ]]; then
  if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
  elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
  else echo "build.sh: no Go toolchain found (set GO=...)" >&2; exit 3
  fi
fi

# (plus the tool's own Go sources, for tools written here rather than fetched, e.g. e2e-node)
hash="$( { "$GO" version; cat "$src/go.mod" "$src/go.sum" "$src/packages.txt" "$here/build.sh";
          find "$src" -name '*.go' ! -name tools.go | LC_ALL=C sort | xargs -r cat; } | sha256sum | cut -c1-16)"
root="${NAIAD_TOOLS_CACHE:-$HOME/.cache/naiad-tools}"
dest="$root/$name-$hash"
bin="$dest/bin"

complete() { [[ -f "$dest/.complete" ]]; }
if [[ "${NAIAD_TOOLS_FORCE:-0}" != 1 ]] && complete; then echo "$bin"; exit 0; fi

mkdir -p "$root"
exec 9>"$root/.$name-$hash.lock"
flock 9
if [[ "${NAIAD_TOOLS_FORCE:-0}" != 1 ]] && complete; then echo "$bin"; exit 0; fi

export GOFLAGS="${GOFLAGS:--mod=readonly}" CGO_ENABLED="${CGO_ENABLED:-0}" GOTOOLCHAIN=local
# shellcheck source=caches.sh
source "$here/caches.sh"
caches="$root/.$name-$hash.go-caches"
trap 'rm -rf "$caches"' EXIT
go_private_caches "$caches"
start=$(date +%s)
mkdir -p "$bin"
while read -r pkg out; do
  [[ -z "$pkg" || "$pkg" == \#* ]] && continue
  echo "[tools/go] building $name: $pkg" >&2
  # (no DWARF generated for binaries that are stripped of it: e2e/cluster/build.sh)
  (cd "$src" && "$GO" build -trimpath -gcflags=all=-dwarf=false -ldflags="-s -w" -o "$bin/${out:-$(basename "$pkg")}" "$pkg")
done < "$src/packages.txt"
touch "$dest/.complete"
echo "[tools/go] $name built in $(( $(date +%s) - start ))s: $bin" >&2
echo "$bin"
