#!/usr/bin/env bash
# Build the e2e cluster binaries (real Kubernetes control plane, kubelet and
# kube-proxy for the real node, etcd, kwok, kwokctl, helm, prometheus-adapter) from the pinned Go modules in this
# directory, once, into a cache outside the repository:
#
#   ${NAIAD_E2E_CACHE:-$HOME/.cache/naiad-e2e}/<versions-hash>/bin
#
# The hash covers every go.mod/go.sum here, this script and the Go version, so
# changing a pin produces a new directory and an unchanged tree is a no-op.
# The bin dir is printed as the last line of stdout; progress goes to stderr.
#
# Environment:
#   NAIAD_E2E_CACHE   cache root (default ~/.cache/naiad-e2e)
#   GO                go binary (default: `go` on PATH, else /usr/local/go/bin/go)
#   NAIAD_E2E_GO_P    value for `go build -p` (default: number of CPUs)
#   NAIAD_E2E_FORCE=1 rebuild even if the cache is complete
#   NAIAD_E2E_SERIAL=1 build the Kubernetes and tool modules one after the other
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

GO="${GO:-}"
if [[ -z "$GO" ]]; then
  if command -v go >/dev/null 2>&1; then GO="$(command -v go)"
  elif [[ -x /usr/local/go/bin/go ]]; then GO=/usr/local/go/bin/go
  else echo "build.sh: no Go toolchain found (set GO=...)" >&2; exit 3
  fi
fi

log() { echo "[build.sh $(date +%H:%M:%S)] $*" >&2; }

# Everything the binaries depend on, in a stable order.
modules=(. tools/kwok tools/helm tools/prometheus-adapter)
hash_inputs() {
  "$GO" version
  "$GO" env GOOS GOARCH
  for m in "${modules[@]}"; do
    echo "== $m"; cat "$here/$m/go.mod" "$here/$m/go.sum"
  done
  cat "$here/build.sh"
}
hash="$(hash_inputs | sha256sum | cut -c1-16)"

cache_root="${NAIAD_E2E_CACHE:-$HOME/.cache/naiad-e2e}"
dest="$cache_root/$hash"
bin="$dest/bin"
binaries=(kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy etcd etcdctl
          kwok kwokctl helm prometheus-adapter)

complete() {
  [[ -f "$dest/.complete" ]] || return 1
  local b; for b in "${binaries[@]}"; do [[ -x "$bin/$b" ]] || return 1; done
}

if [[ "${NAIAD_E2E_FORCE:-0}" != 1 ]] && complete; then
  log "cached: $bin"
  echo "$bin"
  exit 0
fi

mkdir -p "$cache_root"
# One builder at a time per hash (parallel CI jobs / pytest workers).
exec 9>"$cache_root/.$hash.lock"
flock 9
if [[ "${NAIAD_E2E_FORCE:-0}" != 1 ]] && complete; then
  log "cached (built by a concurrent run): $bin"
  echo "$bin"; exit 0
fi

export GOFLAGS="${GOFLAGS:--mod=readonly}"   # go.mod/go.sum are committed and tidy; never rewrite them
export CGO_ENABLED=0            # all of these are pure Go; no C toolchain needed
export GOTOOLCHAIN=local
P="${NAIAD_E2E_GO_P:-$(nproc)}"
# Go's caches for this build only, removed when it ends (tools/go/caches.sh; NAIAD_GO_CACHES=go keeps Go's own)
# shellcheck source=../../tools/go/caches.sh
source "$here/../../tools/go/caches.sh"
caches="$cache_root/.$hash.go-caches"
trap 'rm -rf "$caches"' EXIT
go_private_caches "$caches"

modver() { (cd "$here/$1" && "$GO" list -m -f '{{.Version}}' "$2"); }
modtime() { (cd "$here/$1" && "$GO" list -m -f '{{if .Time}}{{.Time.UTC.Format "2006-01-02T15:04:05Z"}}{{end}}' "$2"); }

k8s_version="$(modver . k8s.io/kubernetes)"            # e.g. v1.36.3
etcd_version="$(modver . go.etcd.io/etcd/server/v3)"
kwok_version="$(modver tools/kwok sigs.k8s.io/kwok)"
helm_version="$(modver tools/helm helm.sh/helm/v3)"
adapter_version="$(modver tools/prometheus-adapter sigs.k8s.io/prometheus-adapter)"
k8s_date="$(modtime . k8s.io/kubernetes)"
k8s_major="${k8s_version#v}"; k8s_major="${k8s_major%%.*}"
k8s_minor="${k8s_version#v*.}"; k8s_minor="${k8s_minor%%.*}"
helm_client_minor="$(modver tools/helm k8s.io/client-go)"; helm_client_minor="${helm_client_minor#v0.}"; helm_client_minor="${helm_client_minor%%.*}"

