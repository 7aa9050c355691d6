"""A/B of `naiad serve --frontend-workers N` on one tree: requests/s and server CPU-seconds per request of
HTTP binary identity requests (16 values at c8 and c64, 4 MiB at c8) and gRPC ones over 2 long connections
(h2load, 32 streams each), the settings alternated round by round.

    .venv/bin/python bench/frontend_workers.py --workers 1,2 --rounds 3 --duration 8
    .venv/bin/python bench/frontend_workers.py --workers "2 --frontend-accept reuseport,2 --frontend-accept balanced"
    .venv/bin/python bench/frontend_workers.py --workers "echo 1,echo 2,1,2" --scenarios large_c8
    .venv/bin/python bench/frontend_workers.py --workers 1 --trees .,/tmp/base --cpu-limit 0.5   # a pod's limit

`--trees` runs the server's code of each tree (a git worktree of the previous main, say) under the same load,
alternated with the settings; `--cpu-limit` runs the server in a cgroup with that CFS quota (bench/cpu_limit.py),
as a pod's CPU limit does, and reports the periods in which the quota ran out.

A setting "echo N" runs bench/echo_server.py instead, N processes that answer each request with its own body:
the requests/s the machine allows this load and the CPU floor under a server's (HTTP scenarios only).

The server is not pinned (N workers need N cores); wrk runs beside it. The machine may be shared: the server
and wrk run at nice -20 in scheduling groups of nice -20 (as bench/run.py does), each round runs every setting
once, and a figure is the median over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import requests
from cpu_limit import CpuLimit

ROOT = Path(__file__).resolve().parent.parent
LUA = ROOT / "bench" / "lua" / "infer_binary.lua"
ECHO = ROOT / "bench" / "echo_server.py"  # the machine's ceiling: `--workers "echo 1,echo 2,..."`
MODEL_PY = ROOT / "bench" / "models" / "repo" / "identity_16" / "1" / "model.py"
NICE = ["nice", "-n", "-20"] if os.geteuid() == 0 else []
SCENARIOS = {"small_c64": (16, 64), "large_c8": (1024 * 1024, 8)}  # FP32 values, connections
MORE_SCENARIOS = {"small_c8": (16, 8)}  # chosen with --scenarios
GRPC_SCENARIOS = {
    "grpc_small_2conn": (16, 2, 32),
    "grpc_small_8conn": (16, 8, 32),
    "grpc_large_8conn": (1024 * 1024, 8, 1),
}  # FP32 values, connections, streams per connection (h2load)
GRPC_PATH = "/inference.GRPCInferenceService/ModelInfer"

CONFIG = """name: "identity_var"
backend: "BACKEND"
max_batch_size: 0
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ -1 ] } ]
instance_group [ { count: INSTANCES kind: KIND_CPU } ]
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_repo(root: Path, instances: int = 1, backend: str = "python") -> Path:
    """The identity model: a python model (its instances are stub processes the engine talks to), or an ONNX
    Identity graph run by ONNX Runtime inside the engine process (`--backend onnxruntime`)."""
    (root / "identity_var" / "1").mkdir(parents=True)
    if backend == "python":
        shutil.copy(MODEL_PY, root / "identity_var" / "1" / "model.py")
    else:
        import onnx
        from onnx import TensorProto, helper

        x = helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, [-1])
        y = helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, [-1])
        graph = helper.make_graph(
            [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])], "identity", [x], [y]
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
        model.ir_version = 8
        onnx.save(model, str(root / "identity_var" / "1" / "model.onnx"))
    config = CONFIG.replace("INSTANCES", str(instances)).replace("BACKEND", backend)
    if backend == "onnxruntime":  # one intra-op thread: a pool of spinning threads would measure ONNX Runtime
        config += 'parameters { key: "intra_op_thread_count" value: { string_value: "1" } }\n'
    (root / "identity_var" / "config.pbtxt").write_text(config)
    return root


def body_file(values: int, tmp: Path) -> tuple[Path, int]:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [values],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": values * 4},
                }
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    path = tmp / f"body_{values}.bin"
    path.write_bytes(header + np.random.default_rng(1).random(values, dtype=np.float32).tobytes())
    return path, len(header)


def boost(pid: int) -> None:
    """The session's scheduling group (CONFIG_SCHED_AUTOGROUP) at nice -20: a nice value only counts inside it."""
    if NICE:
        try:
            Path(f"/proc/{pid}/autogroup").write_text("-20")
        except OSError:
            pass


