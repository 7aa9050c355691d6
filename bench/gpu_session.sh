#!/usr/bin/env bash
# The GPU tier and the GPU benchmarks in one run on a GPU machine (docs/gpu.md records what it printed):
#   env      the GPU, driver, Python and the libraries the run found
#   h2d      bench/host_to_device.py: copies to the device from pageable, page-locked (cudaHostRegister) and pinned memory
#   resnet   bench/gpu_torch_bench.py: ResNet-50 TorchScript on KIND_GPU against in-process, --frontend-workers 1 and N
#            (tritonclient, and perf_analyzer where TOOLS has one), with the server's share from its statistics
#   workers  bench/frontend_workers.py: small HTTP and gRPC requests to an ONNX identity executed in the engine,
#            --frontend-workers 1, 2, 4, 8
#   engine   bench/engine_socket.py: the engine process's own CPU per small request, fed over its socket by a driver
#            on another core (no worker), over 1 connection and over 8 (as 8 workers would)
#   large    the workers sweep with 4 MiB requests (HTTP binary at c8, gRPC over 8 connections) to a python identity
#            of one instance (executed in the engine; its output is its input, sent from where it arrived)
#   llm      bench/llm/transformers_bench.py: the transformers engine on a 1B-shaped llama, in-process against Naiad
#   gputier  pytest -m gpu over the GPU tests this machine's libraries can run (GPUTIER_MORE: more test files, e.g.
#            tests/test_server_settings.py tests/test_perf_analyzer.py)
#   stubs    the workers sweep with a python identity model of 4 instances (stub processes behind the engine)
# Each step has its own time limit, writes $OUT/<step>.log and prints its last lines, so one failing step costs only
# its own time. Run from the repository root:
#   bash bench/gpu_session.sh                     # every step
#   STEPS="resnet gputier" bash bench/gpu_session.sh
# Environment: OUT (default bench/.work/gpu-session), PYTHON (default python3), WHEELS (a folder of wheels to put on
# PYTHONPATH first, for a machine without a package index), TOOLS (a folder with bin/ and lib/ of wrk and h2load,
# and perf_analyzer/, likewise carried), WORKERS_N (the frontend workers of the resnet step, default 8).
set -u
OUT="${OUT:-bench/.work/gpu-session}"
PY="${PYTHON:-python3}"
STEPS="${STEPS:-env h2d resnet workers engine large llm gputier stubs}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1  # a step past its limit gets SIGABRT: every thread's stack
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/naiad-site \
    "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="/tmp/naiad-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/server:$PWD/operator${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${TOOLS:-}" ]; then
  export PATH="$TOOLS/bin:$PATH" LD_LIBRARY_PATH="$TOOLS/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  [ -x "$TOOLS/perf_analyzer/perf_analyzer" ] && export NAIAD_TOOL_PERF_ANALYZER="$TOOLS/perf_analyzer/perf_analyzer"
fi

step() {  # step NAME SECONDS COMMAND...: run it with a limit, its output in $OUT/NAME.log
  local name=$1 limit=$2 start rc
  shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  start=$(date +%s)
  timeout -s ABRT -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  rc=$?
  if [ "$rc" != 0 ]; then  # the servers' own logs (tests/helpers.py and the benches write them to /tmp/naiad-*.log)
    for f in $(ls -t /tmp/naiad-*.log 2>/dev/null | head -n 3); do
      echo "--- server log $f"
      tail -n 60 "$f"
    done >>"$OUT/$name.log"
  fi
  echo "=== $name: rc $rc in $(($(date +%s) - start)) s (limit $limit s)"
  grep -v -e '^Loading weights' -e 'Writing model shards' "$OUT/$name.log" | tail -n "${TAIL:-30}"
}

step env 15 bash -c "nvidia-smi; nproc; lscpu | grep -E \"^(Model name|Thread|Core|Socket|CPU\\(s\\))\"; free -g; $PY -c 'import sys, torch, transformers, numpy, grpc, google.protobuf as pb;
print(sys.version); print(\"torch\", torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0));
print(\"transformers\", transformers.__version__, \"numpy\", numpy.__version__, \"grpcio\", grpc.__version__, \"protobuf\", pb.__version__)';
$PY -c 'import naiad.cli, tritonclient.grpc, tritonclient.http, msgspec, orjson, httptools; print(\"naiad imports\")';
command -v wrk h2load; echo perf_analyzer=\${NAIAD_TOOL_PERF_ANALYZER:-none}"

step h2d 30 "$PY" bench/host_to_device.py

PA_ARGS=()  # perf_analyzer's rows beside tritonclient's, where there is one
[ -n "${NAIAD_TOOL_PERF_ANALYZER:-}" ] && PA_ARGS=(--perf-analyzer "$NAIAD_TOOL_PERF_ANALYZER")
step resnet "${RESNET_LIMIT:-240}" "$PY" bench/gpu_torch_bench.py --cases "${RESNET_CASES:-1:1,32:1,8:8}" --workers "1,${WORKERS_N:-8}" \
  --protocols grpc,http --duration 2.5 --json "$OUT/resnet.json" "${PA_ARGS[@]}"

step workers 55 "$PY" bench/frontend_workers.py --workers 1,2,4,8 --rounds 1 --duration 3 --warmup 1 \
  --client-threads 4 --backend onnxruntime --scenarios small_c64,grpc_small_8conn

step engine 40 bash -c "$PY bench/engine_socket.py --rounds 2 --duration 3 --connections 1 --window 64 &&
  $PY bench/engine_socket.py --rounds 2 --duration 3 --connections 8 --window 8"

step large 60 "$PY" bench/frontend_workers.py --workers 1,2,4,8 --rounds 1 --duration 3 --warmup 1 \
  --client-threads 4 --backend python --scenarios large_c8,grpc_large_8conn

step llm 90 "$PY" bench/llm/transformers_bench.py --concurrency 1,8,32 --max-tokens 64 --min-requests 3 \
  --out "$OUT/llm.jsonl"

step gputier "${GPUTIER_LIMIT:-80}" "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider --timeout 70 \
  tests/test_transformers.py tests/test_python_gpu_tensors.py tests/test_gpu.py ${GPUTIER_MORE:-}

step stubs 55 "$PY" bench/frontend_workers.py --workers 1,2,4,8 --rounds 1 --duration 3 --warmup 1 \
  --client-threads 4 --backend python --instances 4 --scenarios small_c64,grpc_small_8conn
