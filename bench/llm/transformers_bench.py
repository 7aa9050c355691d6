"""The transformers engine two ways on a GPU: in-process (transformers' continuous-batching manager called
directly: the limit) and through `naiad serve` (its `transformers` backend), over Triton's generate extension and
the OpenAI API.

The model is a random-weight llama of a real size (tests/llm_models.py LLAMA_1B: Llama-3.2-1B's shape, 32,000
tokens, bfloat16), made on the GPU and saved once per run; both ways get the same manager settings (sequences per
batch, KV-cache blocks, tokens per forward) and the same load: `--requests` streaming requests per concurrency
level, a fixed prompt, `--max-tokens` generated with ignore_eos, greedy. Reported per level: TTFT p50, ITL (mean
gap between tokens within a request) and output tokens/s, as bench/llm/llamacpp_bench.py reports them (its client
and levels are reused); the ways alternate per level.

    python bench/llm/transformers_bench.py --concurrency 1,8,32 --max-tokens 128     # on a GPU machine
    python bench/llm/transformers_bench.py --device cpu --shape tiny --concurrency 1,4  # plumbing check, no GPU
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench" / "llm"), str(ROOT / "server"), str(ROOT / "tests")]

from helpers import NaiadProcess  # noqa: E402
from llamacpp_bench import (  # noqa: E402
    PROMPT,
    Level,
    _post,
    _print,
    append_rows,
    completions_body,
    generate_stream_body,
    run_level,
)
from llm_models import LLAMA_1B, write_sized_hf_llama, write_tiny_hf_llama  # noqa: E402

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 1024,
}


def manager_settings(args) -> dict[str, int]:
    return {
        "max_num_seqs": args.max_num_seqs,
        "num_blocks": args.num_blocks,
        "block_size": 32,
        "max_batch_tokens": args.max_batch_tokens,
    }


class InProcess:
    """transformers' ContinuousBatchingManager in this process, configured as Naiad's backend configures it, its
    results delivered on an asyncio loop thread as in the backend; a token is stamped when its result arrives."""

    name = "inproc"

    def __init__(self, folder: Path, args):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from naiad.backends.transformers.generation import start_manager

        dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
        self.tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(args.device).eval()
        self.manager = start_manager(model, manager_settings(args), pad_token_id=0, eos_token_id=2)
        self.prompt = list(self.tokenizer(PROMPT)["input_ids"])
        self.max_tokens = args.max_tokens
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self._ids = itertools.count()

    async def _generate(self, rid: str, stamps: list[float]) -> None:
        results: asyncio.Queue = asyncio.Queue()
        self.manager.register_result_handler(rid, results.put_nowait)
        self.manager.add_request(
            list(self.prompt),
            request_id=rid,
            max_new_tokens=self.max_tokens,
            streaming=True,
            eos_token_id=-1,
            temperature=1.0,
            top_k=1,
            top_p=1.0,
        )
        seen = 0
        while True:
            result = await results.get()
            if result.error:
                raise RuntimeError(result.error)
            n = len(result.generated_tokens)
            stamps.extend([time.perf_counter()] * (n - seen))
            seen = n
            if result.is_finished():
                return

    def one(self, level: Level) -> None:
        rid = f"bench-{next(self._ids)}"
        stamps: list[float] = []
        sent = time.perf_counter()
        asyncio.run_coroutine_threadsafe(self._generate(rid, stamps), self.loop).result()
        level.add(sent, stamps)

    def close(self) -> None:
        self.manager.stop(block=False)  # (a blocking stop waited forever on a GPU; the process exits next)
        self.loop.call_soon_threadsafe(self.loop.stop)


class NaiadServer:
    """One `naiad serve` with the model on the transformers backend; the ways below share it."""

    def __init__(self, folder: Path, args):
        self.repo = Path(tempfile.mkdtemp(prefix="transformers-bench-"))
        (self.repo / "llm").mkdir()
        (self.repo / "llm" / "1").symlink_to(folder)
        params = {**manager_settings(args), "dtype": "float32" if args.device == "cpu" else "bfloat16"}
        kind = "KIND_CPU" if args.device == "cpu" else "KIND_GPU"
        (self.repo / "llm" / "config.pbtxt").write_text(
            f'backend: "transformers"\ninstance_group [ {{ kind: {kind} count: 1 }} ]\n'
            + "".join(
                f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params.items()
            )
        )
        extra = ("--frontend-workers", str(args.frontend_workers))
        self.proc = NaiadProcess(self.repo, *extra, timeout=600).start()


class Naiad:
    """Triton's generate extension, streamed (`/v2/models/llm/generate_stream`, vLLM shape)."""

    name = "naiad"

    def __init__(self, server: NaiadServer, args):
        self.url = f"{server.proc.url}/v2/models/llm/generate_stream"
        self.body = generate_stream_body(args.max_tokens)
        self.local = threading.local()

    def one(self, level: Level) -> None:
        _post(self, level)

    def close(self) -> None:
        pass


class NaiadOpenAI(Naiad):
    """The OpenAI API, `/v1/completions` streamed."""

    name = "naiad-openai"

    def __init__(self, server: NaiadServer, args):
        super().__init__(server, args)
        self.url = f"{server.proc.url}/v1/completions"
        self.body = completions_body(args.max_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=["1b", "tiny"], default="1b")
    ap.add_argument("--device", default="cuda", help="cuda (KIND_GPU) or cpu (KIND_CPU, float32)")
    ap.add_argument("--ways", default="inproc,naiad,naiad-openai")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument(
        "--requests", type=int, default=0, help="per level (default: max(--min-requests, 2 x concurrency))"
    )
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=512, help="KV-cache blocks of 32 tokens")
    ap.add_argument("--max-batch-tokens", type=int, default=512)
    ap.add_argument("--frontend-workers", type=int, default=1)
    ap.add_argument("--out", default="", help="append the rows as JSON lines to this file")
    args = ap.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="transformers-bench-model-"))
    t0 = time.perf_counter()
    if args.shape == "tiny" and args.device == "cpu":
        write_tiny_hf_llama(folder, byte_level=True)
    else:
        write_sized_hf_llama(folder, LLAMA_1B if args.shape == "1b" else TINY, device=args.device)
    print(f"model {args.shape} written in {time.perf_counter() - t0:.1f} s", flush=True)
    names = args.ways.split(",")
    server = NaiadServer(folder, args) if any(n.startswith("naiad") for n in names) else None
    makers = {
        "inproc": lambda: InProcess(folder, args),
        "naiad": lambda: Naiad(server, args),
        "naiad-openai": lambda: NaiadOpenAI(server, args),
    }
    ways = [makers[n]() for n in names]
    rows = []
    try:
        for way in ways:  # warm up: the first requests start threads and compile kernels
            run_level(2, 2, way.one)
        for r, c in enumerate(int(c) for c in args.concurrency.split(",")):
            n = args.requests or max(args.min_requests, 2 * c)
            for way in ways if r % 2 == 0 else ways[::-1]:
                row = {
                    "model": args.shape,
                    "way": way.name,
                    "concurrency": c,
                    "round": 0,
                    **run_level(c, n, way.one),
                }
                rows.append(row)
                _print(row)
    finally:
        for way in ways:
            way.close()
        if server is not None:
            server.proc.stop()
    append_rows(args.out, rows)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)  # not waiting for the in-process manager's threads
