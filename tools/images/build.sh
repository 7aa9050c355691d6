#!/usr/bin/env bash
# Build Naiad's OCI images from Dockerfile.server and Dockerfile.operator without a Docker engine: buildah with
# chroot isolation, so it runs on a plain machine and in CI.
#
#   tools/images/build.sh                 # server (CPU) and operator
#   VARIANT=cuda tools/images/build.sh    # server (CUDA, from PyPI's nvidia-* wheels) and operator
#   VARIANT=cuda IMAGE_EXTRAS=gpu-wheels,torch,s3 tools/images/build.sh   # the server's backends (Dockerfile's EXTRAS)
#   VARIANT=llm tools/images/build.sh     # server (CPU) and server-llm: the CPU image plus llama.cpp (Dockerfile.llm)
#
# VARIANT=llm builds the CPU server image exactly as the default build does (same storage, same layer cache), then
# Dockerfile.llm on top of it from a generated context (build/images/llm-context) holding the llama-cpp-python wheel
# and llama.cpp's rpc-server that tools/llama_cpp/build.sh compiled once and cached. Only the
# naiad-server-llm archive is written (`make images` writes the others).
#
# Storage: the kernel's overlay where this process can mount it (root on a machine or VM), else vfs (works in any
# container, but keeps a full copy of the root file system per layer and per working container: the CPU images
# held ~4 GiB after the build and more during it, the CUDA image would need ~30 GB at the peak);
# NAIAD_IMAGES_DRIVER=vfs|overlay chooses.
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
llm=0
if [[ $variant == llm ]]; then llm=1; variant=cpu; fi  # the LLM image is layers on top of the CPU one
extras="${IMAGE_EXTRAS:-}"  # empty: the Dockerfile's default for the variant
out="${NAIAD_IMAGES_OUT:-$repo/build/images}"
cache="${NAIAD_IMAGES_CACHE:-$HOME/.cache/naiad-images}"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' "$repo/pyproject.toml" | head -1)"
suite=bookworm
log() { echo "[images $(date +%H:%M:%S)] $*" >&2; }

