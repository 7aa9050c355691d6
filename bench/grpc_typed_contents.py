"""Server CPU per gRPC ModelInfer request whose tensor comes in typed contents (`InferTensorContents.fp32_contents`, as
clients built on the raw KServe protos send it) against the same tensor in `raw_input_contents` (tritonclient,
perf_analyzer), one grpcio channel, requests back to back, the trees alternated round by round.

    .venv/bin/python bench/grpc_typed_contents.py                                  # this tree, 3 rounds
    .venv/bin/python bench/grpc_typed_contents.py --trees .,/tmp/base --rounds 3   # an A/B against a checkout
    .venv/bin/python bench/grpc_typed_contents.py --trees .,triton                  # against the real Triton

`triton` in `--trees` runs the real Triton 2.51 (tools/triton/, `make test` installs it) on the same repository:
the python identity model, which its python backend runs in a stub process.

A figure is the median over rounds of the server's CPU-seconds per request (all its processes) and of the wall
time per request; the ratio is against the first tree.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import psutil
from frontend_workers import ROOT, Server, free_port, make_repo
from tritonclient.grpc import service_pb2

sys.path.insert(0, str(ROOT))

MODES = ("raw", "fp32_contents")


def request(mode: str, values: np.ndarray) -> bytes:
    req = service_pb2.ModelInferRequest(model_name="identity_var")
    t = req.inputs.add(name="INPUT0", datatype="FP32", shape=[len(values)])
    if mode == "raw":
        req.raw_input_contents.append(values.tobytes())
    else:
        t.contents.fp32_contents.extend(values.tolist())
    return req.SerializeToString()


class Triton:
    """The real Triton on `repo`, with what `measure` asks of a Server."""

    def __init__(self, repo: Path, log: Path):
        from tests.triton_reference import tritonserver

        self.stack = contextlib.ExitStack()
        self.grpc_port = free_port()
        args = ["--exit-on-error=false", "--strict-readiness=false"]
        self.triton = self.stack.enter_context(
            tritonserver(repo, free_port(), self.grpc_port, free_port(), args, timeout=120, log_path=log)
        )

    def cpu_seconds(self) -> tuple[float, float]:
        root = psutil.Process(self.triton.process.pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:  # (the python backend's stub processes)
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total, total

    def stop(self) -> None:
        self.stack.close()


def measure(server: Server | Triton, wire: bytes, seconds: float) -> tuple[float, float]:
    """(server CPU µs, wall µs) per request for about `seconds`."""
    options = [("grpc.max_receive_message_length", 1 << 28), ("grpc.max_send_message_length", 1 << 28)]
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=options) as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda b: b,  # the request is serialized once, outside the measurement
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )
        for _ in range(3):
            call(wire)
        cpu0, n, t0 = server.cpu_seconds()[0], 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            call(wire)
            n += 1
        wall = time.perf_counter() - t0
        cpu = server.cpu_seconds()[0] - cpu0
    return cpu / n * 1e6, wall / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=".", help="comma-separated checkouts whose server code is measured")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per mode and round")
    ap.add_argument("--values", type=int, default=1 << 20, help="FP32 values a request (default 4 MiB)")
    args = ap.parse_args()
    trees = [Path(t) if t == "triton" else Path(t).resolve() for t in args.trees.split(",")]
    values = np.random.default_rng(1).random(args.values, dtype=np.float32)
    wires = {mode: request(mode, values) for mode in MODES}
    results: dict[tuple[Path, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        repo = make_repo(tmp / "repo")
        for r in range(args.rounds):
            for tree in trees if r % 2 == 0 else trees[::-1]:
                if str(tree) == "triton":
                    server: Server | Triton = Triton(repo, tmp / "triton.log")
                else:
                    server = Server(repo, "1", tmp / "server.log", tree)
                try:
                    for mode in MODES:
                        cpu, wall = measure(server, wires[mode], args.duration)
                        results.setdefault((tree, mode), []).append((cpu, wall))
                        print(
                            f"round {r + 1} {tree} {mode:14s} {cpu:9.0f} µs CPU/request {wall:9.0f} µs wall"
                        )
                finally:
                    server.stop()
    print("\nmedians over rounds (ratio: against the first tree)")
    for mode in MODES:
        base = statistics.median(c for c, _ in results[(trees[0], mode)])
        for tree in trees:
            cpu = statistics.median(c for c, _ in results[(tree, mode)])
            wall = statistics.median(w for _, w in results[(tree, mode)])
            print(f"  {mode:14s} {tree!s:24s} {cpu:9.0f} µs CPU ({cpu / base:.2f}x) {wall:9.0f} µs wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
