"""The running process: a Server plus its HTTP, gRPC and metrics endpoints, started and stopped together."""

from __future__ import annotations

import argparse
import logging

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
)


def parse_restricted(items: list[str]) -> dict[str, tuple[str, str]]:
    """`<api>[,<api>...]:<header>=<value>` (repeatable) -> {api: (header, value)}."""
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
            out[api] = (key.strip().lower(), value)
    return out


def parse_trace_config(items: list[str]) -> dict:
    """`--trace-config key=value` (tritonserver's spelling; `level` may repeat)."""
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"invalid --trace-config '{item}', expected <setting>=<value>")
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
    return out


class App:
    def __init__(self, options: ServerOptions, args: argparse.Namespace):
        self.args = args
        self.server = Server(options)
        self.metrics = None
        self._runners: list = []
        self._grpc = None
        self.endpoints: list[str] = []

    async def start(self) -> None:
        a = self.args
        if a.allow_metrics:
            from .metrics import Metrics, parse_metrics_config

            self.metrics = Metrics(
                self.server,
                parse_metrics_config(a.metrics_config),
                cpu=a.allow_cpu_metrics,
                gpu=a.allow_gpu_metrics,
                interval_ms=a.metrics_interval_ms,
            )
        self.server.log_settings.update(
            {
                "log_verbose_level": a.log_verbose,
                "log_info": a.log_info,
                "log_warning": a.log_warning,
                "log_error": a.log_error,
            }
        )
        if a.trace_config:
            self.server.tracer.update(parse_trace_config(a.trace_config))
        from .gpu import shared_memory_manager  # system shared memory, plus CUDA shared memory with a GPU

        shm = shared_memory_manager(self.server, enabled=a.allow_client_shm)
        await self.server.start()
        if a.allow_http:
            from .frontends.http import HttpFrontend

            http = HttpFrontend(
                self.server,
                shm=shm,
                max_input_size=a.http_max_input_size,
                restricted=parse_restricted(a.http_restricted_api),
            )
            self._runners.append(await http.start(a.http_address, a.http_port))
            self.endpoints.append(f"HTTPService at {a.http_address}:{a.http_port}")
        if a.allow_grpc:
            from .frontends.grpc import GrpcFrontend, h2_settings

            self._grpc = GrpcFrontend(
                self.server,
                shm=shm,
                restricted=parse_restricted(a.grpc_restricted_protocol),
                implementation=a.grpc_implementation,
                settings=h2_settings(a),
            )
            await self._grpc.start(a.grpc_address, a.grpc_port)
            self.endpoints.append(f"GRPCInferenceService at {a.grpc_address}:{a.grpc_port}")
        if self.metrics is not None:
            host = a.metrics_address or a.http_address
            self._runners.append(await self.metrics.start(host, a.metrics_port))
            self.endpoints.append(f"Metrics Service at {host}:{a.metrics_port}")

    def endpoints_banner(self) -> str:
        return "Started " + ", ".join(self.endpoints)

    async def stop(self, timeout: float) -> None:
        await self.server.stop(timeout)
        if self._grpc is not None:
            await self._grpc.stop(1.0)
        for runner in self._runners:
            await runner.cleanup()
        if self.metrics is not None:
            self.metrics.close()
