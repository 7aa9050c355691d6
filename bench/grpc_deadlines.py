"""Server CPU per small gRPC ModelInfer call whose `grpc-timeout` differs from the last call's, against the same call
without a deadline: one grpcio channel, calls back to back, the trees alternated round by round. grpc-go and
grpc-java send the time left in microseconds ("29999830u"), a new value at every call; grpcio rounds (a 30 s
deadline is "30S" every time) but sends milliseconds under a few seconds, so here each call's deadline is a
different number of milliseconds between 0.5 and 1 s. Each client sends the value as a literal its HPACK table
keeps: the header block is new at every call and the table changes.

    .venv/bin/python bench/grpc_deadlines.py                                  # this tree, 3 rounds
    .venv/bin/python bench/grpc_deadlines.py --trees .,/tmp/base --rounds 3   # an A/B against a checkout
    .venv/bin/python bench/grpc_deadlines.py --trees .,triton                  # against the real Triton

Trees, rounds and figures as in tree_rounds.py.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

import grpc
import numpy as np
import tree_rounds
from frontend_workers import make_repo
from tritonclient.grpc import service_pb2

MODES = ("no_deadline", "deadline")


def measure(server, mode: str, values: int, seconds: float) -> tuple[float, float]:
    """(server CPU µs, wall µs) per call for about `seconds`."""
    req = service_pb2.ModelInferRequest(model_name="identity_var")
    req.inputs.add(name="INPUT0", datatype="FP32", shape=[values])
    req.raw_input_contents.append(np.arange(values, dtype=np.float32).tobytes())
    wire = req.SerializeToString()
    calls = itertools.count()
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
        call = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer",
            request_serializer=lambda b: b,  # serialized once, outside the measurement
            response_deserializer=service_pb2.ModelInferResponse.FromString,
        )

        def one() -> None:
            call(wire, timeout=0.5 + next(calls) % 500 / 1000 if mode == "deadline" else None)

        for _ in range(3):
            one()
        return tree_rounds.timed(server, one, seconds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tree_rounds.add_arguments(ap)
    ap.add_argument("--values", type=int, default=16, help="FP32 values a request (default 16)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tree_rounds.run(
            args.trees,
            args.rounds,
            tuple(args.modes.split(",")),
            make_repo(tmp / "repo"),
            tmp,
            lambda server, mode: measure(server, mode, args.values, args.duration),
            # one process, no busy polling: at c1 the poll's spin between a Python client's calls (up to 200 µs)
            # would be most of the CPU counted a call, and the same in both modes
            setting="1 --busy-poll-us 0",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
