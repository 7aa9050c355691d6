"""What tracing costs: Naiad's throughput with tracing off, and in OpenTelemetry mode at rate 1000 and rate 1.

Each round starts Naiad once per configuration (order rotated per round) on the bench's identity_16 model,
pinned to CPU 0, and drives it with `wrk -t1 -c8` (JSON bodies, bench/lua/infer_json.lua) pinned to CPU 1.
The OpenTelemetry configurations export over OTLP/HTTP to a real OpenTelemetry Collector (tools/go/otelcol,
file exporter) on CPU 1. Prints the median requests/s per configuration and the server's CPU time per request
(from /proc: what the other load on a shared machine moves least), each with its change against "off".

    python bench/trace_cost.py                 # 3 rounds x 5 s
    python bench/trace_cost.py --rounds 5 --duration 10
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODELS = HERE / "models" / "repo"
BODY = {"inputs": [{"name": "INPUT0", "shape": [16], "datatype": "FP32", "data": [0.5] * 16}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_collector(workdir: Path, binary: str | None) -> tuple[subprocess.Popen, int]:
    if binary is None:
        out = subprocess.run(
            ["bash", str(ROOT / "tools" / "go" / "build.sh"), "otelcol"],
            capture_output=True,
            text=True,
            check=True,
        )
        binary = str(Path(out.stdout.strip().splitlines()[-1]) / "otelcol")
    port = free_port()
    config = workdir / "collector.yaml"
    config.write_text(
        f"receivers:\n  otlp:\n    protocols:\n      http:\n        endpoint: 127.0.0.1:{port}\n"
        f"exporters:\n  file:\n    path: {workdir / 'spans.jsonl'}\n"
        "service:\n  telemetry:\n    metrics:\n      level: none\n"
        "  pipelines:\n    traces:\n      receivers: [otlp]\n      exporters: [file]\n"
    )
    proc = subprocess.Popen(
        ["taskset", "-c", "1", str(binary), "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, port


def serve(trace_args: list[str], server_dir: Path = ROOT / "server") -> tuple[subprocess.Popen, int]:
    http, grpc, metrics = free_port(), free_port(), free_port()
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(server_dir), os.environ.get("PYTHONPATH")])),
    )
    cmd = [
        "taskset",
        "-c",
        "0",
        sys.executable,
        "-m",
        "naiad.cli",
        "serve",
        f"--model-repository={MODELS}",
        "--model-control-mode=explicit",
        "--load-model=identity_16",
        "--http-address=127.0.0.1",
        f"--http-port={http}",
        f"--grpc-port={grpc}",
        f"--metrics-port={metrics}",
        *trace_args,
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{http}/v2/models/identity_16/ready", timeout=1).ok:
                return proc, http
        except requests.RequestException:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("naiad did not become ready")


def wrk(port: int, body: Path, duration: float, pid: int) -> tuple[float, float]:
    """Requests/s, and the server's CPU microseconds per request (what other load on the machine moves least)."""
    env = dict(os.environ, BENCH_BODY=str(body))
    url = f"http://127.0.0.1:{port}/v2/models/identity_16/infer"
    lua = str(HERE / "lua" / "infer_json.lua")
    subprocess.run(
        ["taskset", "-c", "1", "wrk", "-t1", "-c8", "-d1s", "-s", lua, url], env=env, capture_output=True
    )
    cpu = cpu_seconds(pid)
    out = subprocess.run(
        ["taskset", "-c", "1", "wrk", "-t1", "-c8", f"-d{round(duration)}s", "-s", lua, url],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cpu = cpu_seconds(pid) - cpu
    result = json.loads(re.search(r"BENCH_RESULT (\{.*\})", out).group(1))
    errors = sum(v for k, v in result.items() if k.startswith("err_"))
    if errors:
        raise RuntimeError(f"wrk reported {errors} errors: {result}")
    return result["requests"] / (result["duration_us"] / 1e6), 1e6 * cpu / result["requests"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (its threads included), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tracer_cost(url: str, n: int = 20000) -> dict[str, float]:
    """CPU microseconds the tracer adds to one request in this process (start + finish, schedulers' timestamps
    included), by configuration: a figure the machine's other load does not move."""
    import types

    sys.path.insert(0, str(ROOT / "server"))
    from naiad.inference import InferenceRequest
    from naiad.trace import Tracer

    mv = types.SimpleNamespace(name="identity_16", version=1)
    otel = {"trace_mode": "opentelemetry", "trace_level": ["TIMESTAMPS"]}
    out = {}
    for name, settings in (
        ("off", {}),
        ("opentelemetry rate=1000", {**otel, "trace_rate": "1000"}),
        ("opentelemetry rate=1", {**otel, "trace_rate": "1"}),
    ):
        tracer = Tracer()
        tracer.otel_settings = {"url": url}
        tracer.update(settings)
        requests_ = [InferenceRequest("identity_16", {}, {}) for _ in range(n)]
        t0 = time.process_time()
        for req in requests_:
            trace = tracer.start(mv, req)
            if trace is not None:
                now = time.monotonic_ns()
                trace.append(("QUEUE_START", now))
                trace.extend((("COMPUTE_START", now), ("COMPUTE_INPUT_END", now)))
                trace.extend((("COMPUTE_OUTPUT_START", now), ("COMPUTE_END", now)))
                tracer.finish(mv, trace)
        out[name] = 1e6 * (time.process_time() - t0) / n
        tracer.shutdown()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--collector", help="an otelcol binary (default: tools/go/build.sh otelcol)")
    p.add_argument("--micro", action="store_true", help="only the in-process tracer cost per request")
    p.add_argument(
        "--baseline",
        type=Path,
        help="another Naiad's server/ directory (e.g. `git archive <commit> server`) run with tracing off too",
    )
    args = p.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="naiad-trace-cost-"))
    body = workdir / "body.json"
    body.write_text(json.dumps(BODY))
    if args.micro:
        collector, port = start_collector(workdir, args.collector)
        try:
            micro = tracer_cost(f"http://127.0.0.1:{port}/v1/traces")
        finally:
            collector.terminate()
            collector.wait(10)
        print("tracer CPU per request, in-process: " + ", ".join(f"{k} {v:.2f} us" for k, v in micro.items()))
        return 0
    collector, port = start_collector(workdir, args.collector)
    otel = [
        "--trace-config=mode=opentelemetry",
        "--trace-config=level=TIMESTAMPS",
        f"--trace-config=opentelemetry,url=http://127.0.0.1:{port}/v1/traces",
    ]
    configs = {
        "off": [],
        "opentelemetry rate=1000": [*otel, "--trace-config=rate=1000"],
        "opentelemetry rate=1": [*otel, "--trace-config=rate=1"],
    }
    dirs = {name: ROOT / "server" for name in configs}
    if args.baseline:
        configs["off, baseline"] = []
        dirs["off, baseline"] = args.baseline
    results: dict[str, list[float]] = {name: [] for name in configs}
    cpu: dict[str, list[float]] = {name: [] for name in configs}
    try:
        for rnd in range(args.rounds):
            names = list(configs)
            names = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in names:
                proc, http = serve(configs[name], dirs[name])
                try:
                    rps, cpu_us = wrk(http, body, args.duration, proc.pid)
                finally:
                    proc.terminate()
                    proc.wait(30)
                results[name].append(rps)
                cpu[name].append(cpu_us)
                print(f"round {rnd + 1} {name:26s} {rps:9.1f} req/s {cpu_us:7.1f} CPU us/request", flush=True)
    finally:
        collector.terminate()
        collector.wait(10)
    spans = workdir / "spans.jsonl"
    exported = sum(1 for _ in spans.open()) if spans.exists() else 0
    base = statistics.median(results["off"])
    base_cpu = statistics.median(cpu["off"])
    print(f"\nmedian of {args.rounds} rounds x {args.duration:g} s, wrk -c8, identity_16 JSON")
    print(f"load average {os.getloadavg()}")
    print(f"{'':26s} {'req/s [min-max]':>26s} {'vs off':>7s} {'CPU us/req':>11s} {'vs off':>7s}")
    for name, values in results.items():
        med, med_cpu = statistics.median(values), statistics.median(cpu[name])
        print(
            f"{name:26s} {med:9.1f} [{min(values):6.0f}-{max(values):6.0f}] {100 * (med / base - 1):+6.1f}% "
            f"{med_cpu:11.1f} {100 * (med_cpu / base_cpu - 1):+6.1f}%"
        )
    print(f"collector received {exported} OTLP export requests")
    collector, port = start_collector(workdir, args.collector)
    try:
        micro = tracer_cost(f"http://127.0.0.1:{port}/v1/traces")
    finally:
        collector.terminate()
        collector.wait(10)
    print("tracer CPU per request, in-process: " + ", ".join(f"{k} {v:.2f} us" for k, v in micro.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
