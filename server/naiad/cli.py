"""`naiad serve`: flags named like tritonserver's; SIGTERM drains in-flight requests, then exits 0."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from . import __version__
from .errors import NaiadError
from .gpu import device_count
from .server import Server, ServerOptions

log = logging.getLogger("naiad")


def _bool(value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{value}'")


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
        help="path of a model repository (repeatable)",
    )
    s.add_argument("--model-control-mode", choices=["none", "poll", "explicit"], default="none")
    s.add_argument(
        "--load-model",
        action="append",
        default=[],
        help="model to load at startup in explicit mode (repeatable; '*' loads all)",
    )
    s.add_argument("--repository-poll-secs", type=float, default=15.0)
    s.add_argument("--strict-readiness", type=_bool, default=True)
    s.add_argument("--exit-timeout-secs", type=float, default=30.0)
    s.add_argument("--disable-auto-complete-config", action="store_true")
    s.add_argument(
        "--strict-model-config",
        type=_bool,
        default=None,
        help="deprecated tritonserver spelling of --disable-auto-complete-config",
    )
    s.add_argument("--http-port", type=int, default=8000)
    s.add_argument("--grpc-port", type=int, default=8001)
    s.add_argument("--metrics-port", type=int, default=8002)
    s.add_argument("--http-address", default="0.0.0.0")
    s.add_argument("--grpc-address", default="0.0.0.0")
    s.add_argument("--metrics-address", default=None, help="default: the HTTP address")
    s.add_argument("--allow-http", type=_bool, default=True)
    s.add_argument("--allow-grpc", type=_bool, default=True)
    s.add_argument(
        "--grpc-implementation",
        choices=["naiad", "grpcio"],
        default="naiad",
        help="naiad: Naiad's own HTTP/2 gRPC server (fast, cleartext h2c); grpcio: grpc.aio",
    )
    # gRPC connection limits and keepalive (Triton's flags and defaults; times in milliseconds), both
    # implementations; the last five are Naiad's own (0 turns a limit or timer off)
    s.add_argument("--grpc-keepalive-time", type=int, default=7_200_000)
    s.add_argument("--grpc-keepalive-timeout", type=int, default=20_000)
    s.add_argument("--grpc-keepalive-permit-without-calls", type=_bool, default=False)
    s.add_argument("--grpc-http2-max-pings-without-data", type=int, default=2)
    s.add_argument("--grpc-http2-min-recv-ping-interval-without-data", type=int, default=300_000)
    s.add_argument("--grpc-http2-max-ping-strikes", type=int, default=2)
    s.add_argument("--grpc-max-concurrent-streams", type=int, default=100, help="per connection")
    s.add_argument(
        "--grpc-max-message-size", type=int, default=2**31 - 1, help="bytes per request message, inflated"
    )
    s.add_argument("--grpc-handshake-timeout", type=int, default=10_000, help="preface and header blocks")
    s.add_argument("--grpc-max-connection-idle", type=int, default=3_600_000, help="no call open: GOAWAY")
    s.add_argument(
        "--grpc-stall-timeout",
        type=int,
        default=60_000,
        help="a response the client does not read, or a request that stops coming, is reset after it",
    )
    s.add_argument("--allow-metrics", type=_bool, default=True)
    s.add_argument("--allow-gpu-metrics", type=_bool, default=True)
    s.add_argument("--allow-cpu-metrics", type=_bool, default=True)
    s.add_argument("--metrics-interval-ms", type=int, default=2000)
    s.add_argument(
        "--metrics-config",
        action="append",
        default=[],
        help="<setting>=<value>: counter_latencies, histogram_latencies, summary_latencies, "
        "summary_quantiles",
    )
    s.add_argument("--http-max-input-size", type=int, default=64 * 1024 * 1024)
    s.add_argument("--allow-client-shm", type=_bool, default=True)
    s.add_argument(
        "--http-restricted-api",
        action="append",
        default=[],
        help="<api>[,<api>...]:<header>=<value>: only requests with that header may use those APIs",
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
        help="trace setting, e.g. level=TIMESTAMPS, rate=1, file=/tmp/trace.json",
    )
    s.add_argument("--rate-limit", choices=["off", "execution_count"], default="off")
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
    s.add_argument("--log-verbose", type=int, default=0)
    s.add_argument("--log-info", type=_bool, default=True)
    s.add_argument("--log-warning", type=_bool, default=True)
    s.add_argument("--log-error", type=_bool, default=True)
    return p


def configure_logging(verbose: int, info: bool = True) -> None:
    level = logging.DEBUG if verbose > 0 else (logging.INFO if info else logging.WARNING)
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname).1s %(name)s] %(message)s", stream=sys.stderr
    )


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


def _options(args: argparse.Namespace, auto_complete: bool) -> ServerOptions:
    from .cache import parse_cache_config
    from .scheduling.ratelimit import parse_resources

    return ServerOptions(
        model_repositories=args.model_repository,
        model_control_mode=args.model_control_mode,
        load_models=args.load_model,
        repository_poll_secs=args.repository_poll_secs,
        strict_readiness=args.strict_readiness,
        exit_timeout_secs=args.exit_timeout_secs,
        auto_complete_config=auto_complete,
        allow_client_shm=args.allow_client_shm,
        gpu_count=device_count(),
        cache_size=parse_cache_config(args.cache_config),
        rate_limit=args.rate_limit,
        rate_limit_resources=parse_resources(args.rate_limit_resource),
    )


async def serve(args: argparse.Namespace) -> int:
    from .app import App

    auto_complete = not args.disable_auto_complete_config
    if args.strict_model_config is not None:
        auto_complete = not args.strict_model_config
    try:
        options = _options(args, auto_complete)
    except ValueError as exc:
        log.error("invalid arguments: %s", exc)
        return 2
    app = App(options, args)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await app.start()
    except (NaiadError, OSError, ValueError) as exc:
        log.error("failed to start: %s", exc)
        await app.stop(0)
        return 1
    print(model_table(app.server), file=sys.stderr, flush=True)
    log.info("%s", app.endpoints_banner())
    await stop.wait()
    log.info("shutting down: draining in-flight requests (up to %ss)", args.exit_timeout_secs)
    await app.stop(args.exit_timeout_secs)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_verbose, args.log_info)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve(args))
    return uvloop.run(serve(args))


if __name__ == "__main__":
    sys.exit(main())
