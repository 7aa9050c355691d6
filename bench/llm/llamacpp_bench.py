"""The llama.cpp engine three ways: in-process (the limit), through `naiad serve`, and llama.cpp's own `llama-server`.

Every way gets the same GGUF (tests/llm_models.py: the tiny model or the larger one whose decode step takes ~10 ms),
the same slots (`n_parallel` / `-np`), threads and context per slot, and the same load: `--requests` streaming
requests per concurrency level, a fixed prompt, `--max-tokens` generated with ignore_eos at temperature 0. The
servers are driven by one client (Python threads reading SSE over HTTP/1.1 keep-alive): Naiad's
`/v2/models/<m>/generate_stream` (Triton's generate extension, vLLM shape) and llama-server's `/completion`.
Reported per level: TTFT p50 (request sent -> first token whose text is out), ITL (mean gap between tokens within
a request) and output tokens/s (all tokens / wall time of the level). The ways alternate per level so that the
shared machine's drift lands on all of them. `--client raw` reads the streams straight from sockets;
`--baseline DIR` adds way naiad-base (another checkout's Naiad) for an A/B in the same run.

`--spec none,self,layers,random,ngram` runs every way once per speculative decoding setting (way `naiad+ngram`, ...):
`self` the model as its own draft, `layers` its first `--draft-layers` blocks as the draft (a layer-skip model
written from the GGUF), `random` a tiny random model with its tokenizer, `ngram` prompt lookup (`--ngram`); each
drafts at most `--spec-max` tokens (a draft model stops below `--p-min`). The rows then add the acceptance rate
(accepted / drafted tokens) and the mean acceptance length (1 + accepted / drafts), from the engine's counters (the
servers': vllm:spec_decode_* on /metrics).
`--prompt repeat` is a prompt whose continuation repeats it (where prompt lookup finds something).

    .venv/bin/python bench/llm/llamacpp_bench.py --model large --concurrency 1,8,32 --ways inproc,naiad,llama-server
    .venv/bin/python bench/llm/llamacpp_bench.py --model smollm2 --ways inproc --spec none,self,ngram --rounds 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import socket
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
from llm_models import (  # noqa: E402
    cached_large_gguf,
    write_random_like_gguf,
    write_tiny_gguf,
    write_truncated_gguf,
)

PROMPTS = {
    "story": "Once upon a time there was a model that generated tokens one at a time, and the server streamed them",
    # what a model continues by repeating it: prompt lookup's case (code edits, quoting, lists)
    "repeat": (
        "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. "
        "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. "
        "Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. Monday,"
    ),
}
PROMPT = PROMPTS["story"]  # --prompt
CLIENT = "requests"  # --client
SPEC_COUNTERS = ("drafts", "draft_tokens", "accepted")


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

    def __init__(self, gguf: Path, args, spec: dict[str, str] | None = None):
        from naiad.backends.llamacpp.engine import LlamaEngine
        from naiad.backends.llamacpp.params import engine_settings

        params = {"n_ctx": args.n_ctx, "n_parallel": args.slots, "n_threads": args.threads, "n_batch": 512}
        settings = engine_settings({k: str(v) for k, v in {**params, **(spec or {})}.items()})
        self.engine = LlamaEngine(gguf, settings)
        self.prompt = self.engine.tokenize(PROMPT)
        self.max_tokens = args.max_tokens

    def spec_counts(self) -> tuple[int, ...] | None:
        s = self.engine.speculator
        return None if s is None else tuple(getattr(s, k) for k in SPEC_COUNTERS)

    def one(self, level: Level) -> None:
        from naiad.backends.llamacpp.engine import GenerationRequest
        from naiad.backends.llamacpp.params import SamplingParams

        done = threading.Event()
        stamps: list[float] = []
        held = [0]

        def emit(o):
            # stamped when its text is out, as the servers stream it: a token that is no text yet (part of a
            # UTF-8 character: the larger model's first two are) is stamped with the next one that has text
            held[0] += o.tokens
            if o.text or o.finish_reason is not None:
                stamps.extend([time.perf_counter()] * held[0])
                held[0] = 0
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


class _RawStream:
    """A streamed HTTP/1.1 answer read straight from the socket (`--client raw`): `iter_lines()` as requests
    gives it, without requests' and urllib3's layers (about 1 ms of client time per request on this machine,
    which the in-process way does not pay), so TTFT and ITL measure the server more than the client."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = b""
        self.reusable = True

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise requests.ConnectionError("the server closed the connection")
        self.buf += data

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _body(self):
        """The body as it arrives: chunked, by Content-Length, or until the connection closes."""
        status = self._line()
        if int(status.split()[1]) >= 400:
            raise requests.HTTPError(status.decode())
        headers = {}
        while line := self._line():
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip().lower()
        self.reusable = headers.get(b"connection") != b"close"
        if headers.get(b"transfer-encoding") == b"chunked":
            while True:
                n = int(self._line().split(b";")[0], 16)
                while len(self.buf) < n + 2:
                    self._fill()
                piece, self.buf = self.buf[:n], self.buf[n + 2 :]
                if n == 0:
                    return
                yield piece
        length = headers.get(b"content-length")
        if length is not None:
            left = int(length)
            while left > 0:
                if not self.buf:
                    self._fill()
                piece, self.buf = self.buf[:left], self.buf[left:]
                left -= len(piece)
                yield piece
            return
        self.reusable = False
        yield self.buf
        while data := self.sock.recv(65536):
            yield data

    def iter_lines(self):
        pending = b""
        for piece in self._body():
            pending += piece
            *lines, pending = pending.split(b"\n")
            for line in lines:
                yield line.rstrip(b"\r")
        if pending:
            yield pending


