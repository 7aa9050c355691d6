"""The llama.cpp engine three ways: in-process (the limit), through `naiad serve`, and llama.cpp's own `llama-server`.

Every way gets the same GGUF (tests/llm_models.py: the tiny model or the larger one whose decode step takes ~10 ms),
the same slots (`n_parallel` / `-np`), threads and context per slot, and the same load: `--requests` streaming
requests per concurrency level, a fixed prompt, `--max-tokens` generated with ignore_eos at temperature 0. The
servers are driven by one client (Python threads reading SSE over HTTP/1.1 keep-alive): Naiad's
`/v2/models/<m>/generate_stream` (Triton's generate extension, vLLM shape) and llama-server's `/completion`.
Reported per level: TTFT p50 (request sent -> first token), ITL (mean gap between tokens within a request) and
output tokens/s (all tokens / wall time of the level). The ways alternate per level so that the shared machine's
drift lands on all of them.

    .venv/bin/python bench/llm/llamacpp_bench.py --model large --concurrency 1,8,32 --ways inproc,naiad,llama-server
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "server"), str(ROOT / "tests")]

from helpers import NaiadProcess, free_ports  # noqa: E402
from llm_models import cached_large_gguf, write_tiny_gguf  # noqa: E402

PROMPT = (
    "Once upon a time there was a model that generated tokens one at a time, and the server streamed them"
)


class Level:
    """What one concurrency level measured: per-request TTFT and token times."""

    def __init__(self):
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.tokens = 0
        self.lock = threading.Lock()

    def add(self, sent: float, stamps: list[float]) -> None:
        with self.lock:
            if stamps:
                self.ttft.append(stamps[0] - sent)
                self.itl.extend(b - a for a, b in itertools.pairwise(stamps))
            self.tokens += len(stamps)

    def row(self, wall: float) -> dict:
        return {
            "ttft_p50_ms": 1000 * statistics.median(self.ttft) if self.ttft else float("nan"),
            "itl_ms": 1000 * statistics.mean(self.itl) if self.itl else float("nan"),
            "tok_s": self.tokens / wall,
            "requests": len(self.ttft),
        }


def run_level(concurrency: int, n_requests: int, one) -> dict:
    """`n_requests` calls of `one(level)` from `concurrency` threads; the level's figures."""
    level = Level()
    todo = list(range(n_requests))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                todo.pop()
            one(level)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return level.row(time.perf_counter() - t0)


# ---- the three ways ----
class InProcess:
    name = "inproc"

    def __init__(self, gguf: Path, args):
        from naiad.backends.llamacpp.engine import LlamaEngine
        from naiad.backends.llamacpp.params import EngineSettings

        self.engine = LlamaEngine(
            gguf, EngineSettings(n_ctx=args.n_ctx, n_parallel=args.slots, n_threads=args.threads, n_batch=512)
        )
        self.prompt = self.engine.tokenize(PROMPT)
        self.max_tokens = args.max_tokens

    def one(self, level: Level) -> None:
        from naiad.backends.llamacpp.engine import GenerationRequest
        from naiad.backends.llamacpp.params import SamplingParams

        done = threading.Event()
        stamps: list[float] = []

        def emit(o):
            stamps.append(time.perf_counter())
            if o.finish_reason is not None:
                done.set()

        sent = time.perf_counter()
        sp = SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.submit(GenerationRequest(list(self.prompt), sp, emit, lambda e: done.set()))
        done.wait()
        level.add(sent, stamps)

    def close(self):
        self.engine.close()


def _sse_stamps(resp) -> list[float]:
    stamps = []
    for line in resp.iter_lines():
        if line.startswith(b"data: ") and line[6:] != b"[DONE]":
            event = json.loads(line[6:])
            n = event.get("num_output_tokens")
            if n is None:  # llama-server's `content`, or an OpenAI chunk's text: a token each
                choices = event.get("choices") or [{}]
                n = 1 if event.get("content") or event.get("text_output") or choices[0].get("text") else 0
            stamps.extend([time.perf_counter()] * int(n))
    return stamps


def _post(way, level: Level) -> None:
    """One streaming request on this thread's keep-alive session; a connection the server closed while idle is
    opened again (llama-server drops idle keep-alive connections)."""
    for attempt in range(2):
        session = getattr(way.local, "session", None) or requests.Session()
        way.local.session = session
        sent = time.perf_counter()
        try:
            with session.post(way.url, json=way.body, stream=True, timeout=600) as r:
                r.raise_for_status()
                level.add(sent, _sse_stamps(r))
                return
        except requests.ConnectionError:
            way.local.session = None
            if attempt:
                raise