missing() {
  need=()
  for tool in buildah mmdebstrap umoci skopeo bwrap; do command -v "$tool" >/dev/null || need+=("$tool"); done
}
missing
if ((${#need[@]})); then
  if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
    # `make test` builds `images` and `images-llm` side by side: on a fresh machine both would run apt-get at once
    # and the second fail on apt's lock. One installs; the other waits here, then finds the tools.
    exec 9>/var/lock/naiad-images-tools.lock
    flock 9
    missing
    if ((${#need[@]})); then
      log "installing ${need[*]} from Debian"
      apt-get -o DPkg::Lock::Timeout=600 update -qq >/dev/null
      DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends \
        buildah mmdebstrap umoci skopeo bubblewrap >/dev/null
    fi
    flock -u 9
    exec 9>&-
  else
    echo "images: missing ${need[*]}; install Debian's buildah mmdebstrap umoci skopeo bubblewrap" >&2
    exit 3
  fi
fi

mkdir -p "$cache" "$out"
if ((llm)); then
  # llama-cpp-python's wheel and llama.cpp's rpc-server, compiled once (10-20 min cold) and cached outside the repository
  log "llama.cpp: tools/llama_cpp/build.sh rpc (cached after the first build)"
  llama="$(cd "$repo" && PYTHON="${PYTHON:-$repo/.venv/bin/python}" bash tools/llama_cpp/build.sh rpc | tail -1)"
  context="$out/llm-context"
  rm -rf "$context" && mkdir -p "$context/wheels" "$context/bin"
  cp "$repo/pyproject.toml" "$context/"
  cp "$llama"/wheels/llama_cpp_python-*.whl "$context/wheels/"
  cp "$llama/bin/rpc-server" "$context/bin/"
fi
# One build per variant at a time; the CPU and CUDA builds (separate storages and run directories) do not wait for
# each other: a CUDA build takes long.
suffix="$([[ $variant == cpu ]] || echo "-$variant")"
runroot="$cache/run$suffix"
exec 9>"$cache/.lock$suffix"
flock 9
overlay_works() {  # can this process mount the kernel's overlay file system (root, not inside a plain container)?
  local t rc=1
  t="$(mktemp -d)"
  mkdir -p "$t"/{l,u,w,m}
  if mount -t overlay overlay -o "lowerdir=$t/l,upperdir=$t/u,workdir=$t/w" "$t/m" 2>/dev/null; then
    umount "$t/m" && rc=0
  fi
  rm -rf "$t"
  return $rc
}
driver="${NAIAD_IMAGES_DRIVER:-}"
if [[ -z "$driver" ]]; then
  driver=vfs
  if overlay_works; then driver=overlay
  else log "overlay cannot be mounted here: vfs (a full copy of the root per layer; ~30 GB free needed for CUDA)"; fi
fi
# buildah's layer cache does not see a changed ARG default or --build-arg value (seen: EXTRAS=onnx,s3 reused the
# layers of an EXTRAS=onnx build), so each set of Dockerfiles and arguments gets a storage of its own, and the
# storages of other sets are removed. (A default build keeps the key it always had, so caches stay valid.)
storage_key="$( { cat "$repo/Dockerfile.server" "$repo/Dockerfile.operator"; echo "$variant"
  [[ -z "$extras" ]] || echo "EXTRAS=$extras"; [[ $driver == vfs ]] || echo "driver=$driver"; } | sha256sum | cut -c1-16)"
storage="$cache/storage-$variant-$storage_key"
for old in "$cache"/storage "$cache"/storage-"$variant"-*; do
  [[ -e "$old" && "$old" != "$storage" ]] || continue
  log "removing $old (other Dockerfiles or arguments)"
  old_driver="$(cat "$old/.naiad-driver" 2>/dev/null || echo vfs)"
  for what in rm rmi; do  # working containers first (an interrupted build leaves them mounted)
    buildah --root "$old" --runroot "$runroot" --storage-driver "$old_driver" "$what" --all \
      $([[ $what == rmi ]] && echo --force) >/dev/null 2>&1 || true
  done
  umount "$old/$old_driver" 2>/dev/null || true  # containers/storage's private bind mount of its layer directory
  rm -rf "$old"
done
mkdir -p "$storage"
echo "$driver" >"$storage/.naiad-driver"
bh() { buildah --root "$storage" --runroot "$runroot" --storage-driver "$driver" "$@"; }

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
# buildah keeps every step's working container until the build ends and stages a committed layer's tarball in
# /var/tmp, so a step that installs N GB holds ~3N GB: the CUDA image's dependency layer is several GB, so it is built
# without a layer cache (one working container per stage, one commit), the CPU images with one.
layers="${NAIAD_IMAGES_LAYERS:-$([[ $variant == cuda ]] && echo false || echo true)}"
build() {  # <dockerfile> <tag> [build args...]
  local file="$1" tag="$2"; shift 2
  log "building $tag from $file"
  bh build --quiet --isolation chroot --pull=never --layers="$layers" --network host "${lend[@]}" \
    --build-arg "PYTHON_IMAGE=$base" "$@" -f "$repo/$file" -t "$tag" "${build_context:-$repo}" >&2
}
# Named as the chart's values name them, so a loaded archive is found by `helm install` as it is.
registry="${NAIAD_IMAGE_REGISTRY:-ghcr.io/naiad-dev}"
server_tag="$registry/naiad-server:$version$([[ $variant == cuda ]] && echo -cuda || true)"
operator_tag="$registry/naiad-operator:$version"
server_args=(--build-arg "VARIANT=$variant")
[[ -z "$extras" ]] || server_args+=(--build-arg "EXTRAS=$extras")
# The dependency stages tagged first (from the layer cache when pyproject.toml and the Dockerfiles are as before): the
# prune below then keeps their layers, so a code change rebuilds only the code's layers (each build stage's layers
# were pruned before, and every build installed the dependencies again: ~3 min a server image on 2 busy cores).
if [[ $layers == true ]]; then
  build Dockerfile.server "localhost/naiad-server-deps:$variant" --target deps "${server_args[@]}"
  ((llm)) || build Dockerfile.operator "localhost/naiad-operator-deps:$version" --target deps
fi
build Dockerfile.server "$server_tag" "${server_args[@]}"
tags=("$server_tag" "$operator_tag")
if ((llm)); then
  tags=("$server_tag-llm")
  llm_args=(--build-arg "SERVER_IMAGE=$server_tag")
  [[ -z "${LLM_EXTRAS:-}" ]] || llm_args+=(--build-arg "LLM_EXTRAS=$LLM_EXTRAS")
  build_context="$context" build Dockerfile.llm "$server_tag-llm" "${llm_args[@]}"
else
  build Dockerfile.operator "$operator_tag"
fi

# The CUDA image cannot be run without a GPU here; check that its backends import and see CUDA.
if [[ $variant == cuda ]]; then
  log "checking the CUDA image's backends (imports only: no GPU needed)"
  ctr="$(bh from --pull=never "$server_tag")"
  bh run --isolation chroot "$ctr" -- /opt/naiad/bin/python -c '
import importlib.util
import onnxruntime
providers = onnxruntime.get_available_providers()
print("onnxruntime", onnxruntime.__version__, providers)
assert "CUDAExecutionProvider" in providers, providers
if importlib.util.find_spec("torch"):
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version())
    assert torch.version.cuda, "a CPU-only torch"
' >&2
  bh rm "$ctr" >/dev/null
fi
# Drop the layers no tagged image uses before writing the archives (vfs keeps a full copy of the root file system
# per layer; for CUDA this is the build stage's copy of the environment): a later build of changed code reinstalls
# its dependencies instead of reusing them; disk stays bounded (~3.5 GiB here for CPU).
bh rmi --prune >/dev/null 2>&1 || true

for tag in "${tags[@]}"; do
  name="$(basename "${tag%%:*}")${tag#*:"$version"}"  # naiad-server, naiad-server-cuda, naiad-server-llm
  file="$out/$name.tar"
  rm -f "$file"
  bh push --quiet "$tag" "docker-archive:$file:$tag" >/dev/null
  id="$(bh inspect --type image --format '{{.FromImageID}}' "$tag")"
  size="$(du -m "$file" | cut -f1)"
  printf '%s\t%s\tsha256:%s\t%s MiB\n' "$file" "$tag" "$id" "$size" | tee "$out/$name.digest"
done

