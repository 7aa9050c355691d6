"""`naiad serve`'s command line, read alike by the process `naiad serve` starts (`cli.py`) and by each of its frontend
workers (`engine/worker.py`, started with the same arguments): the flags, and the restricted-API rules they give."""

from __future__ import annotations

import argparse
import os

from . import __version__, memory
from .cpus import frontend_workers
from .flags import parse_bool as _bool
from .llm import images


def command_parser() -> tuple[argparse.ArgumentParser, argparse._SubParsersAction]:
    """The `naiad` command with its `serve` subcommand, and the subcommands' action (cli.py adds `analyze`)."""
    p = argparse.ArgumentParser(prog="naiad", description="Naiad inference server (Triton-compatible)")
    p.add_argument("--version", action="version", version=f"naiad {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    return p, sub


def serve_parser() -> argparse.ArgumentParser:
    """The command line a frontend worker parses: `serve <naiad serve's arguments>`."""
    return command_parser()[0]


def add_serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    s = sub.add_parser("serve", help="serve a Triton model repository over HTTP and gRPC")
    s.add_argument(
        "--model-repository",
        "--model-store",
        action="append",
        required=True,
        dest="model_repository",
        help="a model repository: a path, s3://[host:port/]bucket/path or https://.../model.tar.gz (repeatable)",
    )
    s.add_argument(
        "--storage-cache-dir",
        default=None,
        help="where models from s3:// and https:// repositories are copied (default: $NAIAD_STORAGE_CACHE_DIR or "
        "~/.cache/naiad/storage)",
    )
    s.add_argument(
        "--model-control-mode",
        choices=["none", "poll", "explicit"],
        default="none",
        help="none: load everything at start; poll: also pick up repository changes; explicit: load/unload through the repository API",
    )
    s.add_argument(
        "--load-model",
        action="append",
        default=[],
        help="model to load at startup in explicit mode (repeatable; '*' loads all)",
    )
    s.add_argument(
        "--load-model-config",
        action="append",
        default=[],
        metavar="MODEL=JSON",
        help="the config a --load-model model is loaded with at startup, as a load request's `config` parameter "
        "(JSON; it replaces the repository's config.pbtxt; repeatable)",
    )
    # models on demand (orchestration/): load on the first request, a memory budget, eviction
    s.add_argument(
        "--load-on-demand",
        type=_bool,
        nargs="?",
        const=True,
        default=False,
        help="explicit mode: a request for a model in a repository that is not loaded loads it and waits",
    )
    s.add_argument(
        "--load-on-demand-max-waiters",
        type=int,
        default=1000,
        help="requests that may wait for one model's load; beyond: HTTP 429 / gRPC UNAVAILABLE with Retry-After",
    )
    s.add_argument(
        "--load-on-demand-timeout",
        type=float,
        default=120.0,
        help="seconds a request waits for its model's load before a 503 / UNAVAILABLE",
    )
    s.add_argument(
        "--model-memory-limit",
        default=None,
        help="host:BYTES[,gpu<N>:BYTES] (K, M, G, Ki, Mi, Gi suffixes) the loaded models may hold; a load "
        "beyond it unloads idle models first, least valuable first",
    )
    s.add_argument(
        "--backend-directory",
        default=None,
        help="python-based backends: <dir>/<name>/model.py serves every model whose config says backend: <name>",
    )
    s.add_argument(
        "--repository-poll-secs", type=float, default=15.0, help="how often poll mode looks for changes"
    )
    s.add_argument(
        "--strict-readiness",
        type=_bool,
        default=True,
        help="/v2/health/ready only while every model is ready",
    )
    s.add_argument(
        "--exit-timeout-secs",
        type=float,
        default=30.0,
        help="on SIGTERM, finish in-flight requests for up to this long, then exit 0",
    )
    s.add_argument(
        "--drain-idle-connections-secs",
        type=float,
        default=5.0,
        help="on SIGTERM the listeners close (see --drain-quiet-secs), but requests on open keep-alive connections "
        "are still served (each answer says Connection: close); idle connections are closed only after this grace "
        "(capped by --exit-timeout-secs), because a client may have just written a request on one and must get an "
        "answer, not a reset",
    )
    s.add_argument(
        "--drain-quiet-secs",
        type=float,
        default=0.0,
        help="on SIGTERM, keep listening while new connections still arrive, and close the listeners once none has "
        "arrived for this long (at most half of --exit-timeout-secs): behind a Kubernetes Service, kube-proxy sends "
        "new connections to a terminating pod until the endpoint's removal reaches it, which can outlast the "
        "preStop delay on a busy node. 0 (the default): close the listeners at once",
    )
    s.add_argument(
        "--disable-auto-complete-config",
        action="store_true",
        help="do not derive missing configuration from the model files",
    )
    s.add_argument(
        "--strict-model-config",
        type=_bool,
        default=None,
        help="deprecated tritonserver spelling of --disable-auto-complete-config",
    )
    s.add_argument("--http-port", type=int, default=8000, help="HTTP/REST port")
    s.add_argument("--grpc-port", type=int, default=8001, help="gRPC port")
    s.add_argument("--metrics-port", type=int, default=8002, help="Prometheus metrics port")
    s.add_argument("--http-address", default="0.0.0.0", help="address the HTTP port binds")
    s.add_argument("--grpc-address", default="0.0.0.0", help="address the gRPC port binds")
    s.add_argument("--metrics-address", default=None, help="default: the HTTP address")
    s.add_argument("--allow-http", type=_bool, default=True, help="serve HTTP/REST")
    s.add_argument("--allow-grpc", type=_bool, default=True, help="serve gRPC")
    s.add_argument(
        "--grpc-implementation",
        choices=["naiad", "grpcio"],
        default="naiad",
        help="naiad: Naiad's own HTTP/2 gRPC server (fast; h2c, or h2 with --grpc-use-ssl); grpcio: grpc.aio",
    )
    # gRPC connection limits and keepalive (Triton's flags and defaults; times in milliseconds), both
    # implementations; the last five are Naiad's own (0 turns a limit or timer off)
    s.add_argument("--grpc-keepalive-time", type=int, default=7_200_000, help="ms between keepalive PINGs")
    s.add_argument("--grpc-keepalive-timeout", type=int, default=20_000, help="ms to wait for a PING ack")
    s.add_argument(
        "--grpc-keepalive-permit-without-calls", type=_bool, default=False, help="keepalive with no call open"
    )
    s.add_argument(
        "--grpc-http2-max-pings-without-data", type=int, default=2, help="PINGs sent before data must follow"
    )
    s.add_argument(
        "--grpc-http2-min-recv-ping-interval-without-data",
        type=int,
        default=300_000,
        help="ms a client must leave between PINGs without data (else a strike)",
    )
    s.add_argument(
        "--grpc-http2-max-ping-strikes", type=int, default=2, help="strikes before GOAWAY too_many_pings"
    )
    s.add_argument("--grpc-max-concurrent-streams", type=int, default=100, help="per connection")
    s.add_argument(
        "--grpc-max-message-size", type=int, default=2**31 - 1, help="bytes per request message, inflated"
    )
    s.add_argument(
        "--grpc-max-decompression-ratio",
        type=int,
        default=100,
        help="a gzip/deflate request message may inflate to this many times its size, once past 4 MiB "
        "(Envoy's max_inflate_ratio; 0: no ratio limit; Naiad's HTTP/2 server)",
    )
    s.add_argument("--grpc-handshake-timeout", type=int, default=10_000, help="preface and header blocks")
    s.add_argument("--grpc-max-connection-idle", type=int, default=3_600_000, help="no call open: GOAWAY")
    s.add_argument(
        "--grpc-stall-timeout",
        type=int,
        default=60_000,
        help="a response the client does not read, or a request that stops coming, is reset after it",
    )
    s.add_argument(
        "--busy-poll-us",
        type=int,
        default=200,
        help="µs the event loop may keep polling after requests before it sleeps (adaptive; 0: off)",
    )
    s.add_argument(
        "--frontend-workers",
        type=frontend_workers,
        default="auto",
        help="processes that serve HTTP and gRPC (see --frontend-accept) in front of one engine process that owns the "
        "models; 'auto': the CPUs of the pod's CPU limit (its cgroup quota) less one for the engine, and one process "
        "where there is no limit or it is 2 CPUs or less; 1: one process",
    )
    s.add_argument(
        "--frontend-accept",
        choices=["balanced", "reuseport"],
        default="balanced",
        help="with --frontend-workers > 1: 'balanced': the engine process accepts and hands each connection to the "
        "worker with the fewest open ones; 'reuseport': every worker listens (SO_REUSEPORT) and the kernel picks "
        "one by the connection's addresses. --grpc-implementation grpcio always uses reuseport",
    )
    s.add_argument("--allow-metrics", type=_bool, default=True, help="serve Prometheus metrics")
    s.add_argument("--allow-gpu-metrics", type=_bool, default=True, help="export nv_gpu_* metrics (NVML)")
    s.add_argument("--allow-cpu-metrics", type=_bool, default=True, help="export nv_cpu_* metrics")
    s.add_argument(
        "--metrics-interval-ms", type=int, default=2000, help="how often GPU/CPU metrics are sampled"
    )
    s.add_argument(
        "--metrics-config",
        action="append",
        default=[],
        help="<setting>=<value>: counter_latencies, histogram_latencies, summary_latencies, "
        "summary_quantiles",
    )
    s.add_argument(
        "--http-max-input-size", type=int, default=64 * 1024 * 1024, help="largest HTTP request body in bytes"
    )
    s.add_argument(
        "--allow-client-shm", type=_bool, default=True, help="the system (and CUDA) shared-memory extensions"
    )
    s.add_argument(
        "--http-restricted-api",
        action="append",
        default=[],
        help="<api>[,<api>...]:<header>=<value>: only requests with that header may use those APIs; "
        "<value> may be env:<VARIABLE> or file:<path> to keep it out of the command line",
    )
    s.add_argument(
        "--grpc-restricted-protocol",
        action="append",
        default=[],
        help="<protocol>[,...]:<metadata-key>=<value>, as --http-restricted-api for gRPC",
    )
    s.add_argument(
        "--trace-config",
        action="append",
        default=[],
        help="[<mode>,]<setting>=<value>, e.g. level=TIMESTAMPS, rate=1, triton,file=/tmp/trace.json, "
        "mode=opentelemetry, opentelemetry,url=http://localhost:4318/v1/traces",
    )
    s.add_argument(
        "--rate-limit",
        choices=["off", "execution_count"],
        default="off",
        help="the rate limiter (instances' rate_limiter resources)",
    )
    # tritonserver's older spellings of --trace-config, still offered by Model Analyzer's `triton_server_flags`
    s.add_argument(
        "--trace-file", default=None, help="deprecated tritonserver spelling of --trace-config file="
    )
    s.add_argument(
        "--trace-level",
        action="append",
        default=[],
        help="deprecated tritonserver spelling of --trace-config level= (repeatable)",
    )
    s.add_argument(
        "--trace-rate", default=None, help="deprecated tritonserver spelling of --trace-config rate="
    )
    s.add_argument(
        "--rate-limit-resource",
        action="append",
        default=[],
        help="<name>:<count>[:<device>] available to rate-limited instances",
    )
    s.add_argument(
        "--cache-config",
        action="append",
        default=[],
        help="response cache: local,size=<bytes> (models opt in with response_cache { enable: true })",
    )
    # the OpenAI-compatible API (docs/llm.md): always under /v1 on the HTTP port, and on a port of its own
    s.add_argument(
        "--openai-port", type=int, default=0, help="also serve the OpenAI API (/v1) on this port (0: off)"
    )
    s.add_argument(
        "--openai-address", default=None, help="address the OpenAI port binds (default: the HTTP address)"
    )
    s.add_argument(
        "--chat-template",
        default=None,
        help="Jinja2 chat template file for models that bring none (no LLMInfo, no tokenizer_config.json)",
    )
    s.add_argument(
        "--openai-stall-timeout",
        type=float,
        default=60.0,
        help="seconds a streaming client may leave its stream unread before it is dropped and its request cancelled",
    )
    s.add_argument(
        "--allow-runtime-lora",
        type=_bool,
        nargs="?",
        const=True,
        default=False,
        help="answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): "
        "LoRA adapters loaded into llama.cpp models while they serve; off, those routes answer 403",
    )
    s.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="read images given as file: URLs in LLM requests when the file is under DIR (vLLM's flag); unset, "
        "file: URLs are refused",
    )
    s.add_argument(
        "--allow-image-fetch",
        type=_bool,
        nargs="?",
        const=True,
        default=False,
        help="fetch images given as http(s): URLs in LLM requests (at most --max-image-bytes, within "
        "--image-fetch-timeout-secs; the server then reaches any address a client names); off, they are refused",
    )
    s.add_argument(
        "--image-fetch-timeout-secs",
        type=float,
        default=10.0,
        help="the longest fetching one image may take (--allow-image-fetch)",
    )
    s.add_argument(
        "--max-image-bytes",
        type=int,
        default=images.DEFAULT_MAX_BYTES,
        help="the most bytes one image in an LLM request may have (encoded, before base64)",
    )
    s.add_argument(
        "--max-image-pixels",
        type=int,
        default=images.DEFAULT_MAX_PIXELS,
        help="the most pixels (width x height, read from its header before decoding) one image may have",
    )
    s.add_argument(
        "--max-images-per-request",
        type=int,
        default=images.DEFAULT_MAX_IMAGES,
        help="the most images one LLM request may carry",
    )
    s.add_argument(
        "--llm-tokenize-timeout-secs",
        type=float,
        default=10.0,
        help="the longest an LLM request's prompt may take to tokenize (or its chat template to render) before it is "
        "answered with a 400 and the work abandoned; large prompts are tokenized off the event loop",
    )
    from .frontends.transport import tls

    for endpoint in tls.ENDPOINTS:
        tls.add_arguments(s, endpoint)
    s.add_argument(
        "--log-verbose",
        type=int,
        default=0,
        help="verbose level; >= 1 logs a line per execution with the batch it ran (grep 'executing')",
    )
    s.add_argument("--log-info", type=_bool, default=True, help="log info messages")
    s.add_argument("--log-warning", type=_bool, default=True, help="log warnings")
    s.add_argument("--log-error", type=_bool, default=True, help="log errors")
    s.add_argument(
        "--log-file",
        default="",
        help="write the log to this file instead of stderr (reopened when rotated away, and on SIGHUP)",
    )
    s.add_argument(
        "--log-format", choices=["default", "ISO8601"], default="default", help="Triton's log line layouts"
    )
    s.add_argument(
        "--pinned-memory-pool-byte-size",
        type=int,
        default=memory.DEFAULT_PINNED_BYTES,
        help="page-locked host memory for GPU staging buffers (beyond it: pageable memory)",
    )
    s.add_argument(
        "--cuda-memory-pool-byte-size",
        action="append",
        default=[],
        help="<gpu>:<bytes> kept cached by that device's CUDA memory pool (default 64 MiB per GPU)",
    )
    s.add_argument(
        "--min-supported-compute-capability",
        type=float,
        default=6.0,
        help="oldest CUDA compute capability a GPU may have (options table)",
    )
    s.add_argument("--id", dest="server_id", default="naiad", help="server identifier in the options table")
    return s


