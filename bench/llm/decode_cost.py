"""What one `llama_decode` of a sequence costs for k positions against one: the bound on speculative decoding's gain.

A step that verifies a draft of k tokens decodes k + 1 positions of the sequence, each with logits. Speculation
gains only where that costs little more than one position (a memory-bound decode: a larger model, a GPU, many
threads). This times it straight through llama-cpp-python on one sequence after a 64-token prompt, median of 30:

    .venv/bin/python bench/llm/decode_cost.py --model smollm2 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2", help="smollm2, large (tests/llm_models.py) or a GGUF path")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--positions", default="1,2,3,5,8")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    import llama_cpp as lc

    if args.model == "smollm2":
        from real_models import smollm2_gguf

        path = smollm2_gguf()
    elif args.model == "large":
        from llm_models import cached_large_gguf

        path = cached_large_gguf()
    else:
        path = Path(args.model)
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(path).encode(), lc.llama_model_default_params())
    params = lc.llama_context_default_params()
    params.n_ctx, params.n_batch = 1024, 512
    params.n_threads = params.n_threads_batch = args.threads
    ctx = lc.llama_init_from_model(model, params)
    memory = lc.llama_get_memory(ctx)
    batch = lc.llama_batch_init(512, 0, 1)

    def decode(start: int, n: int) -> float:
        batch.n_tokens = n
        for i in range(n):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = 100 + i, start + i, 1, 1
            batch.seq_id[i][0] = 0
        began = time.perf_counter()
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return time.perf_counter() - began

    decode(0, 64)  # the prompt
    one = 0.0
    for k in (int(x) for x in args.positions.split(",")):
        times = []
        for _ in range(args.repeats):
            times.append(decode(64, k))
            lc.llama_memory_seq_rm(memory, 0, 64, -1)
        ms = statistics.median(times) * 1e3
        one = one or ms
        print(f"{path.name} threads {args.threads}: {k} positions {ms:.2f} ms ({ms / one:.2f}x one)")
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)


if __name__ == "__main__":
    main()