tmp="$dest/bin.tmp.$$"
rm -rf "$tmp"; mkdir -p "$tmp"
trap 'rm -rf "$tmp" "$caches"' EXIT

# -s -w: no symbol table or DWARF in the binaries, so none is generated either (-dwarf=false: 16% less CPU for
# the same binaries, measured on LeaderWorkerSet's controller)
gobuild() {  # gobuild <module dir> <extra ldflags> <go build args...>
  local dir="$1" ld="$2"; shift 2
  (cd "$here/$dir" && "$GO" build -p "$P" -trimpath -gcflags=all=-dwarf=false -ldflags="-s -w $ld" "$@")
}

# Two independent streams run concurrently: the Kubernetes module and the
# tool modules share no compiled packages (different dependency versions), and
# one `go build` alone leaves a core idle during its long serial link steps.
build_kubernetes() {
  local t=$SECONDS kver=""
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    kver+=" -X $pkg.gitMajor=$k8s_major -X $pkg.gitMinor=$k8s_minor -X $pkg.gitVersion=$k8s_version"
    kver+=" -X $pkg.gitTreeState=archive -X $pkg.buildDate=$k8s_date"
  done
  log "building kubernetes $k8s_version (kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kubelet, kube-proxy) + etcdctl $etcd_version"
  # one go build for all seven: shared compilation, parallel links
  gobuild . "$kver" -o "$tmp/" \
    k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kubectl \
    k8s.io/kubernetes/cmd/kubelet \
    k8s.io/kubernetes/cmd/kube-proxy \
    go.etcd.io/etcd/etcdctl/v3
  log "building etcd $etcd_version"
  gobuild . "" -o "$tmp/etcd" go.etcd.io/etcd/server/v3
  log "kubernetes + etcd done in $((SECONDS - t))s"
}

build_tools() {
  local t=$SECONDS
  log "building kwok/kwokctl $kwok_version"
  local kwokld="-X sigs.k8s.io/kwok/pkg/consts.Version=${kwok_version#v} -X sigs.k8s.io/kwok/pkg/consts.KubeVersion=${k8s_version#v}"
  gobuild tools/kwok "$kwokld" -o "$tmp/" sigs.k8s.io/kwok/cmd/kwok sigs.k8s.io/kwok/cmd/kwokctl
  log "kwok done in $((SECONDS - t))s; building helm $helm_version"
  local hv=helm.sh/helm/v3/internal/version
  local helmld="-X $hv.version=$helm_version -X $hv.gitTreeState=clean"
  helmld+=" -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$helm_client_minor"
  helmld+=" -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$helm_client_minor"
  gobuild tools/helm "$helmld" -o "$tmp/helm" helm.sh/helm/v3/cmd/helm
  log "helm done at +$((SECONDS - t))s; building prometheus-adapter $adapter_version"
  gobuild tools/prometheus-adapter "" -o "$tmp/prometheus-adapter" sigs.k8s.io/prometheus-adapter/cmd/adapter
  log "tools done in $((SECONDS - t))s"
}

t0=$SECONDS
if [[ "${NAIAD_E2E_SERIAL:-0}" == 1 ]]; then
  build_kubernetes
  build_tools
else
  build_kubernetes & k_pid=$!
  build_tools & t_pid=$!
  rc=0
  wait "$k_pid" || { rc=$?; log "kubernetes build failed ($rc)"; }
  wait "$t_pid" || { rc=$?; log "tools build failed ($rc)"; }
  [[ $rc == 0 ]] || exit "$rc"
fi

cat >"$tmp/../versions.env.tmp" <<EOF
KUBERNETES_VERSION=$k8s_version
ETCD_VERSION=$etcd_version
KWOK_VERSION=$kwok_version
HELM_VERSION=$helm_version
PROMETHEUS_ADAPTER_VERSION=$adapter_version
GO_VERSION=$("$GO" env GOVERSION)
EOF
rm -rf "$bin"
mv "$tmp" "$bin"
mv "$dest/versions.env.tmp" "$dest/versions.env"
touch "$dest/.complete"
log "all binaries built in $((SECONDS - t0))s: $bin"
echo "$bin"
