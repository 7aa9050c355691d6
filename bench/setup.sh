#!/usr/bin/env bash
# Install everything `make bench` needs. Idempotent: re-running is cheap.
#   - wrk (HTTP load) and h2load (nghttp2-client, gRPC load) via apt-get, if missing
#   - the real Triton 2.51 (nvidia-pytriton wheel) via tools/triton/setup.sh -> .venv-triton
#   - Triton's perf_analyzer (tritonclient 2.41.1 wheel) via tools/perf_analyzer/setup.sh -> ~/.cache/naiad-tools
#   - MLServer in its own venv bench/.venv-mlserver (plus onnxruntime for the MLP runtime)
#   - py-spy in bench/.venv-pyspy (profiling only; skipped with BENCH_NO_PYSPY=1)
#   - the benchmark model repository bench/models/repo (ONNX MLP exported by models/export_mlp.py)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
PY="${BENCH_PYTHON:-python3.11}"
MLSERVER_VERSION="${MLSERVER_VERSION:-1.7.1}"

need_apt=()
command -v wrk >/dev/null 2>&1 || need_apt+=(wrk)
command -v h2load >/dev/null 2>&1 || need_apt+=(nghttp2-client)
command -v taskset >/dev/null 2>&1 || need_apt+=(util-linux)
if [ "${#need_apt[@]}" -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "bench/setup.sh: apt-get install ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

# Naiad's own venv (the project's `make venv`) must exist; the bench never modifies it.
[ -x "$REPO/.venv/bin/naiad" ] || { echo "bench/setup.sh: $REPO/.venv missing; run 'make venv'" >&2; exit 1; }

# Real Triton (python backend only, CPU).
bash "$REPO/tools/triton/setup.sh"

# perf_analyzer, for the pa_grpc scenario.
PYTHON="$REPO/.venv/bin/python" bash "$REPO/tools/perf_analyzer/setup.sh" >/dev/null

# MLServer in its own venv.
MLV="$HERE/.venv-mlserver"
if ! "$MLV/bin/python" -c "import mlserver, onnxruntime, numpy; assert mlserver.__version__ == '$MLSERVER_VERSION'" >/dev/null 2>&1; then
  [ -x "$MLV/bin/python" ] || "$PY" -m venv "$MLV"
  "$MLV/bin/python" -m pip install -q --upgrade pip
  "$MLV/bin/python" -m pip install -q "mlserver==$MLSERVER_VERSION" onnxruntime numpy
fi
echo "bench/setup.sh: ok: mlserver $("$MLV/bin/python" -c 'import mlserver; print(mlserver.__version__)') in $MLV"

# py-spy for profiling (optional).
if [ "${BENCH_NO_PYSPY:-0}" != "1" ] && [ ! -x "$HERE/.venv-pyspy/bin/py-spy" ]; then
  "$PY" -m venv "$HERE/.venv-pyspy"
  "$HERE/.venv-pyspy/bin/python" -m pip install -q py-spy || echo "bench/setup.sh: py-spy install failed (profiling disabled)" >&2
fi

# Model repository (python identity models are copied, the MLP is exported to ONNX).
"$REPO/.venv/bin/python" "$HERE/models/export_mlp.py"
echo "bench/setup.sh: ok"
