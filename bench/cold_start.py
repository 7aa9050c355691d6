#!/usr/bin/env python3
"""Cold start of a model loaded on demand: first-request latency (p50/p95) next to the model's own load time,
for a model on local disk and in S3 (a local MinIO, built by `make tools`). Both servers run at once and their
rounds alternate, so that on a shared machine both see the same load.

Each round unloads the model (and, for S3, empties the server's storage cache), then times one HTTP infer request
from the client; the server's `naiad_model_load_duration_seconds` gives the load itself (fetch, session creation,
warm-up) and `X-Naiad-Load-Wait-Ms` the time that request waited for it. A warm request is timed too.

    python bench/cold_start.py                    # 20 rounds, local disk and S3, the bench MLP (12.6 MB ONNX)
    python bench/cold_start.py --rounds 50 --hidden 2048,2048,2048 --no-s3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench" / "models"))

from export_mlp import IN_FEATURES, build_model  # noqa: E402
from helpers import NaiadProcess  # noqa: E402

CONFIG = """name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {features} ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""
MODEL = "mlp_cold"
BODY = {
    "inputs": [
        {
            "name": "INPUT0",
            "datatype": "FP32",
            "shape": [1, IN_FEATURES],
            "data": np.linspace(-1, 1, IN_FEATURES).tolist(),
        }
    ]
}


def write_model(repo: Path, hidden: tuple[int, ...]) -> int:
    data = build_model(hidden).SerializeToString()
    (repo / MODEL / "1").mkdir(parents=True)
    (repo / MODEL / "1" / "model.onnx").write_bytes(data)
    (repo / MODEL / "config.pbtxt").write_text(CONFIG.format(name=MODEL, features=IN_FEATURES))
    return len(data)


def load_seconds_sum(server: NaiadProcess) -> float:
    text = requests.get(f"http://{server.metrics}/metrics", timeout=10).text
    pattern = r'^naiad_model_load_duration_seconds_sum\{[^}]*model="' + MODEL + r'"[^}]*\} (\S+)$'
    match = re.search(pattern, text, re.M)
    return float(match.group(1)) if match else 0.0


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class Target:
    """One server serving the model, and its figures."""

    def __init__(self, server: NaiadProcess, before_round=None):
        self.server = server
        self.before_round = before_round
        self.first: list[float] = []
        self.load: list[float] = []
        self.waited: list[float] = []
        self.warm: list[float] = []

    def round(self) -> None:
        server = self.server
        url = f"{server.url}/v2/models/{MODEL}/infer"
        unload = f"{server.url}/v2/repository/models/{MODEL}/unload"
        requests.post(unload, json={}, timeout=60).raise_for_status()
        if self.before_round is not None:
            self.before_round()
        loaded_before = load_seconds_sum(server)
        t0 = time.perf_counter()
        answer = requests.post(url, json=BODY, timeout=300)
        self.first.append(time.perf_counter() - t0)
        answer.raise_for_status()
        self.waited.append(float(answer.headers["X-Naiad-Load-Wait-Ms"]) / 1000)
        self.load.append(load_seconds_sum(server) - loaded_before)
        t0 = time.perf_counter()
        requests.post(url, json=BODY, timeout=60).raise_for_status()
        self.warm.append(time.perf_counter() - t0)

    def figures(self) -> dict:
        def summary(values: list[float]) -> dict:
            return {
                "p50_ms": round(pct(values, 0.5) * 1000, 1),
                "p95_ms": round(pct(values, 0.95) * 1000, 1),
                "mean_ms": round(statistics.fmean(values) * 1000, 1),
            }

        return {
            "first_request": summary(self.first),
            "load": summary(self.load),
            "wait_header": summary(self.waited),
            "warm_request": summary(self.warm),
        }


def run(repo: Path, n: int, work: Path, with_s3: bool) -> dict:
    """Both servers up at once, their rounds alternating, so that both see the same machine."""
    with contextlib.ExitStack() as stack:
        targets = {
            "local": Target(
                stack.enter_context(
                    NaiadProcess(repo, "--model-control-mode", "explicit", "--load-on-demand")
                )
            )
        }
        if with_s3:
            from minio_server import MinioServer

            minio = MinioServer().start()
            stack.callback(minio.stop)
            client = minio.client()
            client.create_bucket(Bucket="models")
            minio.upload_tree(client, "models", "repo", repo)
            cache = work / "cache"
            env = {k: None for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN")} | minio.env(
                AWS_EC2_METADATA_DISABLED="true"
            )
            args = ("--model-control-mode", "explicit", "--load-on-demand", "--storage-cache-dir", str(cache))
            server = stack.enter_context(
                NaiadProcess(f"s3://{minio.host}/models/repo", *args, env=env, timeout=120)
            )
            targets["s3_minio"] = Target(server, lambda: shutil.rmtree(cache / MODEL, ignore_errors=True))
        for _ in range(n):
            for target in targets.values():
                target.round()
        return {name: target.figures() for name, target in targets.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--hidden", default="1024,1024,1024", help="MLP hidden widths (default %(default)s)")
    p.add_argument("--no-s3", action="store_true", help="local disk only")
    args = p.parse_args()
    hidden = tuple(int(w) for w in args.hidden.split(","))
    work = Path(tempfile.mkdtemp(prefix="naiad-cold-"))
    try:
        size = write_model(work / "repo", hidden)
        out = {
            "model": f"ONNX MLP 64-{'-'.join(map(str, hidden))}-16",
            "model_bytes": size,
            "rounds": args.rounds,
        }
        out.update(run(work / "repo", args.rounds, work, not args.no_s3))
        print(json.dumps(out, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
