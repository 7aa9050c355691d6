"""The gRPC frontend: serves the gRPC services on Naiad's own HTTP/2 server (server.py) or on grpc.aio, with
TLS, restricted protocols, health status and the --grpc-* limits. The handlers are service.py's, the message
conversion codec.py's."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import grpc
from tritonclient.grpc import service_pb2 as pb
from tritonclient.grpc import service_pb2_grpc as pb_grpc

from ...serving import Serving
from ..transport import tls
from . import wire
from .restricted import RestrictInterceptor, api_group, denial
from .service import HealthServicer, InferenceServicer

if TYPE_CHECKING:
    from .server import H2GrpcServer

log = logging.getLogger("naiad.grpc")

_SERVING_NAMES = ("", "inference.GRPCInferenceService")


def grpcio_options(settings, reuse_port: bool = False) -> list[tuple[str, int]]:
    """grpc.aio server options (channel arguments) for the same limits and timers as server.GrpcSettings;
    `reuse_port`: SO_REUSEPORT, for frontend worker processes (else a second server on the port fails to bind)."""
    from .h2.connection import MAX_MESSAGE

    s = settings
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE),
        ("grpc.max_receive_message_length", s.max_message),
        ("grpc.so_reuseport", 1 if reuse_port else 0),
        ("grpc.keepalive_time_ms", s.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", s.keepalive_timeout_ms),
        ("grpc.http2.ping_timeout_ms", s.keepalive_timeout_ms),  # grpc core's own PING watchdog (1 min)
        ("grpc.keepalive_permit_without_calls", int(s.keepalive_permit_without_calls)),
        ("grpc.http2.max_pings_without_data", s.http2_max_pings_without_data),
        ("grpc.http2.min_ping_interval_without_data_ms", s.http2_min_recv_ping_interval_without_data_ms),
        ("grpc.http2.max_ping_strikes", s.http2_max_ping_strikes),
    ]
    if s.max_concurrent_streams:
        options.append(("grpc.max_concurrent_streams", s.max_concurrent_streams))
    if s.max_connection_idle_ms:
        options.append(("grpc.max_connection_idle_ms", s.max_connection_idle_ms))
    if s.handshake_timeout_ms:
        options.append(("grpc.server_handshake_timeout_ms", s.handshake_timeout_ms))
    return options


def h2_settings(args):
    """GrpcSettings (the HTTP/2 server's and the gRPC layer's) from `naiad serve`'s --grpc-* flags (absent flags
    keep their defaults)."""
    from .server import GrpcSettings

    names = {
        "max_concurrent_streams": "grpc_max_concurrent_streams",
        "max_message": "grpc_max_message_size",
        "max_decompression_ratio": "grpc_max_decompression_ratio",
        "keepalive_time_ms": "grpc_keepalive_time",
        "keepalive_timeout_ms": "grpc_keepalive_timeout",
        "keepalive_permit_without_calls": "grpc_keepalive_permit_without_calls",
        "http2_max_pings_without_data": "grpc_http2_max_pings_without_data",
        "http2_min_recv_ping_interval_without_data_ms": "grpc_http2_min_recv_ping_interval_without_data",
        "http2_max_ping_strikes": "grpc_http2_max_ping_strikes",
        "handshake_timeout_ms": "grpc_handshake_timeout",
        "max_connection_idle_ms": "grpc_max_connection_idle",
        "stall_timeout_ms": "grpc_stall_timeout",
    }
    given = {
        field: getattr(args, flag) for field, flag in names.items() if getattr(args, flag, None) is not None
    }
    return GrpcSettings(**given)


class GrpcFrontend:
    """`implementation`: "naiad" (our HTTP/2 server, server.py) or "grpcio" (grpc.aio)."""

    def __init__(
        self,
        server: Serving,
        shm=None,
        restricted: dict | None = None,
        implementation: str = "naiad",
        settings=None,
        busy_poll=None,
    ):
        from .server import GrpcSettings

        self.settings = settings or GrpcSettings()
        self.server = server
        self.servicer = InferenceServicer(server, shm, server.log_settings, server.tracer)
        self.restricted = restricted or {}
        self.implementation = implementation
        self.busy_poll = busy_poll  # busy_poll.BusyPoll, for the naiad implementation
        # Naiad's HTTP/2 server, or grpcio's grpc.aio.Server (grpcio has no inline types), once started
        self._grpc: H2GrpcServer | Any | None = None
        self._health: HealthServicer | Any | None = None  # (grpcio's: grpc_health's, untyped too)
        self._tls_context: tls.ReloadingContext | None = None

    async def start(
        self, host: str, port: int, tls_settings=None, reuse_port: bool = False, listen: bool = True
    ) -> None:
        """`tls_settings` (tls.TlsSettings): serve over TLS, reloading the certificate when its files change.
        `reuse_port`: SO_REUSEPORT for frontend worker processes (grpcio sets it on every port already).
        `listen=False` (Naiad's HTTP/2 server only; grpcio cannot adopt sockets): bind nothing; the engine's
        acceptor hands this worker its connections (`protocol_factory`, `ssl_context`)."""
        if self.implementation == "grpcio":
            await self._start_grpcio(host, port, tls_settings, reuse_port)
        else:
            await self._start_h2(host, port, tls_settings, reuse_port, listen)

    @property
    def protocol_factory(self):
        """What serves a connection accepted elsewhere (Naiad's HTTP/2 server)."""
        return self._grpc.protocol_factory

    @property
    def ssl_context(self):
        return self._tls_context.context if self._tls_context is not None else None

    async def _start_h2(
        self, host: str, port: int, tls_settings=None, reuse_port: bool = False, listen: bool = True
    ) -> None:
        from .server import H2GrpcServer, service_methods

        methods = service_methods(
            pb.DESCRIPTOR.services_by_name["GRPCInferenceService"],
            self.servicer,
            api_group,
            request_types={
                "ModelInfer": wire.SplitInferRequest,
                "ModelStreamInfer": wire.SplitInferRequest,
            },
        )
        try:
            from grpc_health.v1 import health_pb2

            self._health = HealthServicer()
            methods.update(service_methods(health_pb2.DESCRIPTOR.services_by_name["Health"], self._health))
        except ImportError:
            log.warning("grpcio-health-checking is not installed: grpc.health.v1 is not served")
        authorize = None
        if self.restricted:
            rules = self.restricted

            def authorize(method, metadata):
                return denial(
                    rules, method.group, ((k.decode("latin-1"), v.decode("latin-1")) for k, v in metadata)
                )

        server = self._grpc = H2GrpcServer(methods, authorize, self.settings, self.busy_poll)
        context = None
        if tls_settings is not None:
            reloading = self._tls_context = tls.ReloadingContext(tls_settings, ["h2"], "gRPC")
            context = reloading.context
        try:
            await server.start(host, port, ssl=context, reuse_port=reuse_port, listen=listen)
        except OSError as exc:
            raise OSError(f"cannot bind gRPC to {host}:{port}: {exc}") from exc
        if self._tls_context is not None:
            self._tls_context.start()
        await self._set_health("SERVING")

    async def _set_health(self, status: str) -> None:
        if self._health is None:
            return
        from grpc_health.v1 import health_pb2

        value = health_pb2.HealthCheckResponse.ServingStatus.Value(status)
        for svc in _SERVING_NAMES:
            result = self._health.set(svc, value)
            if asyncio.iscoroutine(result):
                await result

    async def _start_grpcio(self, host: str, port: int, tls_settings=None, reuse_port: bool = False) -> None:
        options = grpcio_options(self.settings, reuse_port)
        interceptors = [RestrictInterceptor(self.restricted)] if self.restricted else []
        server = self._grpc = grpc.aio.server(options=options, interceptors=interceptors)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(self.servicer, server)
        try:
            from grpc_health.v1 import health, health_pb2_grpc

            self._health = health.aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        except ImportError:
            log.warning("grpcio-health-checking is not installed: grpc.health.v1 is not served")
        addr = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if tls_settings is not None:
            bound = server.add_secure_port(addr, tls.grpcio_credentials(tls_settings))
        else:
            bound = server.add_insecure_port(addr)
        if bound == 0:
            raise OSError(f"cannot bind gRPC to {addr}")
        await server.start()
        await self._set_health("SERVING")

    def accepted(self) -> int:
        """Connections accepted so far (Naiad's HTTP/2 server; grpcio's does not tell, so 0)."""
        return 0 if self._grpc is None or self.implementation == "grpcio" else self._grpc.accepted

    async def drain(self, timeout: float) -> None:
        """SIGTERM: no new connections; calls on open ones finish (up to `timeout`). Naiad's HTTP/2 server sends a
        two-step GOAWAY; grpcio's server.stop(grace) sends GOAWAY too and waits for the calls in flight."""
        await self._set_health("NOT_SERVING")
        if self._grpc is None:
            return
        if self.implementation == "grpcio":
            await self._grpc.stop(timeout)
        else:
            await self._grpc.drain(timeout)

    async def stop(self, grace: float) -> None:
        await self._set_health("NOT_SERVING")
        if self._tls_context is not None:
            self._tls_context.close()
        if self._grpc is not None:
            await self._grpc.stop(grace)
