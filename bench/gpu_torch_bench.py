#!/usr/bin/env python3
"""GPU benchmark on a machine with PyTorch but without onnxruntime-gpu or TensorRT: a ResNet-50 TorchScript
model served by Naiad on KIND_GPU (pytorch backend) against the same module called in-process, with one or more
`--frontend-workers` settings side by side. Prints a markdown table.

    python bench/gpu_torch_bench.py                                   # on a GPU machine
    python bench/gpu_torch_bench.py --cases 8:8,32:1 --workers 1,8 --protocols grpc,http --json out.json

A case `B:C` is batch B at concurrency C. Each row runs C clients for `--duration` seconds after a warm-up, all
starting at the same instant: with `--clients procs` (the default) each client is a process of its own with its
own connection (so the client's GIL does not cap the figure, and N frontend workers get N connections to share);
the in-process row runs C threads on the one module (torch releases the GIL in its kernels: that is the limit).
Rows: p50 / p99 latency of one request and images per second; for served rows also the server's own share, from
the statistics extension over the row (mean per request, warm-ups included): `server ms` is Triton's request
success duration (from the request's arrival at the model's scheduler to its response), split into queue, compute
input (gathering the batch), infer (the backend's execute, the copy to the device and back included) and output
(scattering the results). The rest of a latency is the protocol, the wire and the client (tritonclient serialising).
  torch in-process     torch.jit module on cuda:0, numpy in / out (host<->device copies included)
  naiad <proto> wN     the same module served by `naiad serve --frontend-workers N`, binary tensors over gRPC or
                       HTTP (tritonclient)
  perf_analyzer <proto> wN   with `--perf-analyzer PATH`: the cases of batch 8 and more from Triton's C++ client
                       (which does not serialise in Python), p50 / p99 as it reports them
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing
import statistics
import subprocess
import sys
import threading
import time
import types
import urllib.request
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_bench import SHAPE, Naiad, client_fn, resnet50  # noqa: E402

MODEL = "resnet50_pt"
CONFIG = """
name: "resnet50_pt"
platform: "pytorch_libtorch"
max_batch_size: 32
input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [ 1000 ] } ]
instance_group [ { kind: KIND_GPU count: 1 } ]
"""


def batch_input(batch: int) -> np.ndarray:
    return np.random.default_rng(batch).standard_normal((batch, *SHAPE), dtype=np.float32)


def timed_loop(fn, start_at: float, duration: float) -> list[float]:
    """Call `fn` from `start_at` (time.monotonic, shared by every process) for `duration` seconds; the latency of
    each call that started inside the window."""
    delay = start_at - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    end, lat = start_at + duration, []
    while True:
        t = time.monotonic()
        if t >= end:
            return lat
        fn()
        lat.append(time.monotonic() - t)


def client_process(args: tuple) -> list[float]:
    """One client process: its own connection, a warm-up, then the timed window."""
    http_port, grpc_port, protocol, batch, warmup, start_at, duration = args
    addr = types.SimpleNamespace(http_port=http_port, grpc_port=grpc_port)  # what client_fn reads of a Naiad
    fn = client_fn(addr, protocol, MODEL, batch_input(batch), 1)
    for _ in range(warmup):
        fn()
    return timed_loop(fn, start_at, duration)


def summarise(lat_lists: list[list[float]], batch: int, duration: float) -> dict:
    lat = sorted(x for lst in lat_lists for x in lst)
    if not lat:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "images_per_s": 0.0, "requests": 0}
    return {
        "p50_ms": 1000 * statistics.median(lat),
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "images_per_s": batch * len(lat) / duration,
        "requests": len(lat),
    }


def run_threads(make_fn, concurrency: int, warmup: int, duration: float, batch: int) -> list[list[float]]:
    """`concurrency` threads, each making its own client (tritonclient's HTTP client belongs to the thread that
    made it), warming up and then timed over one shared window."""
    start_at = time.monotonic() + 1.0 + 0.01 * warmup * batch
    out: list[list[float]] = [[] for _ in range(concurrency)]

    def one(i: int) -> None:
        fn = make_fn()
        for _ in range(warmup):
            fn()
        out[i] = timed_loop(fn, start_at, duration)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


STAGES = ("success", "queue", "compute_input", "compute_infer", "compute_output")


def server_stats(naiad: Naiad) -> dict[str, tuple[int, int]]:
    """The model's inference statistics (count, ns) by stage, from the statistics extension."""
    url = f"http://127.0.0.1:{naiad.http_port}/v2/models/{MODEL}/stats"
    with urllib.request.urlopen(url, timeout=10) as r:
        stats = json.load(r)["model_stats"][0]["inference_stats"]
    return {k: (int(stats[k]["count"]), int(stats[k]["ns"])) for k in STAGES}