API_GROUPS = (
    "health",
    "metadata",
    "inference",
    "shared-memory",
    "model-config",
    "model-repository",
    "statistics",
    "trace",
    "logging",
    "openai",  # Naiad's own: the OpenAI-compatible API under /v1, on the HTTP port and on --openai-port
)


def restriction_value(value: str) -> str:
    """A restricted API's value as given, or read from the environment (`env:<VARIABLE>`) or a file
    (`file:<path>`, one trailing newline dropped), so that a credential need not appear on the command line."""
    source, sep, ref = value.partition(":")
    if not sep or source not in ("env", "file"):
        return value
    if source == "env":
        if not os.environ.get(ref):
            raise ValueError(f"restricted API value env:{ref}: the environment variable is not set or empty")
        return os.environ[ref]
    try:
        with open(ref, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"restricted API value file:{ref}: {exc.strerror or exc}") from exc
    text = text[:-1] if text.endswith("\n") else text
    text = text[:-1] if text.endswith("\r") else text
    if not text:
        raise ValueError(f"restricted API value file:{ref}: the file is empty")
    return text


def parse_restricted(items: list[str]) -> dict[str, tuple[str, str]]:
    """`<api>[,<api>...]:<header>=<value>` (repeatable) -> {api: (header, value)}; see restriction_value."""
    out: dict[str, tuple[str, str]] = {}
    for item in items or []:
        apis, sep, rule = item.partition(":")
        key, eq, value = rule.partition("=")
        if not sep or not eq or not key:
            raise ValueError(f"invalid restricted API '{item}': expected <apis>:<header>=<value>")
        for api in apis.split(","):
            api = api.strip()
            if api not in API_GROUPS:
                raise ValueError(f"unknown API group '{api}' (known: {', '.join(API_GROUPS)})")
            if api in out:
                raise ValueError(f"API group '{api}' is restricted twice")
            out[api] = (key.strip().lower(), restriction_value(value))
    return out
