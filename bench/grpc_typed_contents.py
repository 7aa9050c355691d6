"""Server CPU per gRPC ModelInfer request whose tensor comes in typed contents (`InferTensorContents.fp32_contents`, as
clients built on the raw KServe protos send it) against the same tensor in `raw_input_contents` (tritonclient,
perf_analyzer), one grpcio channel, requests back to back, the trees alternated round by round. `int64_contents`
sends as many INT64 values (token ids below 150,000: varints of 1-3 bytes) to an INT64 identity model.

    .venv/bin/python bench/grpc_typed_contents.py                                  # this tree, 3 rounds
    .venv/bin/python bench/grpc_typed_contents.py --trees .,/tmp/base --rounds 3   # an A/B against a checkout
    .venv/bin/python bench/grpc_typed_contents.py --trees .,triton                  # against the real Triton

Trees, rounds and figures as in tree_rounds.py.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import grpc
import numpy as np
import tree_rounds
from frontend_workers import make_repo
from tritonclient.grpc import service_pb2

MODES = ("raw", "fp32_contents", "int64_contents")


def request(mode: str, values: np.ndarray) -> bytes:
    if mode == "int64_contents":
        req = service_pb2.ModelInferRequest(model_name="identity_int64")
        t = req.inputs.add(name="INPUT0", datatype="INT64", shape=[len(values)])
        ids = np.random.default_rng(1).integers(0, 150_000, len(values))
        t.contents.int64_contents.extend(ids.tolist())
        return req.SerializeToString()
    req = service_pb2.ModelInferRequest(model_name="identity_var")
    t = req.inputs.add(name="INPUT0", datatype="FP32", shape=[len(values)])
    if mode == "raw":
        req.raw_input_contents.append(values.tobytes())
    else:
        t.contents.fp32_contents.extend(values.tolist())
    return req.SerializeToString()


def int64_model(repo: Path) -> None:
    """identity_int64 beside identity_var: the same model over INT64."""
    src, dst = repo / "identity_var", repo / "identity_int64"
    shutil.copytree(src, dst)
    config = (src / "config.pbtxt").read_text().replace("TYPE_FP32", "TYPE_INT64")
    (dst / "config.pbtxt").write_text(config.replace('"identity_var"', '"identity_int64"'))


def measure(server, wire: bytes, seconds: float) -> tuple[float, float]:
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
        return tree_rounds.timed(server, lambda: call(wire), seconds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tree_rounds.add_arguments(ap)
    ap.add_argument("--values", type=int, default=1 << 20, help="FP32 values a request (default 4 MiB)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    args = ap.parse_args()
    modes = tuple(args.modes.split(","))
    values = np.random.default_rng(1).random(args.values, dtype=np.float32)
    wires = {mode: request(mode, values) for mode in modes}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        repo = make_repo(tmp / "repo")
        int64_model(repo)
        tree_rounds.run(
            args.trees,
            args.rounds,
            modes,
            repo,
            tmp,
            lambda server, mode: measure(server, wires[mode], args.duration),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
