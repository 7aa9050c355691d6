"""The running process: a Server plus its HTTP, gRPC and metrics endpoints, started and stopped together."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from . import host_pinning
from .frontends.transport import receive_buffers
from .server import Server, ServerOptions

log = logging.getLogger("naiad")


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


def parse_trace_config(items: list[str]) -> tuple[dict, dict]:
    """`--trace-config [<mode>,]<setting>=<value>` (tritonserver's spelling; `level` may repeat): the trace
    extension's settings, and the `opentelemetry,...` exporter settings."""
    from .otel import parse_setting

    out: dict = {}
    otel: dict = {}
    for item in items:
        mode, comma, rest = item.partition(",")
        if comma and "=" not in mode:
            if mode not in ("triton", "opentelemetry"):
                raise ValueError(f"invalid --trace-config '{item}': unknown trace mode '{mode}'")
            item = rest
        else:
            mode = ""
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"invalid --trace-config '{item}', expected [<mode>,]<setting>=<value>")
        if mode == "opentelemetry":
            parse_setting(otel, key, value)
            continue
        if mode == "triton" and key not in ("file", "log-frequency"):
            raise ValueError(f"unknown triton trace setting '{key}' (known: file, log-frequency)")
        key = {
            "level": "trace_level",
            "rate": "trace_rate",
            "count": "trace_count",
            "file": "trace_file",
            "log-frequency": "log_frequency",
            "mode": "trace_mode",
        }.get(key, key)
        if key == "trace_level":
            out.setdefault(key, []).append(value.upper())
        else:
            out[key] = value
    return out, otel


