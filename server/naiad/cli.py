"""`naiad serve`: flags named like tritonserver's; SIGTERM drains in-flight requests, then exits 0."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time

from . import __version__, memory
from .engine.cpus import frontend_workers
from .errors import NaiadError
from .flags import parse_bool as _bool
from .gpu import device_count
from .llm import images, tokenizing
from .server import Server, ServerOptions
from .stop_signals import StopSignals

log = logging.getLogger("naiad")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="naiad", description="Naiad inference server (Triton-compatible)")
    p.add_argument("--version", action="version", version=f"naiad {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
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
    from .analyze.cli import add_parser as add_analyze_parser

    add_analyze_parser(sub)
    return p


def configure_logging(verbose: int, info: bool = True, log_format: str = "default") -> None:
    """Stderr logging in Triton's format until the server's LogSettings take over (and open --log-file)."""
    from .logsettings import TritonFormatter

    level = logging.DEBUG if verbose > 0 else (logging.INFO if info else logging.WARNING)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(TritonFormatter(log_format))
    logging.basicConfig(level=level, handlers=[handler])


def model_table(server: Server) -> str:
    rows = [("Model", "Version", "Status")]
    for entry in server.repository.index():
        status = entry.get("state", "UNAVAILABLE")
        if status != "READY" and entry.get("reason"):
            status = f"{status}: {entry['reason']}"
        rows.append((entry["name"], entry.get("version", "-") or "-", status))
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+" + "-" * 10
    out = [line]
    for i, (a, b, c) in enumerate(rows):
        out.append(f"| {a.ljust(widths[0])} | {b.ljust(widths[1])} | {c}")
        if i == 0:
            out.append(line)
    out.append(line)
    return "\n".join(out)


def _table(header: tuple[str, str], rows: list[tuple[str, str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(2)]
    line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
    out = [line, f"| {header[0].ljust(widths[0])} | {header[1].ljust(widths[1])} |", line]
    out += [f"| {a.ljust(widths[0])} | {b.ljust(widths[1])} |" for a, b in rows]
    out.append(line)
    return "\n".join(out)


def options_table(args: argparse.Namespace, server: Server) -> str:
    """The server options table tritonserver prints at start-up, with Naiad's values."""
    o = server.options
    rows = [
        ("server_id", args.server_id),
        ("server_version", __version__),
        ("server_extensions", " ".join(server.extensions)),
    ]
    rows += [(f"model_repository_path[{i}]", str(r)) for i, r in enumerate(o.model_repositories)]
    rows += [
        ("model_control_mode", f"MODE_{o.model_control_mode.upper()}"),
        ("strict_model_config", str(int(not o.auto_complete_config))),
        ("model_config_name", ""),
        ("rate_limit", "OFF" if o.rate_limit == "off" else "EXEC_COUNT"),
        ("pinned_memory_pool_byte_size", str(memory.pools.pinned_bytes)),
    ]
    rows += [
        (f"cuda_memory_pool_byte_size{{{d}}}", str(b)) for d, b in sorted(memory.pools.cuda_bytes.items())
    ]
    rows += [
        ("min_supported_compute_capability", f"{args.min_supported_compute_capability:.1f}"),
        ("strict_readiness", str(int(o.strict_readiness))),
        ("exit_timeout", f"{o.exit_timeout_secs:g}"),
        ("cache_enabled", str(int(o.cache_size > 0))),
    ]
    return _table(("Option", "Value"), rows)


def _load_model_configs(args: argparse.Namespace) -> dict[str, dict]:
    """--load-model-config MODEL=JSON, checked: a JSON object, for a model --load-model names, in explicit mode."""
    configs: dict[str, dict] = {}
    for item in args.load_model_config:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--load-model-config takes MODEL=JSON, got {item!r}")
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--load-model-config {name}: not JSON: {exc}") from None
        if not isinstance(config, dict):
            raise ValueError(f"--load-model-config {name}: the config must be a JSON object")
        if args.model_control_mode != "explicit" or name not in args.load_model:
            raise ValueError(
                f"--load-model-config {name}: only for a model --load-model names (--model-control-mode explicit)"
            )
        configs[name] = config
    return configs