def _post_raw(way, level: Level) -> None:
    for attempt in range(2):
        sock = getattr(way.local, "sock", None)
        if sock is None:
            host, port = way.url.split("/")[2].rsplit(":", 1)
            sock = way.local.sock = socket.create_connection((host, int(port)))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            way.local.head = (
                f"POST /{way.url.split('/', 3)[3]} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                "Content-Type: application/json\r\n"
            ).encode()
        body = json.dumps(way.body).encode()
        sent = time.perf_counter()
        try:
            sock.sendall(way.local.head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            stream = _RawStream(sock)
            level.add(sent, _sse_stamps(stream))
            if not stream.reusable:
                sock.close()
                way.local.sock = None
            return
        except (requests.ConnectionError, OSError):
            sock.close()
            way.local.sock = None
            if attempt:
                raise


def _post(way, level: Level) -> None:
    """One streaming request on this thread's keep-alive session; a connection the server closed while idle is
    opened again (llama-server drops idle keep-alive connections)."""
    if CLIENT == "raw":
        return _post_raw(way, level)
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


def generate_stream_body(max_tokens: int) -> dict:
    """A streamed generate-extension request in the vLLM shape: the prompt, `max_tokens` greedy with ignore_eos."""
    sampling = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return {
        "text_input": PROMPT,
        "stream": True,
        "exclude_input_in_output": True,
        "return_num_output_tokens": True,
        "sampling_parameters": json.dumps(sampling),
    }


def completions_body(max_tokens: int) -> dict:
    """The same as a streamed OpenAI `/v1/completions` request to model `llm`."""
    return {
        "model": "llm",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


class Naiad:
    name = "naiad"
    server_args: tuple[str, ...] = ()
    server_env: dict[str, str] | None = None

    def __init__(self, gguf: Path, args, spec: dict[str, str] | None = None):
        self.repo = Path(tempfile.mkdtemp(prefix="llm-bench-"))
        (self.repo / "llm" / "1").mkdir(parents=True)
        os.symlink(gguf, self.repo / "llm" / "1" / "model.gguf")
        params = {"n_ctx": args.n_ctx, "n_parallel": args.slots, "n_threads": args.threads, **(spec or {})}
        (self.repo / "llm" / "config.pbtxt").write_text(
            'backend: "llamacpp"\n'
            + "".join(
                f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}\n' for k, v in params.items()
            )
        )
        self.proc = NaiadProcess(self.repo, *self.server_args, env=self.server_env, timeout=300).start()
        self.url = f"{self.proc.url}/v2/models/llm/generate_stream"
        self.body = generate_stream_body(args.max_tokens)
        self.local = threading.local()

    def one(self, level: Level) -> None:
        _post(self, level)

    def spec_counts(self) -> tuple[int, ...] | None:
        """vllm:spec_decode_*_total of the model on /metrics (None: the server does not speculate)."""
        text = requests.get(f"http://{self.proc.metrics}/metrics", timeout=10).text
        found = {}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            for key, metric in (
                ("drafts", "vllm:spec_decode_num_drafts_total"),
                ("draft_tokens", "vllm:spec_decode_num_draft_tokens_total"),
                ("accepted", "vllm:spec_decode_num_accepted_tokens_total"),
            ):
                if name.startswith(metric + "{"):
                    found[key] = int(float(value))
        return tuple(found[k] for k in SPEC_COUNTERS) if len(found) == 3 else None

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

    def __init__(self, gguf: Path, args, spec: dict[str, str] | None = None):
        super().__init__(gguf, args, spec)
        self.url = f"{self.proc.url}/v1/completions"
        self.body = completions_body(args.max_tokens)


class NaiadOpenAIWorkers(NaiadOpenAI):
    name = "naiad-openai-w2"
    server_args = ("--frontend-workers", "2")


def _baseline(checkout: Path) -> type[Naiad]:
    """`--baseline DIR`: way `naiad-base`, Naiad as another checkout's server/ has it (a git worktree of main), for
    an A/B in the same run; the ways alternate as any others do."""
    server = Path(checkout).resolve() / "server"
    if not (server / "naiad").is_dir():
        raise SystemExit(f"--baseline {checkout}: no server/naiad there")
    return type("NaiadBase", (Naiad,), {"name": "naiad-base", "server_env": {"PYTHONPATH": str(server)}})


class LlamaServer:
    name = "llama-server"

    def __init__(self, gguf: Path, args, spec: dict[str, str] | None = None):
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
            *_llama_server_spec(spec or {}),
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

    def spec_counts(self) -> tuple[int, ...] | None:
        return None  # (llama-server logs its acceptance; it exports no counters)

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


def _llama_server_spec(spec: dict[str, str]) -> list[str]:
    """The same speculation for llama-server: -md for a draft model, ngram-simple for prompt lookup."""
    out = []
    if spec.get("speculative_model"):
        out += ["-md", spec["speculative_model"], "-td", "1"]
    if spec.get("speculative_ngram"):
        out += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", spec["speculative_ngram"]]
        out += ["--spec-ngram-simple-size-m", spec.get("speculative_max", "4")]
    if "speculative_max" in spec:
        out += ["--spec-draft-n-max", spec["speculative_max"]]
    return out


def _cpus(spec: str) -> set[int]:
    """'0', '0-3' or '0,2' -> the CPU numbers."""
    out: set[int] = set()
    for part in spec.split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` and of its child processes onto `cpus` (threads started later inherit it)."""
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), cpus)
        children = Path(f"/proc/{pid}/task/{task}/children")
        for child in children.read_text().split() if children.exists() else []:
            _pin(int(child), cpus)


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


def append_rows(path: str, rows: list[dict]) -> None:
    """`--out`: the rows as JSON lines, appended (nothing without a path)."""
    if path:
        with open(path, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


def _print(row: dict) -> None:
    spec = ""
    if row.get("accept_pct") is not None:
        spec = f"  accepted {row['accept_pct']:5.1f}% mean length {row['mean_accept_len']:.2f}"
    print(
        f"{row['model']:5} c{row['concurrency']:<3} {row['way']:13} round {row['round']!s:6} "
        f"TTFT p50 {row['ttft_p50_ms']:8.1f} ms  ITL {row['itl_ms']:7.2f} ms  {row['tok_s']:8.1f} tok/s  "
        f"({row['requests']} requests){spec}",
        flush=True,
    )


def spec_settings(args, gguf: Path, names: str) -> dict[str, dict[str, str]]:
    """`--spec`: the speculative_* parameters of each setting (drafts written next to the model's temporary copy)."""
    out: dict[str, dict[str, str]] = {}
    common = {"speculative_max": str(args.spec_max)}
    drafting = {**common, "speculative_p_min": str(args.p_min)}
    work = Path(tempfile.mkdtemp(prefix="llm-bench-draft-"))
    for name in names.split(","):
        if name == "none":
            out[name] = {}
        elif name == "self":
            out[name] = {"speculative_model": str(gguf), **drafting}
        elif name == "layers":
            draft = write_truncated_gguf(work / f"layers{args.draft_layers}.gguf", gguf, args.draft_layers)
            out[name] = {"speculative_model": str(draft), **drafting}
        elif name == "random":
            out[name] = {
                "speculative_model": str(write_random_like_gguf(work / "random.gguf", gguf)),
                **drafting,
            }
        elif name == "ngram":
            out[name] = {"speculative_ngram": str(args.ngram), "speculative_ngram_min": "1", **common}
        else:
            raise SystemExit(f"--spec: unknown setting {name!r} (none, self, layers, random, ngram)")
    return out


def _spec_row(before, after) -> dict:
    if before is None or after is None:
        return {}
    drafts, drafted, accepted = (b - a for a, b in zip(before, after))
    return {
        "drafts": drafts,
        "draft_tokens": drafted,
        "accepted": accepted,
        "accept_pct": 100.0 * accepted / drafted if drafted else 0.0,
        "mean_accept_len": 1.0 + accepted / drafts if drafts else 1.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "large", "smollm2"], default="large")
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
    ap.add_argument(
        "--client",
        choices=["requests", "raw"],
        default="requests",
        help="the servers' HTTP client: requests (default), or raw sockets (less client time in TTFT and ITL)",
    )
    ap.add_argument(
        "--baseline", default="", help="a checkout (git worktree) whose Naiad runs as way naiad-base"
    )
    ap.add_argument(
        "--spec",
        default="none",
        help="speculative decoding settings: none,self,layers,random,ngram (each way each)",
    )
    ap.add_argument(
        "--pin",
        default="",
        metavar="SERVER:CLIENT",
        help="CPU lists: the servers' every thread on SERVER, this process (the client) on CLIENT, e.g. 0:1 "
        "(the in-process way's engine then runs on CLIENT too)",
    )
    ap.add_argument("--spec-max", type=int, default=4, help="speculative_max: draft tokens per step")
    ap.add_argument("--draft-layers", type=int, default=4, help="--spec layers: the draft's blocks")
    ap.add_argument("--p-min", type=float, default=0.0, help="speculative_p_min of the draft models")
    ap.add_argument("--ngram", type=int, default=3, help="--spec ngram: speculative_ngram")
    ap.add_argument("--prompt", choices=sorted(PROMPTS), default="story")
    args = ap.parse_args()
    global CLIENT, PROMPT
    CLIENT = args.client
    PROMPT = PROMPTS[args.prompt]
    if args.baseline:
        WAYS["naiad-base"] = _baseline(Path(args.baseline))

    if args.model == "tiny":
        gguf = write_tiny_gguf(Path(tempfile.mkdtemp(prefix="llm-bench-")) / "tiny.gguf")
    elif args.model == "smollm2":
        from real_models import smollm2_gguf

        gguf = smollm2_gguf()
    else:
        gguf = cached_large_gguf()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers started below on a kill too
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    ways = []
    for spec_name, spec in spec_settings(args, gguf, args.spec).items():
        for w in args.ways.split(","):
            way = WAYS[w](gguf, args, spec)
            if spec_name != "none":
                way.name = f"{way.name}+{spec_name}"
            ways.append(way)
    if args.pin:
        server_cpus, client_cpus = (_cpus(part) for part in args.pin.split(":"))
        for way in ways:
            proc = getattr(way, "proc", None)
            if proc is not None:
                _pin(proc.proc.pid if isinstance(proc, NaiadProcess) else proc.pid, server_cpus)
        _pin(os.getpid(), client_cpus)
    try:
        for way in ways:  # warm up: the first requests fill caches and start threads
            run_level(2, 2, way.one)
        for c in levels:
            n = args.requests or max(8, 2 * c)
            per_way: dict[str, list[dict]] = {w.name: [] for w in ways}
            for r in range(args.rounds):
                order = ways if r % 2 == 0 else ways[::-1]
                for way in order:
                    before = way.spec_counts()
                    row = {
                        "model": args.model,
                        "way": way.name,
                        "concurrency": c,
                        "round": r,
                        "prompt": args.prompt,
                        **run_level(c, n, way.one),
                    }
                    row.update(_spec_row(before, way.spec_counts()))
                    per_way[way.name].append(row)
                    rows.append(row)
                    _print(row)
            if args.rounds > 1:
                for way in ways:
                    got = per_way[way.name]
                    med = {
                        k: statistics.median(x[k] for x in got) for k in ("ttft_p50_ms", "itl_ms", "tok_s")
                    }
                    if got[0].get("draft_tokens") is not None:  # acceptance over all the rounds
                        med.update(_spec_row((0, 0, 0), [sum(x[k] for x in got) for k in SPEC_COUNTERS]))
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
    append_rows(args.out, rows)


if __name__ == "__main__":
    main()
