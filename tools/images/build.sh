#!/usr/bin/env bash
# Build Naiad's OCI images from Dockerfile.server and Dockerfile.operator without a Docker engine: buildah with
# chroot isolation and vfs storage, so it runs on a plain machine and in CI.
#
#   tools/images/build.sh                 # server (CPU) and operator
#   VARIANT=cuda tools/images/build.sh    # server (CUDA, from PyPI's nvidia-* wheels) and operator
#
# Where the Dockerfiles' FROM image can be pulled it is used unchanged. Where no registry can be reached (this
# workplace), the base is built from Debian packages (mmdebstrap -> umoci -> OCI archive, bookworm's Python 3.11,
# the same minor version as the Dockerfiles' python:3.11 base) and passed in as PYTHON_IMAGE.
#
# Results: docker-archive tarballs that `docker load`, `kind load image-archive` and `ctr import` accept, in
# $NAIAD_IMAGES_OUT (default build/images), with their image IDs and sizes printed. buildah's layer cache lives in
# $NAIAD_IMAGES_CACHE (default ~/.cache/naiad-images): the dependency layers are rebuilt only when pyproject.toml or
# a Dockerfile changes, the code layer when the code changes.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
variant="${VARIANT:-cpu}"
out="${NAIAD_IMAGES_OUT:-$repo/build/images}"
cache="${NAIAD_IMAGES_CACHE:-$HOME/.cache/naiad-images}"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml" | head -1)"
suite=bookworm
log() { echo "[images $(date +%H:%M:%S)] $*" >&2; }

need=()
for tool in buildah mmdebstrap umoci skopeo bwrap; do command -v "$tool" >/dev/null || need+=("$tool"); done
if ((${#need[@]})); then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    log "installing ${need[*]} from Debian"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      buildah mmdebstrap umoci skopeo bubblewrap >/dev/null
  else
    echo "images: missing ${need[*]}; install Debian's buildah mmdebstrap umoci skopeo bubblewrap" >&2
    exit 3
  fi
fi

mkdir -p "$cache" "$out"
exec 9>"$cache/.lock"
flock 9
# buildah's layer cache does not see a changed ARG default or --build-arg value (seen: EXTRAS=onnx,s3 reused the
# layers of an EXTRAS=onnx build), so each set of Dockerfiles and arguments gets a storage of its own, and the
# storages of other sets are removed.
storage_key="$( { cat "$repo/Dockerfile.server" "$repo/Dockerfile.operator"; echo "$variant"; } | sha256sum | cut -c1-16)"
storage="$cache/storage-$variant-$storage_key"
for old in "$cache"/storage "$cache"/storage-"$variant"-*; do
  [[ -e "$old" && "$old" != "$storage" ]] || continue
  log "removing $old (other Dockerfiles or arguments)"
  buildah --root "$old" --runroot "$cache/run" --storage-driver vfs rmi --all --force >/dev/null 2>&1 || true
  rm -rf "$old"
done
bh() { buildah --root "$storage" --runroot "$cache/run" --storage-driver vfs "$@"; }

# ---- the base image -------------------------------------------------------------------------------------
official="$(sed -n 's/^ARG PYTHON_IMAGE=//p' "$repo/Dockerfile.server")"
if [[ "${NAIAD_IMAGES_OFFLINE_BASE:-auto}" != 1 ]] && timeout 20 bh pull --quiet "docker://$official" >/dev/null 2>&1; then
  base="$official"
  log "base: $official (pulled)"
else
  packages=python3,python3-venv,ca-certificates,passwd
  recipe=1  # bump when the mmdebstrap/umoci steps below change
  key="$(printf '%s\n' "$suite" "$packages" "$recipe" | sha256sum | cut -c1-16)"
  base="localhost/naiad-python-base:$suite-$key"
  if ! bh inspect --type image "$base" >/dev/null 2>&1; then
    archive="$cache/base-$suite-$key.oci.tar"
    if [[ ! -f "$archive" ]]; then
      log "base: $official cannot be pulled; building a Debian $suite base with $packages"
      tmp="$(mktemp -d)"
      trap 'rm -rf "$tmp"' EXIT
      # Documentation, man pages and locales are not needed in a server image.
      mmdebstrap --variant=minbase --include="$packages" \
        --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' --dpkgopt='path-exclude=/usr/share/locale/*' \
        --aptopt='Acquire::Retries "3"' "$suite" "$tmp/rootfs.tar" >"$tmp/mmdebstrap.log" 2>&1 \
        || { tail -20 "$tmp/mmdebstrap.log" >&2; exit 1; }
      umoci init --layout "$tmp/oci"
      umoci new --image "$tmp/oci:base"
      umoci raw add-layer --image "$tmp/oci:base" "$tmp/rootfs.tar"
      umoci config --image "$tmp/oci:base" --config.cmd=python3 --config.env=LANG=C.UTF-8 \
        --config.env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
      tar -C "$tmp/oci" -cf "$archive.part" .
      mv "$archive.part" "$archive"
    fi
    id="$(bh pull --quiet "oci-archive:$archive")"
    bh tag "$id" "$base"
  fi
  log "base: $base"
fi
bh rm --all >/dev/null 2>&1 || true

# ---- the images -------------------------------------------------------------------------------------------
# Behind a TLS-intercepting proxy the host trusts an extra CA: lend the host's bundle to pip for the build's
# RUN steps only (bind mounts, never a layer), so the images trust exactly what their base trusts.
lend=()
cert="${PIP_CERT:-${REQUESTS_CA_BUNDLE:-}}"
if [[ -n "$cert" && -f "$cert" ]]; then
  printf '[global]\ncert = /etc/naiad-build-ca.crt\n' >"$cache/pip.conf"
  lend=(--volume "$cert:/etc/naiad-build-ca.crt:ro" --volume "$cache/pip.conf:/etc/pip.conf:ro")
fi
build() {  # <dockerfile> <tag> [build args...]
  local file="$1" tag="$2"; shift 2
  log "building $tag from $file"
  bh build --quiet --isolation chroot --pull=never --layers --network host "${lend[@]}" \
    --build-arg "PYTHON_IMAGE=$base" "$@" -f "$repo/$file" -t "$tag" "$repo" >&2
}
# Named as the chart's values name them, so a loaded archive is found by `helm install` as it is.
registry="${NAIAD_IMAGE_REGISTRY:-ghcr.io/naiad-dev}"
server_tag="$registry/naiad-server:$version$([[ $variant == cuda ]] && echo -cuda || true)"
operator_tag="$registry/naiad-operator:$version"
build Dockerfile.server "$server_tag" --build-arg "VARIANT=$variant"
build Dockerfile.operator "$operator_tag"

for tag in "$server_tag" "$operator_tag"; do
  name="$(basename "${tag%%:*}")$([[ $tag == *-cuda ]] && echo -cuda || true)"
  file="$out/$name.tar"
  rm -f "$file"
  bh push --quiet "$tag" "docker-archive:$file:$tag" >/dev/null
  id="$(bh inspect --type image --format '{{.FromImageID}}' "$tag")"
  size="$(du -m "$file" | cut -f1)"
  printf '%s\t%s\tsha256:%s\t%s MiB\n' "$file" "$tag" "$id" "$size" | tee "$out/$name.digest"
done

# vfs keeps a full copy of the root file system per layer: drop the layers no tagged image uses (a later build
# of changed code reinstalls its dependencies instead of reusing them; disk stays bounded, ~3.5 GiB here).
bh rmi --prune >/dev/null 2>&1 || true
