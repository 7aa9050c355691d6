#!/usr/bin/env python3
"""GPU benchmark: a ResNet-50-sized ONNX model at batch 1/8/32 through Naiad vs raw onnxruntime-gpu, and a
TensorRT plan of the same network vs the ONNX CUDA execution provider. Prints a markdown table.

    python bench/gpu_bench.py               # on a GPU machine, venv with the torch,test,gpu,tensorrt extras
    python bench/gpu_bench.py --batches 1,8 --iters 100 --protocol http --json out.json
    python bench/gpu_bench.py --cpu-smoke   # plumbing check without a GPU: CPU EP, tiny run, no TensorRT

Rows (p50 / p99 latency of one request and images per second; sequential requests unless --concurrency):
  ort-cuda raw         onnxruntime-gpu InferenceSession, CUDA EP, numpy in / out (host<->device included)
  naiad ort-cuda       the same ONNX served by Naiad on KIND_GPU (onnxruntime backend), binary tensors
  tensorrt in-process  the same network as a TensorRT plan (profile 1..32, opt 8), Naiad's tensorrt backend
                       called directly (no server): the raw TensorRT figure
  naiad tensorrt       that plan served by Naiad (tensorrt backend)
The network is torchvision's resnet50 when torchvision is installed, else an equivalent ResNet-50 defined here
(same layers and FLOPs, random weights: timings do not depend on the weights).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO / "server"))

INPUT, OUTPUT = "input", "output"
SHAPE = (3, 224, 224)
PROFILE = (1, 8, 32)


# ---- the network ----


def resnet50():
    import torch
    from torch import nn

    try:
        import torchvision

        return torchvision.models.resnet50(weights=None).eval()
    except ImportError:
        pass

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            cout = width * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride, 1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.Conv2d(width, cout, 1, bias=False),
                nn.BatchNorm2d(cout),
            )
            self.down = (
                None
                if stride == 1 and cin == cout
                else nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
            )
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            return self.relu(self.body(x) + (x if self.down is None else self.down(x)))

    layers, cin = [], 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
        *layers,
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2048, 1000),
    ).eval()


def export_onnx(path: Path) -> Path:
    import torch

    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(
        resnet50(),
        (torch.zeros(1, *SHAPE),),
        str(path),
        input_names=[INPUT],
        output_names=[OUTPUT],
        dynamic_axes={INPUT: {0: "batch"}, OUTPUT: {0: "batch"}},
        opset_version=17,
        dynamo=False,
    )
    return path


def build_plan(onnx_path: Path, plan_path: Path) -> Path:
    import tensorrt as trt

    if plan_path.exists():
        return plan_path
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network()
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        raise RuntimeError("; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)))
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 4 << 30)
    profile = builder.create_optimization_profile()
    lo, opt, hi = PROFILE
    profile.set_shape(INPUT, (lo, *SHAPE), (opt, *SHAPE), (hi, *SHAPE))
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise RuntimeError("TensorRT failed to build the plan")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_bytes(bytes(serialized))
    return plan_path


# ---- timing ----


def measure(fn, batch: int, iters: int, warmup: int, concurrency: int) -> dict:
    for _ in range(warmup):
        fn()
    lat: list[float] = []

    def one(_):
        t = time.perf_counter()
        fn()
        lat.append(time.perf_counter() - t)

    start = time.perf_counter()
    if concurrency <= 1:
        for i in range(iters):
            one(i)
    else:
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, range(iters)))
    wall = time.perf_counter() - start
    lat.sort()
    p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
    return {
        "p50_ms": 1000 * statistics.median(lat),
        "p99_ms": 1000 * p99,
        "images_per_s": batch * iters / wall,
    }


# ---- the server ----


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Naiad:
    def __init__(self, repo: Path, extra_args: list[str] | None = None):
        self.http_port, self.grpc_port, self.metrics_port = free_port(), free_port(), free_port()
        fd, self.log_path = tempfile.mkstemp(prefix="naiad-gpu-bench-", suffix=".log")
        path = str(REPO / "server") + os.pathsep + os.environ.get("PYTHONPATH", "")
        env = dict(os.environ, PYTHONPATH=path)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "naiad.cli",
                "serve",
                "--model-repository",
                str(repo),
                "--http-address",
                "127.0.0.1",
                "--grpc-address",
                "127.0.0.1",
                "--http-port",
                str(self.http_port),
                "--grpc-port",
                str(self.grpc_port),
                "--metrics-port",
                str(self.metrics_port),
                "--strict-readiness",
                "false",
                *(extra_args or []),
            ],
            stdout=fd,
            stderr=subprocess.STDOUT,
            env=env,
        )
        os.close(fd)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"naiad exited:\n{Path(self.log_path).read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/v2/health/ready", timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("naiad did not become ready")

    def ready(self, model: str) -> str:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.http_port}/v2/repository/index", data=b"{}", method="POST"
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            for e in json.load(r):
                if e["name"] == model:
                    return "" if e.get("state") == "READY" else f"{e.get('state')}: {e.get('reason', '')}"
        return "not in the repository"

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def client_fn(naiad: Naiad, protocol: str, model: str, x: np.ndarray, concurrency: int):
    if protocol == "grpc":
        import tritonclient.grpc as mod

        addr = f"127.0.0.1:{naiad.grpc_port}"
    else:
        import tritonclient.http as mod

        addr = f"127.0.0.1:{naiad.http_port}"
    kwargs = {"concurrency": concurrency} if protocol == "http" else {}
    client = mod.InferenceServerClient(addr, **kwargs)
    inp = mod.InferInput(INPUT, list(x.shape), "FP32")
    inp.set_data_from_numpy(x, **({"binary_data": True} if protocol == "http" else {}))
    out = mod.InferRequestedOutput(OUTPUT, **({"binary_data": True} if protocol == "http" else {}))
    return lambda: client.infer(model, [inp], outputs=[out]).as_numpy(OUTPUT)


CONFIG = """
name: "{name}"
platform: "{platform}"
max_batch_size: 32
input [ {{ name: "input" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] }} ]
output [ {{ name: "output" data_type: TYPE_FP32 dims: [ 1000 ] }} ]
instance_group [ {{ kind: {kind} count: 1 }} ]
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    ap.add_argument("--work", type=Path, default=HERE / ".work" / "gpu")
    ap.add_argument("--no-trt", action="store_true", help="skip the TensorRT rows")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="check the script without a GPU: CPU EP and KIND_CPU, batches 1,2, 3 iterations, no TensorRT",
    )
    a = ap.parse_args()
    if a.cpu_smoke:
        a.batches, a.iters, a.warmup, a.no_trt = "1,2", 3, 1, True
    batches = [int(b) for b in a.batches.split(",")]

    import onnxruntime as ort

    from naiad import gpu

    if not a.cpu_smoke:
        if gpu.device_count() == 0:
            print(
                "gpu_bench: no CUDA device (NVML reports none); use --cpu-smoke to check the script",
                file=sys.stderr,
            )
            return 2
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            print(
                "gpu_bench: onnxruntime has no CUDA execution provider: pip install 'naiad[gpu]'",
                file=sys.stderr,
            )
            return 2
    trt_reason = "--no-trt" if a.no_trt else None
    if trt_reason is None:
        try:
            import tensorrt  # noqa: F401
        except ImportError:
            trt_reason = "tensorrt is not installed (pip install 'naiad[tensorrt]')"

    onnx_path = export_onnx(a.work / "resnet50.onnx")
    repo = a.work / ("repo_cpu" if a.cpu_smoke else "repo")
    kind = "KIND_CPU" if a.cpu_smoke else "KIND_GPU"
    (repo / "resnet50_onnx" / "1").mkdir(parents=True, exist_ok=True)
    target = repo / "resnet50_onnx" / "1" / "model.onnx"
    if not target.exists():
        target.write_bytes(onnx_path.read_bytes())
    (repo / "resnet50_onnx" / "config.pbtxt").write_text(
        CONFIG.format(name="resnet50_onnx", platform="onnxruntime_onnx", kind=kind)
    )
    if trt_reason is None:
        try:
            build_plan(onnx_path, repo / "resnet50_plan" / "1" / "model.plan")
            (repo / "resnet50_plan" / "config.pbtxt").write_text(
                CONFIG.format(name="resnet50_plan", platform="tensorrt_plan", kind="KIND_GPU")
            )
        except Exception as exc:
            trt_reason = f"building the plan failed: {exc}"

    rng = np.random.default_rng(0)
    inputs = {b: rng.standard_normal((b, *SHAPE)).astype(np.float32) for b in batches}
    rows: list[dict] = []

    def add(path: str, batch: int, result: dict):
        rows.append({"path": path, "batch": batch, **result})
        print(
            f"  {path:<22} batch {batch:>2}: p50 {result['p50_ms']:8.2f} ms  "
            f"{result['images_per_s']:9.1f} img/s",
            file=sys.stderr,
            flush=True,
        )

    # raw onnxruntime
    providers = (
        ["CPUExecutionProvider"]
        if a.cpu_smoke
        else [("CUDAExecutionProvider", {"device_id": 0}), "CPUExecutionProvider"]
    )
    raw_name = "ort-cpu raw" if a.cpu_smoke else "ort-cuda raw"
    sess = ort.InferenceSession(str(onnx_path), providers=providers)
    for b in batches:
        x = inputs[b]
        add(
            raw_name,
            b,
            measure(lambda x=x: sess.run([OUTPUT], {INPUT: x}), b, a.iters, a.warmup, a.concurrency),
        )
    reference = {b: sess.run([OUTPUT], {INPUT: inputs[b]})[0] for b in batches}
    sess = None

    # TensorRT through Naiad's backend, in-process (no server)
    if trt_reason is None:
        from tritonclient.grpc import model_config_pb2 as mc

        from naiad.backends import tensorrt as trt_backend
        from naiad.backends.base import ModelContext
        from naiad.config import normalize, parse_text

        config = parse_text((repo / "resnet50_plan" / "config.pbtxt").read_text())
        config.backend = "tensorrt"
        normalize(config, gpu.device_count())
        ctx = ModelContext("resnet50_plan", 1, config, repo / "resnet50_plan", repo / "resnet50_plan" / "1")
        group = config.instance_group[0]
        assert group.kind == mc.ModelInstanceGroup.KIND_GPU
        inst = trt_backend.create_instance(ctx, group, group.gpus[0], 0)
        for b in batches:
            got = inst.run({INPUT: inputs[b]}, [OUTPUT])[OUTPUT]
            err = float(np.max(np.abs(got - reference[b])))
            print(f"  tensorrt vs onnxruntime, batch {b}: max abs diff {err:.2e}", file=sys.stderr)
            x = inputs[b]
            add(
                "tensorrt in-process",
                b,
                measure(lambda x=x: inst.run({INPUT: x}, [OUTPUT]), b, a.iters, a.warmup, 1),
            )
        inst.close()

    # through Naiad
    naiad = Naiad(repo)
    try:
        models = [("naiad ort-" + ("cpu" if a.cpu_smoke else "cuda"), "resnet50_onnx")]
        if trt_reason is None:
            models.append(("naiad tensorrt", "resnet50_plan"))
        for label, model in models:
            reason = naiad.ready(model)
            if reason:
                print(f"gpu_bench: {model} did not load: {reason}", file=sys.stderr)
                continue
            for b in batches:
                fn = client_fn(naiad, a.protocol, model, inputs[b], a.concurrency)
                err = float(np.max(np.abs(fn() - reference[b])))
                if err > 5e-2:
                    print(
                        f"gpu_bench: warning: {model} batch {b} differs from onnxruntime by {err:.3g}",
                        file=sys.stderr,
                    )
                add(f"{label} ({a.protocol})", b, measure(fn, b, a.iters, a.warmup, a.concurrency))
    finally:
        naiad.stop()

    base = {r["batch"]: r for r in rows if r["path"] == raw_name}
    print(
        f"\nResNet-50 ({'CPU smoke run' if a.cpu_smoke else 'GPU'}), {a.iters} requests per row, "
        f"concurrency {a.concurrency}, {a.protocol} for the Naiad rows"
        + (f"; TensorRT rows skipped: {trt_reason}" if trt_reason else "")
    )
    print("\n| path | batch | p50 ms | p99 ms | images/s | p50 vs raw onnxruntime |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: (r["batch"], r["path"])):
        ratio = r["p50_ms"] / base[r["batch"]]["p50_ms"] if r["batch"] in base else float("nan")
        print(
            f"| {r['path']} | {r['batch']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} "
            f"| {r['images_per_s']:.1f} | {ratio:.2f}x |"
        )
    if a.json:
        args = {k: str(v) for k, v in vars(a).items()}
        a.json.write_text(json.dumps({"devices": gpu.devices(), "args": args, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