def _options(args: argparse.Namespace, auto_complete: bool) -> ServerOptions:
    from .cache import parse_cache_config
    from .scheduling.ratelimit import parse_resources

    if args.backend_directory and not os.path.isdir(args.backend_directory):
        raise ValueError(f"--backend-directory {args.backend_directory} is not a directory")
    if args.busy_poll_us < 0:
        raise ValueError(f"--busy-poll-us must be >= 0, got {args.busy_poll_us}")
    if args.load_on_demand_max_waiters < 1:
        raise ValueError(f"--load-on-demand-max-waiters must be >= 1, got {args.load_on_demand_max_waiters}")
    if args.load_on_demand_timeout <= 0:
        raise ValueError(f"--load-on-demand-timeout must be > 0, got {args.load_on_demand_timeout}")
    from .orchestration.memory_budget import parse_memory

    memory_limit = parse_memory(args.model_memory_limit) if args.model_memory_limit else {}
    return ServerOptions(
        model_repositories=args.model_repository,
        model_control_mode=args.model_control_mode,
        load_models=args.load_model,
        load_model_configs=_load_model_configs(args),
        repository_poll_secs=args.repository_poll_secs,
        strict_readiness=args.strict_readiness,
        exit_timeout_secs=args.exit_timeout_secs,
        auto_complete_config=auto_complete,
        allow_client_shm=args.allow_client_shm,
        gpu_count=device_count(),
        cache_size=parse_cache_config(args.cache_config),
        rate_limit=args.rate_limit,
        rate_limit_resources=parse_resources(args.rate_limit_resource),
        backend_directory=args.backend_directory,
        storage_cache_dir=args.storage_cache_dir,
        load_on_demand=args.load_on_demand,
        load_on_demand_max_waiters=args.load_on_demand_max_waiters,
        load_on_demand_timeout=args.load_on_demand_timeout,
        model_memory_limit=memory_limit,
    )


async def serve(args: argparse.Namespace) -> int:
    from .app import App

    auto_complete = not args.disable_auto_complete_config
    if args.strict_model_config is not None:
        auto_complete = not args.strict_model_config
    try:
        if args.drain_idle_connections_secs < 0:
            raise ValueError("--drain-idle-connections-secs must not be negative")
        if args.drain_quiet_secs < 0:
            raise ValueError("--drain-quiet-secs must not be negative")
        options = _options(args, auto_complete)
        tokenizing.configure(args.llm_tokenize_timeout_secs)
        images.configure(args.max_image_bytes, args.max_image_pixels, args.max_images_per_request)
        if args.image_fetch_timeout_secs <= 0:
            raise ValueError("--image-fetch-timeout-secs must be positive")
        memory.configure(
            args.pinned_memory_pool_byte_size,
            memory.parse_cuda_pool(args.cuda_memory_pool_byte_size, options.gpu_count),
        )
        app = App(options, args)
    except (ValueError, NaiadError) as exc:
        log.error("invalid arguments: %s", exc)
        return 2
    stop = asyncio.Event()
    signals = StopSignals(
        asyncio.get_running_loop(), stop.set, args.exit_timeout_secs, app.server.log_settings.reopen
    ).install()
    try:
        await app.start()
    except (NaiadError, OSError, ValueError) as exc:
        log.error("failed to start: %s", exc)
        await app.stop(0)
        signals.close()
        return 1
    for device, error in memory.apply_cuda_pools(memory.pools.cuda_bytes).items():
        log.warning("CUDA memory pool of GPU %d not sized: %s", device, error)
    log.info("\n%s", model_table(app.server))
    log.info("\n%s", options_table(args, app.server))
    log.info("%s", app.endpoints_banner())
    await stop.wait()
    log.info("shutting down: draining in-flight requests (up to %ss)", args.exit_timeout_secs)
    # the drain's budget is what the signal left of the exit timeout (StopSignals ends the process at its end)
    since = signals.stopping_since
    left = args.exit_timeout_secs - (time.monotonic() - since if since is not None else 0.0)
    await app.stop(max(0.0, left))
    signals.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # frontend workers parse the same arguments
    if args.command == "analyze":
        from .analyze.cli import run as analyze

        return analyze(args)
    legacy_trace = [f"level={v}" for v in args.trace_level]
    legacy_trace += [
        f"{k}={v}" for k, v in (("file", args.trace_file), ("rate", args.trace_rate)) if v is not None
    ]
    args.trace_config = legacy_trace + args.trace_config
    configure_logging(args.log_verbose, args.log_info, args.log_format)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(args))
    return uvloop.run(serve(args))


def tritonserver_main(argv: list[str] | None = None) -> int:
    """`naiad-tritonserver`: tritonserver's command line (`tritonserver --model-repository=... ...`) on Naiad,
    for tools that launch a server binary (Model Analyzer's local mode, scripts written for Triton)."""
    return main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
