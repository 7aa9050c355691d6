#!/usr/bin/env bash
# Build llama-cpp-python (pinned below) once from its PyPI sdist, and llama.cpp's own C++ servers (`llama-server`,
# `rpc-server`) from the llama.cpp source vendored in that same sdist, into a cache outside the repository:
#
#   ${NAIAD_TOOLS_CACHE:-$HOME/.cache/naiad-tools}/llama-cpp-python-<hash>/{wheels/*.whl, bin/llama-server, bin/rpc-server}
#
# llama-cpp-python has no binary wheel on PyPI: its sdist compiles llama.cpp, so the wheel is built once and kept
# (0.3.36 with the multimodal library: 34 minutes on 2 cores shared with other builds, at a load of 15-19; 0.3.16
# without it took about 9 on quiet ones). The hash covers the pin, the CMake flags and the compiler (not this script's
# comments): an unchanged pin is a no-op. The CPU code is built for x86-64-v3 (AVX2/FMA/F16C, GGML_NATIVE off) so
# the cached wheel runs on any CI machine of this kind, not only on the one that built it; GGML_RPC is on for
# llama.cpp's RPC backend. The wheel carries llama.cpp's multimodal library too (LLAVA_BUILD: libmtmd.so, CLIP and
# the vision/audio encoders, bound as `llama_cpp.mtmd_cpp`; its CLIs are not built): what a chat with images needs.
# LLAMA_OPENSSL is off: nothing here downloads models, and the wheel links no libssl (as LLAMA_CURL=OFF kept it
# from libcurl before llama.cpp dropped curl).
#
#   build.sh [install]   the wheel, installed into the virtualenv (PYTHON, default .venv/bin/python) unless that
#                        version is there already (what `make llm-deps` runs for the tests and `make serve`)
#   build.sh rpc         also rpc-server (the RPC tests, the LeaderWorkerSet workers, the LLM image; llama.cpp's
#                        `ggml-rpc-server`, kept under its old name): ggml and the RPC tool only (5 minutes on
#                        those shared cores)
#   build.sh servers     also llama-server (the LLM benchmarks' reference): all of llama.cpp again (28 minutes there)
#
# The cache directory is printed as the last line of stdout; progress goes to stderr.
# Environment: PYTHON, NAIAD_TOOLS_CACHE (cache root), NAIAD_TOOLS_FORCE=1 (rebuild), LLAMA_BUILD_JOBS (make -j).
set -euo pipefail

version=0.3.36
mode="${1:-install}"
[[ "$mode" == install || "$mode" == rpc || "$mode" == servers ]] || { echo "usage: build.sh [install|rpc|servers]" >&2; exit 2; }
PYTHON="${PYTHON:-.venv/bin/python}"
jobs="${LLAMA_BUILD_JOBS:-$(nproc)}"

cpu_flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
cmake_args="$cpu_flags -DGGML_RPC=ON -DGGML_OPENMP=ON -DLLAMA_OPENSSL=OFF"
wheel_args="$cmake_args -DLLAVA_BUILD=ON"

command -v cmake >/dev/null || { echo "build.sh: cmake is missing (apt-get install cmake)" >&2; exit 3; }
hash="$( { echo "$version $wheel_args"; c++ --version | head -1; cmake --version | head -1; } | sha256sum | cut -c1-16)"
root="${NAIAD_TOOLS_CACHE:-$HOME/.cache/naiad-tools}"
dest="$root/llama-cpp-python-$hash"

have_wheel() { [[ "${NAIAD_TOOLS_FORCE:-0}" != 1 && -f "$dest/.wheel-complete" ]]; }
have_servers() { [[ "${NAIAD_TOOLS_FORCE:-0}" != 1 && -f "$dest/.servers-complete" ]]; }
have_rpc() { have_servers || [[ "${NAIAD_TOOLS_FORCE:-0}" != 1 && -f "$dest/.rpc-complete" ]]; }
done_already() {
  have_wheel || return 1
  case "$mode" in servers) have_servers ;; rpc) have_rpc ;; *) true ;; esac
}

install_wheel() {
  [[ "$mode" == install ]] || return 0
  have="$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("llama_cpp_python"))' 2>/dev/null || true)"
  if [[ "$have" != "$version" ]]; then
    echo "[tools/llama_cpp] installing $(basename "$dest"/wheels/*.whl)" >&2
    flock /tmp/naiad-venv.lock "$PYTHON" -m pip install -q --no-deps "$dest"/wheels/*.whl >&2
  fi
  # its runtime deps are pure Python (numpy, jinja2, typing-extensions are the server's own; diskcache is not)
  "$PYTHON" -c 'import diskcache' 2>/dev/null || flock /tmp/naiad-venv.lock "$PYTHON" -m pip install -q 'diskcache>=5.6' >&2
}

if done_already; then install_wheel; echo "$dest"; exit 0; fi
mkdir -p "$root"
exec 9>"$root/.llama-cpp-python-$hash.lock"
flock 9
if done_already; then install_wheel; echo "$dest"; exit 0; fi

start=$(date +%s)
mkdir -p "$dest"
work="$(mktemp -d "$root/.llama-build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
if [[ ! -f "$dest/sdist/llama_cpp_python-$version.tar.gz" ]]; then
  echo "[tools/llama_cpp] fetching the llama-cpp-python $version sdist" >&2
  "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-python -d "$work/sdist" "llama-cpp-python==$version" >&2
  mkdir -p "$dest/sdist" && mv "$work"/sdist/llama_cpp_python-*.tar.gz "$dest/sdist/"
fi
sdist="$dest/sdist/llama_cpp_python-$version.tar.gz"

if ! have_wheel; then
  echo "[tools/llama_cpp] building the wheel (CMAKE_ARGS=$wheel_args, -j$jobs)" >&2
  CMAKE_ARGS="$wheel_args" CMAKE_BUILD_PARALLEL_LEVEL="$jobs" \
    "$PYTHON" -m pip wheel -q --no-deps -w "$work/wheels" "$sdist" >&2
  rm -rf "$dest/wheels" && mv "$work/wheels" "$dest/wheels"
  touch "$dest/.wheel-complete"
fi

if { [[ "$mode" == servers ]] && ! have_servers; } || { [[ "$mode" == rpc ]] && ! have_rpc; }; then
  # llama.cpp's target names, and the names the binaries keep here (its RPC server became ggml-rpc-server)
  targets=(ggml-rpc-server) names=(rpc-server)
  [[ "$mode" == servers ]] && targets+=(llama-server) names+=(llama-server)
  echo "[tools/llama_cpp] building ${targets[*]} from the vendored llama.cpp" >&2
  tar -xzf "$sdist" -C "$work"
  src="$(ls -d "$work"/llama_cpp_python-*/vendor/llama.cpp)"
  # llama-server without its web UI: the prebuilt one is a download from Hugging Face, the other an npm build
  # shellcheck disable=SC2086
  cmake -S "$src" -B "$work/cbuild" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF $cmake_args >&2
  cmake --build "$work/cbuild" -j "$jobs" --target "${targets[@]}" >&2
  mkdir -p "$dest/bin"
  for i in "${!targets[@]}"; do cp "$work/cbuild/bin/${targets[$i]}" "$dest/bin/${names[$i]}"; done
  touch "$dest/.rpc-complete"
  [[ "$mode" == servers ]] && touch "$dest/.servers-complete"
fi
echo "[tools/llama_cpp] done in $(( $(date +%s) - start ))s: $dest" >&2
install_wheel
echo "$dest"