class Naiad:
    name = "naiad"
    server_args: tuple[str, ...] = ()

    def __init__(self, gguf: Path, args):
        self.repo = Path(tempfile.mkdtemp(prefix="llm-bench-"))
        (self.repo / "llm" / "1").mkdir(parents=True)
        os.symlink(gguf, self.repo / "llm" / "1" / "model.gguf")
        params = {"n_ctx": args.n_ctx, "n_parallel": args.slots, "n_threads": args.threads}
        (self.repo / "llm" / "config.pbtxt").write_text(
            'backend: "llamacpp"\n'
            + "".join(
                f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params.items()
            )
        )
        self.proc = NaiadProcess(self.repo, *self.server_args, timeout=300).start()
        self.url = f"{self.proc.url}/v2/models/llm/generate_stream"
        self.body = {
            "text_input": PROMPT,
            "stream": True,
            "exclude_input_in_output": True,
            "return_num_output_tokens": True,
            "sampling_parameters": json.dumps(
                {"max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
            ),
        }
        self.local = threading.local()

    def one(self, level: Level) -> None:
        _post(self, level)

    def close(self):
        self.proc.stop()


class NaiadNoPoll(Naiad):
    """Naiad with busy polling off (`--busy-poll-us 0`): the event loop sleeps as soon as it is idle."""

    name = "naiad-nopoll"
    server_args = ("--busy-poll-us", "0")


class NaiadWorkers(Naiad):
    """Naiad with two frontend worker processes in front of the engine process (`--frontend-workers 2`)."""

    name = "naiad-w2"
    server_args = ("--frontend-workers", "2")


class NaiadOpenAI(Naiad):
    """Naiad's OpenAI API, `/v1/completions` streamed (a token per chunk; a token that decodes to no text yet is
    counted with the chunk that carries it)."""

    name = "naiad-openai"

    def __init__(self, gguf: Path, args):
        super().__init__(gguf, args)
        self.url = f"{self.proc.url}/v1/completions"
        self.body = {
            "model": "llm",
            "prompt": PROMPT,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }


class NaiadOpenAIWorkers(NaiadOpenAI):
    name = "naiad-openai-w2"
    server_args = ("--frontend-workers", "2")


class LlamaServer:
    name = "llama-server"

    def __init__(self, gguf: Path, args):
        binary = Path(args.llama_server) if args.llama_server else _llama_server()
        (port,) = free_ports(1)
        cmd = [
            str(binary),
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-c",
            str(args.n_ctx * args.slots),
            "-np",
            str(args.slots),
            "-t",
            str(args.threads),
            "-tb",
            str(args.threads),
            "-b",
            "512",
            "-ub",
            "512",
            "--no-webui",
            "--log-disable",
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}/completion"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.body = {
            "prompt": PROMPT,
            "n_predict": args.max_tokens,
            "stream": True,
            "ignore_eos": True,
            "temperature": 0,
            "cache_prompt": True,
        }
        self.local = threading.local()

    def one(self, level: Level) -> None:
        _post(self, level)

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


def _llama_server() -> Path:
    out = subprocess.run(
        ["bash", str(ROOT / "tools/llama_cpp/build.sh"), "servers"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip().splitlines()[-1]) / "bin" / "llama-server"


WAYS = {
    "inproc": InProcess,
    "naiad": Naiad,
    "naiad-nopoll": NaiadNoPoll,
    "naiad-w2": NaiadWorkers,
    "naiad-openai": NaiadOpenAI,
    "naiad-openai-w2": NaiadOpenAIWorkers,
    "llama-server": LlamaServer,
}


def _print(row: dict) -> None:
    print(
        f"{row['model']:5} c{row['concurrency']:<3} {row['way']:13} round {row['round']!s:6} "
        f"TTFT p50 {row['ttft_p50_ms']:8.1f} ms  ITL {row['itl_ms']:7.2f} ms  {row['tok_s']:8.1f} tok/s  "
        f"({row['requests']} requests)",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "large"], default="large")
    ap.add_argument("--ways", default="inproc,naiad,llama-server")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--requests", type=int, default=0, help="per level (default: max(8, 2 x concurrency))")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=512, help="context per slot")
    ap.add_argument("--llama-server", default="", help="the llama-server binary (default: the tools cache)")
    ap.add_argument(
        "--rounds", type=int, default=1, help="repeat each level, the ways alternating; medians reported"
    )
    ap.add_argument("--out", default="", help="append the rows as JSON lines to this file")
    args = ap.parse_args()

    if args.model == "tiny":
        gguf = write_tiny_gguf(Path(tempfile.mkdtemp(prefix="llm-bench-")) / "tiny.gguf")
    else:
        gguf = cached_large_gguf()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers started below on a kill too
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    ways = [WAYS[w](gguf, args) for w in args.ways.split(",")]
    try:
        for way in ways:  # warm up: the first requests fill caches and start threads
            run_level(2, 2, way.one)
        for c in levels:
            n = args.requests or max(8, 2 * c)
            per_way: dict[str, list[dict]] = {w.name: [] for w in ways}
            for r in range(args.rounds):
                order = ways if r % 2 == 0 else ways[::-1]
                for way in order:
                    row = {
                        "model": args.model,
                        "way": way.name,
                        "concurrency": c,
                        "round": r,
                        **run_level(c, n, way.one),
                    }
                    per_way[way.name].append(row)
                    rows.append(row)
                    _print(row)
            if args.rounds > 1:
                for way in ways:
                    got = per_way[way.name]
                    med = {
                        k: statistics.median(x[k] for x in got) for k in ("ttft_p50_ms", "itl_ms", "tok_s")
                    }
                    _print(
                        {
                            "model": args.model,
                            "way": way.name,
                            "concurrency": c,
                            "round": "median",
                            "requests": sum(x["requests"] for x in got),
                            **med,
                        }
                    )
    finally:
        for way in ways:
            way.close()
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