def server_split(before: dict, after: dict) -> dict[str, float]:
    """Milliseconds per request in each stage between two `server_stats` readings."""
    out = {}
    for k in STAGES:
        n = after[k][0] - before[k][0]
        out[f"server_{k}_ms"] = (after[k][1] - before[k][1]) / n / 1e6 if n else float("nan")
    return out


def perf_analyzer_row(pa: Path, naiad: Naiad, protocol: str, batch: int, conc: int, a) -> dict:
    """One case from perf_analyzer (its own measurement windows, a stable p50 over them)."""
    out = a.work / f"pa-{protocol}-{batch}-{conc}.csv"
    port = naiad.grpc_port if protocol == "grpc" else naiad.http_port
    cmd = [str(pa), "-m", MODEL, "-i", protocol, "-u", f"127.0.0.1:{port}", "-b", str(batch)]
    cmd += ["--concurrency-range", str(conc), "--measurement-interval", str(int(a.duration * 1000))]
    cmd += ["--percentile", "50", "--stability-percentage", "50", "--max-trials", "3", "-f", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"perf_analyzer exited {done.returncode}: {(done.stdout + done.stderr)[-800:]}")
    with out.open() as f:
        row = next(csv.DictReader(f))
    return {
        "p50_ms": float(row["p50 latency"]) / 1000,
        "p99_ms": float(row["p99 latency"]) / 1000,
        "images_per_s": float(row["Inferences/Second"]),
        "client_send_ms": float(row["Client Send"]) / 1000,
        "client_recv_ms": float(row["Client Recv"]) / 1000,
    }


def served_once(naiad: Naiad, protocol: str, x: np.ndarray) -> np.ndarray:
    """One request on a thread of its own (and so a client of its own); its output."""
    out: list[np.ndarray] = []
    t = threading.Thread(target=lambda: out.append(client_fn(naiad, protocol, MODEL, x, 1)()))
    t.start()
    t.join()
    if not out:
        raise RuntimeError(f"the check request over {protocol} failed (see above)")
    return out[0]


