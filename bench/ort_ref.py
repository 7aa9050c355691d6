"""Raw in-process onnxruntime reference for the benchmark MLP (the "physical" throughput bound).

Times ``InferenceSession.run`` at each requested batch size, single-threaded (intra/inter-op 1,
sequential execution), in this process. ``bench/run.py`` starts it under ``taskset -c 0`` (the
core the servers run on) and combines the per-batch times with the batch-size distribution the
server's dynamic batcher formed.

    taskset -c 0 python bench/ort_ref.py --model bench/models/repo/mlp/1/model.onnx --batch-sizes 1,8,64

prints one JSON object: {"seconds_per_run": {"<b>": s, ...}, "onnxruntime": version, ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


def measure(session, batch: int, min_time: float, repeats: int, features: int) -> float:
    x = np.random.default_rng(batch).random((batch, features), dtype=np.float32)
    feed = {"INPUT0": x}
    run = session.run
    for _ in range(5):
        run(["OUTPUT0"], feed)
    per_run = []
    for _ in range(repeats):
        n = 0
        t0 = time.perf_counter()
        while True:
            run(["OUTPUT0"], feed)
            n += 1
            dt = time.perf_counter() - t0
            if dt >= min_time and n >= 3:
                break
        per_run.append(dt / n)
    return statistics.median(per_run)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--batch-sizes", required=True, help="comma-separated batch sizes")
    p.add_argument("--min-time", type=float, default=0.15, help="seconds per timing repeat")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.log_severity_level = 3
    sess = ort.InferenceSession(args.model, opts, providers=["CPUExecutionProvider"])
    features = sess.get_inputs()[0].shape[1]
    sizes = sorted({int(b) for b in args.batch_sizes.split(",") if b.strip()})
    out = {
        "seconds_per_run": {str(b): measure(sess, b, args.min_time, args.repeats, features) for b in sizes},
        "onnxruntime": ort.__version__,
        "affinity": sorted(os.sched_getaffinity(0)),
        "intra_op_num_threads": 1,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