class Server:
    def __init__(self, repo: Path, setting: str, log: Path, tree: Path = ROOT, limit: CpuLimit | None = None):
        workers, *extra = setting.split()
        self.port = free_port()
        self.grpc_port = free_port()
        if workers == "echo":
            cmd = [
                *NICE,
                sys.executable,
                str(ECHO),
                "--port",
                str(self.port),
                "--processes",
                *(extra or ["1"]),
            ]
        else:
            cmd = self._naiad(repo, workers, extra)
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(tree / "server"), os.environ.get("PYTHONPATH", "")])
        )
        if limit is not None:
            cmd = limit.wrap(cmd)
        self.proc = subprocess.Popen(
            cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        boost(self.proc.pid)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if requests.get(f"http://127.0.0.1:{self.port}/v2/health/ready", timeout=1).ok:
                    return
            except requests.RequestException:
                time.sleep(0.2)
        raise RuntimeError(f"server did not start; see {log}")

    def _naiad(self, repo: Path, workers: str, extra: list[str]) -> list[str]:
        return [
            *NICE,
            sys.executable,
            "-m",
            "naiad.cli",
            "serve",
            "--model-repository",
            str(repo),
            "--http-address",
            "127.0.0.1",
            "--http-port",
            str(self.port),
            "--grpc-port",
            str(self.grpc_port),
            "--allow-metrics",
            "false",
            "--frontend-workers",
            workers,
            *extra,
        ]

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU-seconds of the server's processes: all of them, and the first (the engine, with frontend workers)."""
        root = psutil.Process(self.proc.pid)
        total = engine = 0.0
        for p in [root, *root.children(recursive=True)]:
            try:
                t = p.cpu_times()
                total += t.user + t.system
                if p is root:
                    engine = t.user + t.system
            except psutil.Error:
                pass
        return total, engine

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def wrk(port: int, body: Path, header_len: int, conns: int, seconds: float, client_threads: int = 2) -> dict:
    env = dict(os.environ, BENCH_BODY=str(body), BENCH_HEADER_LEN=str(header_len))
    threads = min(client_threads, conns) if conns >= 8 else 1
    cmd = [*NICE, "wrk", f"-t{threads}", f"-c{conns}", f"-d{max(1, round(seconds))}s", "-s", str(LUA),
           f"http://127.0.0.1:{port}/v2/models/identity_var/infer"]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    boost(p.pid)
    out, _ = p.communicate(timeout=seconds + 60)
    if p.returncode:
        raise RuntimeError(f"wrk exited with {p.returncode}")
    line = next(ln for ln in out.splitlines() if ln.startswith("BENCH_RESULT "))
    return json.loads(line[len("BENCH_RESULT ") :])


def grpc_body(values: int, tmp: Path) -> Path:
    """One length-prefixed ModelInferRequest (uncompressed) for h2load to send as every request's body."""
    from tritonclient.grpc import service_pb2 as pb

    req = pb.ModelInferRequest(model_name="identity_var")
    tensor = req.inputs.add(name="INPUT0", datatype="FP32")
    tensor.shape.append(values)
    req.raw_input_contents.append(np.arange(values, dtype=np.float32).tobytes())
    payload = req.SerializeToString()
    path = tmp / f"grpc_{values}.bin"
    path.write_bytes(b"\0" + len(payload).to_bytes(4, "big") + payload)
    return path


def h2load(port: int, body: Path, conns: int, streams: int, seconds: float, client_threads: int = 2) -> dict:
    """gRPC unary calls over `conns` long-lived h2c connections; {"requests", "duration_us", "err_*"}."""
    cmd = [*NICE, "h2load", f"-t{min(client_threads, conns)}", f"-c{conns}", f"-m{streams}", f"-D{max(1, round(seconds))}", "-d", str(body),
           "-H", "content-type: application/grpc", "-H", "te: trailers",
           f"http://127.0.0.1:{port}{GRPC_PATH}"]  # fmt: skip
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    boost(p.pid)
    out, _ = p.communicate(timeout=seconds + 60)
    if p.returncode:
        raise RuntimeError(f"h2load exited with {p.returncode}:\n{out}")
    done = ok = 0
    for line in out.splitlines():
        words = line.split()
        if line.startswith("requests:"):  # requests: N total, N started, N done, N succeeded, N failed, ...
            done = int(words[5])
        elif line.startswith("status codes:"):
            ok = int(words[2])
    return {"requests": ok, "duration_us": max(1, round(seconds)) * 1e6, "err_status": done - ok}


def run_scenario(server: Server, name: str, tmp: Path, seconds: float, client_threads: int) -> dict:
    """One scenario's load for `seconds`, wrk and h2load on at most `client_threads` threads each."""
    if name in GRPC_SCENARIOS:
        values, conns, streams = GRPC_SCENARIOS[name]
        return h2load(server.grpc_port, grpc_body(values, tmp), conns, streams, seconds, client_threads)
    values, conns = {**SCENARIOS, **MORE_SCENARIOS}[name]
    body, hlen = body_file(values, tmp)
    return wrk(server.port, body, hlen, conns, seconds, client_threads)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workers",
        default="1,2",
        help="settings to compare: --frontend-workers values, each optionally followed by more flags "
        "('1,2,2 --busy-poll-us 0'); 'echo N': bench/echo_server.py with N processes, the ceiling",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=8.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument(
        "--scenarios",
        default=",".join(SCENARIOS),
        help=f"of {', '.join([*SCENARIOS, *MORE_SCENARIOS, *GRPC_SCENARIOS])}",
    )
    p.add_argument(
        "--client-threads", type=int, default=2, help="wrk's and h2load's threads (a many-core machine)"
    )
    p.add_argument(
        "--instances", type=int, default=1, help="the model's instances (python processes behind the engine)"
    )
    p.add_argument(
        "--trees",
        default=".",
        help="the server's code from each of these trees, alternated (a worktree: an A/B)",
    )
    p.add_argument("--cpu-limit", type=float, help="the server's CPU limit in CPUs (a cgroup's CFS quota)")
    p.add_argument(
        "--backend",
        choices=["python", "onnxruntime"],
        default="python",
        help="the identity model's backend: python (stub processes) or onnxruntime (inside the engine)",
    )
    args = p.parse_args()
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    # a setting of each tree: "1", or "1 [base]" for the second of `--trees .,/tmp/base`
    runs = {
        (f"{w.strip()} [{t.name}]" if len(trees) > 1 else w.strip()): (w.strip(), t)
        for t in trees
        for w in args.workers.split(",")
    }
    settings = list(runs)
    limit = CpuLimit(args.cpu_limit) if args.cpu_limit else None
    tmp = Path(tempfile.mkdtemp(prefix="naiad-fw-bench-"))
    repo = make_repo(tmp / "repo", args.instances, args.backend)
    log = tmp / "server.log"
    results: dict = {}
    try:
        for rnd in range(args.rounds):
            order = settings if rnd % 2 == 0 else settings[::-1]
            for n in order:
                server = Server(repo, runs[n][0], log, runs[n][1], limit)
                try:
                    for name in args.scenarios.split(","):
                        run_scenario(server, name, tmp, args.warmup, args.client_threads)
                        cpu0, engine0 = server.cpu_seconds()
                        periods0, throttled0 = limit.throttled() if limit else (0, 0)
                        r = run_scenario(server, name, tmp, args.duration, args.client_threads)
                        cpu1, engine1 = server.cpu_seconds()
                        periods1, throttled1 = limit.throttled() if limit else (0, 0)
                        errors = sum(v for k, v in r.items() if k.startswith("err_"))
                        rps = r["requests"] / (r["duration_us"] / 1e6)
                        cpu_us = (cpu1 - cpu0) / max(1, r["requests"]) * 1e6
                        engine_us = (engine1 - engine0) / max(1, r["requests"]) * 1e6
                        results.setdefault((name, n), []).append((rps, cpu_us, errors))
                        # the first process's share: with workers the engine (busy = its fraction of one core)
                        print(
                            f"round {rnd + 1} workers={n} {name}: {rps:9.1f} req/s, "
                            f"{cpu_us:8.1f} us CPU/request (first process {engine_us:.1f} us, busy "
                            f"{(engine1 - engine0) / (r['duration_us'] / 1e6):.2f}), errors {errors}, "
                            f"load {os.getloadavg()[0]:.1f}"
                            + (
                                f", throttled {throttled1 - throttled0}/{periods1 - periods0} periods"
                                if limit
                                else ""
                            ),
                            flush=True,
                        )
                finally:
                    server.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if limit is not None:
            limit.remove()
    print("\nmedians over rounds:")
    for name in args.scenarios.split(","):
        base = None
        for n in settings:
            runs = results[(name, n)]
            rps = statistics.median(r[0] for r in runs)
            cpu = statistics.median(r[1] for r in runs)
            base = base or (rps, cpu)
            print(
                f"  {name} workers={n}: {rps:9.1f} req/s ({rps / base[0]:.2f}x), {cpu:8.1f} us CPU/request "
                f"({cpu / base[1]:.2f}x)"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