def run_procs(pool, naiad: Naiad, protocol: str, batch: int, concurrency: int, warmup: int, duration: float):
    # The processes are already started (the pool is warm); each makes its connection and warms up before the
    # shared start instant, which leaves room for a slow warm-up at batch 32.
    start_at = time.monotonic() + 2.0 + 0.01 * warmup * batch
    args = (naiad.http_port, naiad.grpc_port, protocol, batch, warmup, start_at, duration)
    return pool.map(client_process, [args] * concurrency)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="1:1,8:1,32:1,8:8", help="batch:concurrency, comma separated")
    ap.add_argument("--workers", default="1", help="--frontend-workers settings served side by side")
    ap.add_argument("--protocols", default="grpc,http")
    ap.add_argument("--clients", choices=["procs", "threads"], default="procs")
    ap.add_argument("--duration", type=float, default=4.0, help="seconds each row is timed")
    ap.add_argument("--warmup", type=int, default=5, help="requests each client sends before the window")
    ap.add_argument("--work", type=Path, default=HERE / ".work" / "gpu-torch")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument("--perf-analyzer", type=Path, help="also run the cases from this perf_analyzer")
    ap.add_argument("--perf-analyzer-batch", type=int, default=8, help="... those of at least this batch")
    ap.add_argument(
        "--cpu-smoke", action="store_true", help="check the plumbing without a GPU (KIND_CPU, cpu)"
    )
    a = ap.parse_args()
    import torch

    device = "cpu" if a.cpu_smoke else "cuda:0"
    if not a.cpu_smoke and not torch.cuda.is_available():
        print("gpu_torch_bench: no CUDA device visible to torch", file=sys.stderr)
        return 2
    cases = [tuple(int(v) for v in c.split(":")) for c in a.cases.split(",")]
    model_dir = a.work / "repo" / MODEL
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    traced = torch.jit.trace(resnet50(), torch.zeros(1, *SHAPE))
    traced.save(str(model_dir / "1" / "model.pt"))
    (model_dir / "config.pbtxt").write_text(CONFIG.replace("KIND_GPU", "KIND_CPU") if a.cpu_smoke else CONFIG)

    gpu_module = torch.jit.load(str(model_dir / "1" / "model.pt"), map_location=device).eval()

    def raw_fn(batch: int):
        x = batch_input(batch)

        def raw():
            with torch.inference_mode():
                return gpu_module(torch.from_numpy(x).to(device)).cpu().numpy()

        return raw

    rows = []
    for batch, conc in cases:
        lats = run_threads(lambda b=batch: raw_fn(b), conc, a.warmup, a.duration, batch)
        rows.append(
            {
                "row": "torch in-process",
                "batch": batch,
                "concurrency": conc,
                **summarise(lats, batch, a.duration),
            }
        )
    pool = (
        multiprocessing.get_context("spawn").Pool(max(c for _, c in cases)) if a.clients == "procs" else None
    )
    try:
        for workers in a.workers.split(","):
            naiad = Naiad(a.work / "repo", ["--frontend-workers", workers.strip()])
            try:
                state = naiad.ready(MODEL)
                if state:
                    raise RuntimeError(f"{MODEL} is not ready: {state}")
                for protocol in a.protocols.split(","):
                    for batch, conc in cases:
                        x = batch_input(batch)
                        expected, got = raw_fn(batch)(), served_once(naiad, protocol, x)
                        assert np.allclose(expected, got, rtol=1e-3, atol=1e-3), "served output differs"
                        before = server_stats(naiad)
                        if pool is not None and conc > 1:
                            lats = run_procs(pool, naiad, protocol, batch, conc, a.warmup, a.duration)
                        else:
                            lats = run_threads(
                                lambda p=protocol, x=x, n=naiad: client_fn(n, p, MODEL, x, 1),
                                conc,
                                a.warmup,
                                a.duration,
                                batch,
                            )
                        rows.append(
                            {
                                "row": f"naiad {protocol} w{workers.strip()}",
                                "batch": batch,
                                "concurrency": conc,
                                **summarise(lats, batch, a.duration),
                                **server_split(before, server_stats(naiad)),
                            }
                        )
                        print(json.dumps(rows[-1]), flush=True)
                        if a.perf_analyzer is not None and batch >= a.perf_analyzer_batch:
                            before = server_stats(naiad)
                            try:
                                measured = perf_analyzer_row(a.perf_analyzer, naiad, protocol, batch, conc, a)
                            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                                print(f"perf_analyzer {protocol} batch {batch} c{conc}: {exc}", flush=True)
                                continue  # an unstable measurement is a missing row, not a lost run
                            rows.append(
                                {
                                    "row": f"perf_analyzer {protocol} w{workers.strip()}",
                                    "batch": batch,
                                    "concurrency": conc,
                                    **measured,
                                    **server_split(before, server_stats(naiad)),
                                }
                            )
                            print(json.dumps(rows[-1]), flush=True)
            finally:
                naiad.stop()
    finally:
        if pool is not None:
            pool.terminate()
    raw = {(r["batch"], r["concurrency"]): r for r in rows if r["row"] == "torch in-process"}
    name = "cpu" if a.cpu_smoke else torch.cuda.get_device_name(0)
    print(
        "| row | batch | clients | p50 ms | p99 ms | images/s | of in-process "
        f"| server ms (queue / input / infer / output) |  (device: {name})"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = raw[(r["batch"], r["concurrency"])]["images_per_s"]
        split = (
            f"{r['server_success_ms']:.2f} ({r['server_queue_ms']:.2f} / {r['server_compute_input_ms']:.2f} / "
            f"{r['server_compute_infer_ms']:.2f} / {r['server_compute_output_ms']:.2f})"
            if "server_success_ms" in r
            else ""
        )
        print(
            f"| {r['row']} | {r['batch']} | {r['concurrency']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{r['images_per_s']:.0f} | {r['images_per_s'] / ref:.2f} | {split} |"
        )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
