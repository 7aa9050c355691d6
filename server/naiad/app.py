"""The running process: a Server plus its HTTP, gRPC and metrics endpoints, started and stopped together."""

from __future__ import annotations

import argparse
import logging

from .server import Server, ServerOptions

log = logging.getLogger("naiad")


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
            self.metrics = Metrics(self.server, parse_metrics_config(a.metrics_config),
                                   cpu=a.allow_cpu_metrics, gpu=a.allow_gpu_metrics,
                                   interval_ms=a.metrics_interval_ms)
        await self.server.start()
        if a.allow_http:
            from .frontends.http import HttpFrontend
            http = HttpFrontend(self.server, max_input_size=a.http_max_input_size)
            self._runners.append(await http.start(a.http_address, a.http_port))
            self.endpoints.append(f"HTTPService at {a.http_address}:{a.http_port}")
        if a.allow_grpc:
            from .frontends.grpc import GrpcFrontend
            self._grpc = GrpcFrontend(self.server)
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
