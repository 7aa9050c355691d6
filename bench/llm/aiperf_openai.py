"""NVIDIA's LLM benchmark client `aiperf` (from PyPI, unchanged) over the OpenAI chat API: Naiad vs llama.cpp's
`llama-server`, same GGUF, slots, threads and context per slot (the servers of `llamacpp_bench.py`).

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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "bench" / "llm"), str(ROOT / "server"), str(ROOT / "tests")]

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
    return {
        "ttft_p50_ms": data["time_to_first_token"]["p50"],
        "itl_p50_ms": data["inter_token_latency"]["p50"],
        "output_tokens_per_s": data["output_token_throughput"]["avg"],
        "requests_per_s": data["request_throughput"]["avg"],
        "errors": (data.get("error_summary") or []),
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
    ap.add_argument("--out", default="", help="write the rows as JSON lines here")
    args = ap.parse_args()
    aiperf = aiperf_binary()
    work = Path(tempfile.mkdtemp(prefix="aiperf-bench-"))
    tokenizer = prompt_tokenizer(work / "tokenizer")
    gguf = cached_large_gguf() if args.model == "large" else write_tiny_gguf(work / "tiny.gguf")
    servers = {"naiad": Naiad(gguf, args), "llama-server": LlamaServer(gguf, args)}
    bases = {
        "naiad": (servers["naiad"].proc.url, "llm"),
        "llama-server": (servers["llama-server"].url.rsplit("/", 1)[0], "llm"),
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
    print(
        "\n| model | c | server | TTFT p50 ms | ITL p50 ms | output tok/s | req/s |\n|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['model']} | {r['concurrency']} | {r['server']} | {r['ttft_p50_ms']:.1f} | {r['itl_p50_ms']:.2f} "
            f"| {r['output_tokens_per_s']:.1f} | {r['requests_per_s']:.2f} |"
        )
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
