# Sourced by the Go scripts (tools/go/build.sh, e2e/cluster/build.sh, the CRD scripts under tools/): Go's build and module caches for one
# build only, in a directory the script removes when it ends. What is cached is the binaries; Go's own caches would
# keep what no later run reads, and they grow without bound: a cold `make test` left 9 GB in ~/.cache/go-build and
# 5 GB in ~/go/pkg/mod, and a disk that filled while the Kubernetes build ran failed CI's run of the whole tree.
# NAIAD_GO_CACHES=go uses Go's own caches instead (`go env GOCACHE GOMODCACHE`): a changed pin or build script then
# relinks from compiled packages in seconds (e2e/README.md) for the price of that disk.

# NAIAD_GO_RUN_CACHES=<dir> (what `make test` sets) shares one pair of caches among every Go build of one run,
# removed when the run ends: a cold run builds a dozen Go programs, and each compiled the standard library and the
# modules they share at the same version again in a cache of its own.

# go_private_caches <dir>: point this build's GOCACHE and GOMODCACHE into <dir>, emptied first (what an interrupted
# build left) and removed by the caller, with the module cache writable so that `rm -rf` can remove it.
go_private_caches() {
  [[ "${NAIAD_GO_CACHES:-private}" != go ]] || return 0
  if [[ -n "${NAIAD_GO_RUN_CACHES:-}" ]]; then  # (concurrent builds may share them: Go locks its caches)
    mkdir -p "$NAIAD_GO_RUN_CACHES"
    export GOCACHE="$NAIAD_GO_RUN_CACHES/build" GOMODCACHE="$NAIAD_GO_RUN_CACHES/mod"
    export GOFLAGS="${GOFLAGS:+$GOFLAGS }-modcacherw"
    return 0
  fi
  rm -rf "$1" && mkdir -p "$1"
  export GOCACHE="$1/build" GOMODCACHE="$1/mod" GOFLAGS="${GOFLAGS:+$GOFLAGS }-modcacherw"
}

# go_module_dir <module>@<version>: fetch a module through the Go module proxy (checked against the Go checksum
# database) into the module cache and print the directory of its files (the CRD scripts read manifests from it).
go_module_dir() {
  (cd /tmp && GOFLAGS="${GOFLAGS:+$GOFLAGS }-mod=mod" "$GO" mod download -json "$1" |
    sed -n 's/^[[:space:]]*"Dir": "\(.*\)",$/\1/p')
}
