#!/usr/bin/env python3
"""GPU benchmark on a machine with PyTorch but without onnxruntime-gpu or TensorRT: a ResNet-50 TorchScript
model at batch 1/8/32 served by Naiad on KIND_GPU (pytorch backend) against the same module called in-process.
Prints a markdown table.

    python bench/gpu_torch_bench.py                       # on a GPU machine
    python bench/gpu_torch_bench.py --batches 1,8 --iters 100 --protocol http --json out.json

Rows (p50 / p99 latency of one request and images per second; sequential requests unless --concurrency):
  torch raw          torch.jit module on cuda:0, numpy in / out (host<->device copies included)
  naiad torchscript  the same module served by Naiad (KIND_GPU), binary tensors over gRPC or HTTP
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from gpu_bench import SHAPE, Naiad, client_fn, measure, resnet50  # noqa: E402

CONFIG = """
name: "resnet50_pt"
platform: "pytorch_libtorch"
max_batch_size: 32
input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]
output [ { name: "output" data_type: TYPE_FP32 dims: [ 1000 ] } ]
instance_group [ { kind: KIND_GPU count: 1 } ]
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--protocol", choices=["grpc", "http"], default="grpc")
    ap.add_argument("--work", type=Path, default=HERE / ".work" / "gpu-torch")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_torch_bench: no CUDA device visible to torch", file=sys.stderr)
        return 2
    batches = [int(b) for b in a.batches.split(",")]
    model_dir = a.work / "repo" / "resnet50_pt"
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    traced = torch.jit.trace(resnet50(), torch.zeros(1, *SHAPE))
    traced.save(str(model_dir / "1" / "model.pt"))
    (model_dir / "config.pbtxt").write_text(CONFIG)

    gpu_module = torch.jit.load(str(model_dir / "1" / "model.pt"), map_location="cuda:0").eval()
    rows = []
    naiad = Naiad(a.work / "repo")
    try:
        state = naiad.ready("resnet50_pt")
        if state:
            raise RuntimeError(f"resnet50_pt is not ready: {state}")
        for batch in batches:
            x = np.random.default_rng(0).standard_normal((batch, *SHAPE), dtype=np.float32)

            def raw(x=x):
                with torch.inference_mode():
                    return gpu_module(torch.from_numpy(x).to("cuda:0")).cpu().numpy()

            served = client_fn(naiad, a.protocol, "resnet50_pt", x, a.concurrency)
            expected, got = raw(), served()
            assert np.allclose(expected, got, rtol=1e-3, atol=1e-3), "served output differs from the module's"
            for name, fn in (("torch raw", raw), (f"naiad torchscript ({a.protocol})", served)):
                r = measure(fn, batch, a.iters, a.warmup, a.concurrency)
                rows.append({"row": name, "batch": batch, **r})
    finally:
        naiad.stop()
    print(f"| row | batch | p50 ms | p99 ms | images/s |  (GPU: {torch.cuda.get_device_name(0)})")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['row']} | {r['batch']} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | {r['images_per_s']:.0f} |"
        )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
