"""NVIDIA's LLM benchmark client `aiperf` (from PyPI, unchanged) over the OpenAI chat API: Naiad vs llama.cpp's
`llama-server`, same GGUF, slots, threads and context per slot (the servers of `llamacpp_bench.py`), and
llama-cpp-python's own `llama_cpp.server` (one sequence at a time; the cached wheel with its `server` extra in
bench/.venv-llama-cpp-server, made on first use) with the same threads.

aiperf lives in a virtualenv of its own (bench/.venv-aiperf, created on first use: its dependencies pin versions
that Naiad's do not) and sends streaming `/v1/chat/completions` requests with synthetic prompts made by a local
word-level tokenizer (nothing is downloaded), `ignore_eos` so every request generates `--max-tokens`, and
`--use-server-token-count`, so token counts are the servers' own `usage`. The servers alternate per concurrency
level. Reported per level and server: TTFT p50, inter-token latency p50, output tokens/s, requests/s.

    .venv/bin/python bench/llm/aiperf_openai.py --model large --concurrency 1,8 --requests 32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench" / "llm"), str(ROOT / "server"), str(ROOT / "tests")]

import requests  # noqa: E402
from helpers import free_ports  # noqa: E402
from llamacpp_bench import LlamaServer, Naiad  # noqa: E402
from llm_models import SENTENCES, cached_large_gguf, write_tiny_gguf  # noqa: E402

AIPERF_VERSION = "0.13.0"
VENV = ROOT / "bench" / ".venv-aiperf"


def aiperf_binary() -> Path:
    binary = VENV / "bin" / "aiperf"
    if not binary.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", f"aiperf=={AIPERF_VERSION}"], check=True)
    return binary


class LlamaCppPythonServer:
    """`python -m llama_cpp.server`: llama-cpp-python's OpenAI server (FastAPI; it serialises requests)."""

    name = "llama_cpp.server"
    VENV = ROOT / "bench" / ".venv-llama-cpp-server"

    def __init__(self, gguf: Path, args):
        python = self.VENV / "bin" / "python"
        if not python.exists():
            build = subprocess.run(
                ["bash", str(ROOT / "tools/llama_cpp/build.sh")], capture_output=True, text=True, check=True
            )
            wheel = next(Path(build.stdout.strip().splitlines()[-1]).glob("wheels/llama_cpp_python-*.whl"))
            subprocess.run([sys.executable, "-m", "venv", str(self.VENV)], check=True)
            subprocess.run([str(self.VENV / "bin" / "pip"), "install", "-q", f"{wheel}[server]"], check=True)
        (port,) = free_ports(1)
        cmd = [str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1"]
        cmd += [
            "--port",
            str(port),
            "--n_ctx",
            str(args.n_ctx * args.slots),
            "--n_threads",
            str(args.threads),
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}/v1/chat/completions"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                time.sleep(0.2)

    def close(self):
        self.proc.terminate()
        self.proc.wait(30)


def prompt_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer aiperf draws its synthetic prompts from (its token counts are not used)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(folder)
    return folder


def profile(
    aiperf: Path, base_url: str, model: str, tokenizer: Path, concurrency: int, args, out: Path
) -> dict:
    cmd = [
        str(aiperf),
        "profile",
        "-m",
        model,
        "--tokenizer",
        str(tokenizer),
        "--endpoint-type",
        "chat",
        "--streaming",
        "--url",
        base_url,
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(max(args.requests, concurrency)),
        "--synthetic-input-tokens-mean",
        str(args.prompt_words),
        "--synthetic-input-tokens-stddev",
        "0",
        "--output-tokens-mean",
        str(args.max_tokens),
        "--output-tokens-stddev",
        "0",
        "--extra-inputs",
        "ignore_eos:true",
        "--extra-inputs",  # aiperf asks with max_completion_tokens, which llama-server's chat API ignores
        f"max_tokens:{args.max_tokens}",
        "--use-server-token-count",
        "--artifact-dir",
        str(out),
        "--ui-type",
        "none",
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=1800)
    data = json.loads((out / "profile_export_aiperf.json").read_text())

    def stat(name: str, key: str) -> float | None:
        return (data.get(name) or {}).get(key)

    return {
        "ttft_p50_ms": stat("time_to_first_token", "p50"),
        "itl_p50_ms": stat("inter_token_latency", "p50"),
        "output_tokens_per_s": stat("output_token_throughput", "avg") or 0.0,
        "requests_per_s": stat("request_throughput", "avg") or 0.0,
        # failed requests (a server that breaks concurrent streams): their count and aiperf's first reason
        "errors": sum(e.get("count", 0) for e in data.get("error_summary") or []),
        "error": next((e["error_details"]["message"] for e in data.get("error_summary") or []), ""),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "large"], default="large")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--requests", type=int, default=32, help="requests per level (at least the concurrency)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=32)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--n-ctx", type=int, default=512, help="context per slot")
    ap.add_argument("--llama-server", default="", help="the llama-server binary (default: the tools cache)")
    ap.add_argument("--servers", default="naiad,llama-server,llama_cpp.server")
    ap.add_argument("--out", default="", help="write the rows as JSON lines here")
    args = ap.parse_args()
    aiperf = aiperf_binary()
    work = Path(tempfile.mkdtemp(prefix="aiperf-bench-"))
    tokenizer = prompt_tokenizer(work / "tokenizer")
    gguf = cached_large_gguf() if args.model == "large" else write_tiny_gguf(work / "tiny.gguf")
    ways = {"naiad": Naiad, "llama-server": LlamaServer, "llama_cpp.server": LlamaCppPythonServer}
    servers = {name: ways[name](gguf, args) for name in args.servers.split(",")}
    bases = {
        name: (s.proc.url if name == "naiad" else s.url.split("/v1/")[0].rsplit("/completion", 1)[0], "llm")
        for name, s in servers.items()
    }
    rows = []
    try:
        for i, c in enumerate(int(x) for x in args.concurrency.split(",")):
            order = list(servers) if i % 2 == 0 else list(reversed(servers))
            for name in order:
                base, model = bases[name]
                row = {"server": name, "model": args.model, "concurrency": c}
                row.update(profile(aiperf, base, model, tokenizer, c, args, work / f"{name}-c{c}"))
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for s in servers.values():
            s.close()
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print("\n| model | c | server | TTFT p50 ms | ITL p50 ms | output tok/s | req/s | failed |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ttft, itl = r["ttft_p50_ms"], r["itl_p50_ms"]
        print(
            f"| {r['model']} | {r['concurrency']} | {r['server']} | {'-' if ttft is None else f'{ttft:.1f}'} "
            f"| {'-' if itl is None else f'{itl:.2f}'} | {r['output_tokens_per_s']:.1f} "
            f"| {r['requests_per_s']:.2f} | {r['errors']} |"
        )


if __name__ == "__main__":
    main()
