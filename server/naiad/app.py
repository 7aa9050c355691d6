"""The running process: a Server plus its HTTP, gRPC and metrics endpoints, started and stopped together."""

from __future__ import annotations

import argparse
import logging
import os

from . import host_pinning
from .endpoints import Endpoints
from .frontends.transport import receive_buffers
from .server import Server, ServerOptions

log = logging.getLogger("naiad")


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
        self._endpoints: Endpoints | None = (
            None  # HTTP, gRPC and the OpenAI API, when this process serves them
        )
        self._runners: list = []  # the metrics endpoint's
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
        # the flags of the HTTP, gRPC and OpenAI endpoints (and the metrics port's TLS): a bad one stops the start
        endpoints = self._endpoints = Endpoints(a)
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
        endpoints.create_openai(
            self.server
        )  # before the models load: a --chat-template that cannot be read stops it
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
            await endpoints.start(self.server, shm)
            self.endpoints.extend(endpoints.banner)
            self._tls_contexts.extend(endpoints.contexts)
        else:
            await self._start_workers(shm, workers)
        if self.metrics is not None:
            host = a.metrics_address or a.http_address
            context = self._tls_context(endpoints.metrics_tls, ["http/1.1"], "metrics")
            self._runners.append(await self.metrics.start(host, a.metrics_port, ssl=context))
            self.endpoints.append(
                f"Metrics Service at {host}:{a.metrics_port}{tls.describe(endpoints.metrics_tls)}"
            )
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
        endpoints = self._endpoints
        runners = [*endpoints.runners, *self._runners] if endpoints is not None else self._runners
        return await drain(runners, endpoints.grpc if endpoints is not None else None, grace, timeout, quiet)

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
        if self._endpoints is not None:
            await self._endpoints.stop()  # gRPC, then the HTTP and OpenAI endpoints
        for runner in self._runners:
            await runner.cleanup()
        if self.metrics is not None:
            self.metrics.close()
