#!/usr/bin/env bash
# Assemble what bench/gpu_session.sh needs on a GPU machine that has no package index (the device image has torch,
# transformers and onnxruntime, not the server's own dependencies): wheels for its Python, and wrk, h2load and
# perf_analyzer with the shared libraries that image lacks. Prints the folder; then, from the repository root:
#
#   bash bench/gpu_carry.sh                                  # → .dev (ignored by git: .git/info/exclude)
#   WHEELS=.dev/whl TOOLS=.dev bash bench/gpu_session.sh     # on the GPU machine, with .dev carried
#
# Environment: DEST (default .dev), PYVER (the GPU machine's Python, default 3.12), PYTHON (one with pip).
set -euo pipefail
DEST="${DEST:-.dev}"
PYVER="${PYVER:-3.12}"
PY="${PYTHON:-python3}"
mkdir -p "$DEST/whl" "$DEST/bin" "$DEST/lib"
if [ -d .git ] && ! grep -qx "/$DEST/" .git/info/exclude 2>/dev/null; then
  mkdir -p .git/info && echo "/$DEST/" >>.git/info/exclude
fi

# The server's runtime dependencies (pyproject.toml) and the clients the benches and GPU tests use, at the versions
# the project's venv runs; one version of each (two stop the install there). grpcio-health-checking 1.81.1: later
# ones are generated for protobuf 7, which grpcio's 6.x protobuf cannot import (docs/gpu.md). Not carried: what the
# image has (uvloop, numpy, aiohttp, prometheus-client, psutil, requests, pytest, pytest-timeout, cuda-bindings).
WHEELS=(
  tritonclient==2.73.0 grpcio==1.85.3 protobuf==6.33.6 grpcio-health-checking==1.81.1
  msgspec==0.22.0 orjson==3.13.0 httptools==0.9.0 hpack==4.2.0
  geventhttpclient==2.6.1 gevent==26.9.0 greenlet==3.3.2 zope.event==6.2 zope.interface==8.7 brotli==1.2.1
  python-rapidjson==1.25 pytest-asyncio==1.5.0 setuptools==80.10.2
  transformers==5.24.0 xgrammar==0.2.8
)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST/whl" "${WHEELS[@]}" >&2

# wrk and h2load from this machine, with the libraries the device image does not have (libc, libstdc++, OpenSSL
# and zlib are there, and carrying them would shadow the image's own for every process of the session).
for tool in wrk h2load; do
  cp -L "$(command -v "$tool")" "$DEST/bin/"
  ldd "$(command -v "$tool")" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so* | libm.so* | libpthread.so* | libdl.so* | libstdc++.so* | libgcc_s.so* | libssl.so* | libcrypto.so* | libz.so*) ;;
      *) cp -L "$lib" "$DEST/lib/" ;;
    esac
  done
done

# perf_analyzer (tools/perf_analyzer/setup.sh's cache: the binary, its libcudart.so.12), and its libb64.
pa="$(PYTHON="$PY" bash tools/perf_analyzer/setup.sh | tail -n 1)"
rm -rf "$DEST/perf_analyzer" && cp -rL "$(dirname "$pa")" "$DEST/perf_analyzer" && rm -f "$DEST/perf_analyzer/.complete"
strip "$DEST/perf_analyzer/bin/perf_analyzer"  # 18 → 13 MB: what travels to the machine is 64 MiB in all
cp -L "$(ldconfig -p | awk '/libb64\.so\.0d/ {print $NF; exit}')" "$DEST/perf_analyzer/lib/"
du -sh "$DEST" >&2
echo "$DEST"
