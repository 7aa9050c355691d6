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
from .errors import NaiadError
from .gpu import device_count
from .llm import images, tokenizing
from .logsettings import configure_logging
from .serve_flags import command_parser
from .server import Server, ServerOptions
from .stop_signals import StopSignals

log = logging.getLogger("naiad")


def build_parser() -> argparse.ArgumentParser:
    """`naiad serve` (serve_flags.py, which frontend workers parse too) and `naiad analyze`."""
    p, sub = command_parser()
    from .analyze.cli import add_parser as add_analyze_parser

    add_analyze_parser(sub)
    return p


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
