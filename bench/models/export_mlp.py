"""Export the benchmark MLP (Linear+ReLU layers, 64 input features) to ONNX with onnx.helper.

Weights are seeded (reproducible). The graph is written to <repo>/mlp/1/model.onnx and
<repo>/mlp_batched/1/model.onnx (same bytes; the configs differ only in dynamic_batching).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

IN_FEATURES = 64
HIDDEN = (1024, 1024, 1024)
OUT_FEATURES = 16


def build_model(hidden=HIDDEN, seed: int = 0):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    prev, width = "INPUT0", IN_FEATURES
    sizes = list(hidden) + [OUT_FEATURES]
    for i, size in enumerate(sizes):
        w = (rng.standard_normal((width, size)) / np.sqrt(width)).astype(np.float32)
        b = (rng.standard_normal(size) * 0.01).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"W{i}"), numpy_helper.from_array(b, f"B{i}")]
        nodes.append(helper.make_node("Gemm", [prev, f"W{i}", f"B{i}"], [f"h{i}"]))
        last = i == len(sizes) - 1
        out = "OUTPUT0" if last else f"r{i}"
        if last:
            nodes[-1].output[0] = out
        else:
            nodes.append(helper.make_node("Relu", [f"h{i}"], [out]))
        prev, width = out, size
    graph = helper.make_graph(
        nodes,
        "bench_mlp",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", IN_FEATURES])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", OUT_FEATURES])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="naiad-bench")
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repo", default=str(Path(__file__).resolve().parent / "repo"))
    p.add_argument(
        "--hidden",
        default=",".join(map(str, HIDDEN)),
        help="hidden layer widths, comma-separated (default %(default)s)",
    )
    args = p.parse_args()
    hidden = tuple(int(w) for w in args.hidden.split(","))
    data = build_model(hidden).SerializeToString()
    for name in ("mlp", "mlp_batched"):
        dst = Path(args.repo) / name / "1" / "model.onnx"
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists() or dst.read_bytes() != data:
            dst.write_bytes(data)
    print(f"export_mlp: hidden {hidden}, {len(data)} bytes -> {args.repo}/mlp{{,_batched}}/1/model.onnx")


if __name__ == "__main__":
    main()