class App:
    def __init__(self, options: ServerOptions, args: argparse.Namespace):
        self.args = args
        self.server = Server(options)
        self.metrics = None
        self._runners: list = []
        self._grpc = None
        self._tls_contexts: list = []
        self.endpoints: list[str] = []
        self.engine = None  # engine.core.EngineService and engine.supervisor.FrontendWorkers with
        self.workers = None  # --frontend-workers > 1
        self.pinning: host_pinning.HostPinning | None = None

    def _tls_context(self, settings, alpn: list[str], name: str):
        from .frontends.transport import tls

        if settings is None:
            return None
        reloading = tls.ReloadingContext(settings, alpn, name)
        self._tls_contexts.append(reloading)
        return reloading.context

    async def start(self) -> None:
        from .frontends.transport import tls

        a = self.args
        http_tls = tls.settings_from_args(a, "http")
        grpc_tls = tls.settings_from_args(a, "grpc")
        metrics_tls = tls.settings_from_args(a, "metrics", fallback=http_tls)
        http_restricted = parse_restricted(a.http_restricted_api)
        grpc_restricted = parse_restricted(a.grpc_restricted_protocol)
        if a.allow_metrics:
            from .metrics import Metrics, parse_metrics_config

            self.metrics = Metrics(
                self.server,
                parse_metrics_config(a.metrics_config),
                cpu=a.allow_cpu_metrics,
                gpu=a.allow_gpu_metrics,
                interval_ms=a.metrics_interval_ms,
            )
            from .orchestration.metrics import OrchestrationCollector

            self.metrics.registry.register(OrchestrationCollector(self.server))
        self.server.log_settings.configure(
            {
                "log_verbose_level": a.log_verbose,
                "log_info": a.log_info,
                "log_warning": a.log_warning,
                "log_error": a.log_error,
                "log_file": a.log_file,
                "log_format": a.log_format,
            }
        )
        if a.trace_config:
            settings, self.server.tracer.otel_settings = parse_trace_config(a.trace_config)
            self.server.tracer.update(settings, startup=True)
        openai = None  # before the models load: a --chat-template that cannot be read stops the start
        if a.allow_http or a.openai_port:
            from .frontends.llm.media import media_settings_from_args
            from .frontends.openai.routes import OpenAIFrontend

            openai = OpenAIFrontend(
                self.server,
                chat_template=a.chat_template,
                stall_timeout=a.openai_stall_timeout,
                allow_runtime_lora=getattr(a, "allow_runtime_lora", False),
                media_settings=media_settings_from_args(a),
                max_input_size=a.http_max_input_size,
            )
        from .shared_memory import shared_memory_manager  # system shared memory, plus CUDA with a GPU

        shm = shared_memory_manager(self.server, enabled=a.allow_client_shm)
        await self.server.start()
        self.server.opening_listeners = True  # not ready until the last listener below is up
        workers = int(getattr(a, "frontend_workers", 1))
        in_process = workers == 1  # more: worker processes serve HTTP and gRPC, this process is the engine
        # on a GPU machine the buffers requests arrive in are page-locked where a model reads them: this process's
        # receive buffers, or (under workers) the engine's mappings of the workers' segments
        self.pinning = host_pinning.for_gpus(self.server.options.gpu_count)
        if in_process:
            receive_buffers.POOL.pinning = self.pinning
        busy_poll = None
        if a.busy_poll_us:
            from .frontends.transport.busy_poll import BusyPoll

            busy_poll = BusyPoll(asyncio.get_running_loop(), a.busy_poll_us)
        if a.allow_http and in_process:
            from .frontends.http.frontend import HttpFrontend

            http = HttpFrontend(
                self.server,
                shm=shm,
                max_input_size=a.http_max_input_size,
                restricted=http_restricted,
                busy_poll=busy_poll,
                openai=openai,
            )
            context = self._tls_context(http_tls, ["http/1.1"], "HTTP")
            self._runners.append(await http.start(a.http_address, a.http_port, ssl=context))
            self.endpoints.append(f"HTTPService at {a.http_address}:{a.http_port}{tls.describe(http_tls)}")
        if a.openai_port and openai is not None and in_process:  # else the frontend workers serve it
            # the OpenAI API on a port of its own (Triton's OpenAI app uses 9000), with the HTTP port's TLS and
            # restricted-API settings
            host = a.openai_address or a.http_address
            context = self._tls_context(http_tls, ["http/1.1"], "OpenAI")
            self._runners.append(
                await openai.start(host, a.openai_port, ssl=context, restricted=http_restricted)
            )
            self.endpoints.append(f"OpenAI API at {host}:{a.openai_port}{tls.describe(http_tls)}")
        if a.allow_grpc and in_process:
            from .frontends.grpc.frontend import GrpcFrontend, h2_settings

            self._grpc = GrpcFrontend(
                self.server,
                shm=shm,
                restricted=grpc_restricted,
                implementation=a.grpc_implementation,
                settings=h2_settings(a),
                busy_poll=busy_poll,
            )
            await self._grpc.start(a.grpc_address, a.grpc_port, grpc_tls)
            self.endpoints.append(
                f"GRPCInferenceService at {a.grpc_address}:{a.grpc_port}{tls.describe(grpc_tls)}"
            )
        if not in_process:
            await self._start_workers(shm, workers)
        if self.metrics is not None:
            host = a.metrics_address or a.http_address
            context = self._tls_context(metrics_tls, ["http/1.1"], "metrics")
            self._runners.append(await self.metrics.start(host, a.metrics_port, ssl=context))
            self.endpoints.append(f"Metrics Service at {host}:{a.metrics_port}{tls.describe(metrics_tls)}")
        self.server.opening_listeners = False
        for reloading in self._tls_contexts:
            reloading.start()

    async def _start_workers(self, shm, count: int) -> None:
        from .engine import acceptor
        from .engine.core import EngineService
        from .engine.supervisor import FrontendWorkers

        a = self.args
        self.engine = EngineService(self.server, shm, self.pinning)
        await self.engine.start()
        self.workers = FrontendWorkers(
            self.engine, count, a.argv, acceptor.from_args(a, os.path.dirname(self.engine.path))
        )
        await self.workers.start()
        if a.allow_http:
            self.endpoints.append(f"HTTPService at {a.http_address}:{a.http_port} ({count} frontend workers)")
        if a.allow_grpc:
            self.endpoints.append(
                f"GRPCInferenceService at {a.grpc_address}:{a.grpc_port} ({count} frontend workers)"
            )
        if a.openai_port:
            host = a.openai_address or a.http_address
            self.endpoints.append(f"OpenAI API at {host}:{a.openai_port} ({count} frontend workers)")

    def endpoints_banner(self) -> str:
        return "Started " + ", ".join(self.endpoints)

    async def drain(self, timeout: float) -> float:
        """Stop listening and serve the open connections until they close (frontends/transport/drain.py); returns what is
        left of `timeout` for the requests still in flight."""
        from .frontends.transport.drain import drain

        grace = float(getattr(self.args, "drain_idle_connections_secs", 5.0))
        quiet = float(getattr(self.args, "drain_quiet_secs", 0.0))
        return await drain(self._runners, self._grpc, grace, timeout, quiet)

    async def stop(self, timeout: float) -> None:
        for reloading in self._tls_contexts:
            reloading.close()
        self.server.draining = True  # no longer ready, while the open connections are still served
        if self.workers is not None:
            acceptor = self.workers.acceptor
            # --frontend-accept balanced: this process listens, and goes on listening while connections arrive
            if acceptor is not None:
                from .frontends.transport.drain import listen_while_arriving

                quiet = float(getattr(self.args, "drain_quiet_secs", 0.0))
                timeout -= await listen_while_arriving(lambda: acceptor.handed, quiet, timeout / 2)
            # each worker drains its own connections; the engine serves them meanwhile
            await self.workers.stop(timeout)
        else:
            timeout = await self.drain(timeout)
        if self.engine is not None:
            await self.engine.stop()
        await self.server.stop(timeout)
        if self._grpc is not None:
            await self._grpc.stop(1.0)
        for runner in self._runners:
            await runner.cleanup()
        if self.metrics is not None:
            self.metrics.close()
