"""The endpoints `naiad serve` serves over a server (`serving.Serving`): the HTTP, gRPC and OpenAI frontends, with
their TLS contexts (reloaded when the certificate files change) and restricted-API rules, each listening on its
port or serving connections accepted elsewhere. Written once for both ways Naiad runs: `app.App` in one process
over `Server`, and each frontend worker (`engine/worker.py`) over its `EngineClient`. (The metrics endpoint is the
app's own: the engine process serves it.)"""

from __future__ import annotations

import argparse
import asyncio
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .frontends.transport import tls
from .serve_flags import parse_restricted

if TYPE_CHECKING:
    from aiohttp import web

    from .frontends.grpc.frontend import GrpcFrontend
    from .frontends.http.frontend import HttpListener
    from .frontends.openai.routes import OpenAIFrontend
    from .serving import Serving

# the names `Endpoints.adoptable` gives the listeners that serve connections accepted elsewhere
HTTP, GRPC, OPENAI = "http", "grpc", "openai"


class Endpoints:
    """`Endpoints(args)` reads the flags (a TLS setting or restricted-API rule that is wrong stops the start before
    any model loads), `create_openai` makes the OpenAI frontend, `start` starts every endpoint the flags ask for;
    the caller starts `contexts` once everything listens, drains `runners` and `grpc`, and ends with `stop`."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.http_tls = tls.settings_from_args(args, "http")
        self.grpc_tls = tls.settings_from_args(args, "grpc")
        self.metrics_tls = tls.settings_from_args(args, "metrics", fallback=self.http_tls)
        self.http_restricted = parse_restricted(args.http_restricted_api)
        self.grpc_restricted = parse_restricted(args.grpc_restricted_protocol)
        self.openai: OpenAIFrontend | None = (
            None  # the OpenAI API's /v1 routes, on the HTTP port and --openai-port
        )
        self.runners: list[
            HttpListener | web.AppRunner
        ] = []  # the HTTP and OpenAI endpoints, each with cleanup()
        self.grpc: GrpcFrontend | None = None
        self.contexts: list[tls.ReloadingContext] = []  # the HTTP and OpenAI ports' (gRPC's reloads its own)
        # `listen=False`: what serves a connection of each kind handed to this process, and its TLS context
        self.adoptable: dict[str, tuple[Callable[[], asyncio.BaseProtocol], ssl.SSLContext | None]] = {}
        self.banner: list[str] = []  # "HTTPService at host:port (TLS)", ... for the log line of a start

    def create_openai(self, server: Serving) -> None:
        """The OpenAI frontend, when the HTTP port or --openai-port serves it; made before the models load, so that
        a --chat-template that cannot be read stops the start."""
        a = self.args
        if a.allow_http or a.openai_port:
            from .frontends.llm.media import media_settings_from_args
            from .frontends.openai.routes import OpenAIFrontend

            self.openai = OpenAIFrontend(
                server,
                chat_template=a.chat_template,
                stall_timeout=a.openai_stall_timeout,
                allow_runtime_lora=getattr(a, "allow_runtime_lora", False),
                media_settings=media_settings_from_args(a),
                max_input_size=a.http_max_input_size,
            )

    async def start(self, server: Serving, shm: Any, reuse_port: bool = False, listen: bool = True) -> None:
        """Start the HTTP, OpenAI and gRPC endpoints the flags ask for, over `server` and the shared-memory
        manager `shm`. `reuse_port`: bind with SO_REUSEPORT (a frontend worker, one of several on the same ports).
        `listen=False`: bind nothing (but grpcio's gRPC, which cannot adopt a socket); `adoptable` serves the
        connections the engine's acceptor hands this process."""
        a = self.args
        busy_poll = None
        if a.busy_poll_us:
            from .frontends.transport.busy_poll import BusyPoll

            busy_poll = BusyPoll(asyncio.get_running_loop(), a.busy_poll_us)
        if a.allow_http:
            from .frontends.http.frontend import HttpFrontend, protocol_factory

            http = HttpFrontend(
                server,
                shm=shm,
                max_input_size=a.http_max_input_size,
                restricted=self.http_restricted,
                busy_poll=busy_poll,
                openai=self.openai,
            )
            context = self._context(self.http_tls, "HTTP")
            started = await http.start(
                a.http_address, a.http_port, ssl=context, reuse_port=reuse_port, listen=listen
            )
            self.runners.append(started)
            self.banner.append(f"HTTPService at {a.http_address}:{a.http_port}{tls.describe(self.http_tls)}")
            if not listen:
                self.adoptable[HTTP] = (protocol_factory(started), context)
        if a.openai_port and self.openai is not None:
            # the OpenAI API on a port of its own (Triton's OpenAI app uses 9000), with the HTTP port's TLS and
            # restricted-API settings
            from .frontends.http.frontend import protocol_factory

            host = a.openai_address or a.http_address
            context = self._context(self.http_tls, "OpenAI")
            runner = await self.openai.start(
                host,
                a.openai_port,
                ssl=context,
                restricted=self.http_restricted,
                reuse_port=reuse_port,
                listen=listen,
            )
            self.runners.append(runner)
            self.banner.append(f"OpenAI API at {host}:{a.openai_port}{tls.describe(self.http_tls)}")
            if not listen:
                self.adoptable[OPENAI] = (protocol_factory(runner), context)
        if a.allow_grpc:
            from .frontends.grpc.frontend import GrpcFrontend, h2_settings

            grpc = self.grpc = GrpcFrontend(
                server,
                shm=shm,
                restricted=self.grpc_restricted,
                implementation=a.grpc_implementation,
                settings=h2_settings(a),
                busy_poll=busy_poll,
            )
            adopted = not listen and a.grpc_implementation != "grpcio"  # grpcio cannot adopt sockets
            await grpc.start(
                a.grpc_address, a.grpc_port, self.grpc_tls, reuse_port=reuse_port, listen=not adopted
            )
            self.banner.append(
                f"GRPCInferenceService at {a.grpc_address}:{a.grpc_port}{tls.describe(self.grpc_tls)}"
            )
            if adopted:
                self.adoptable[GRPC] = (grpc.protocol_factory, grpc.ssl_context)

    def _context(self, settings: tls.TlsSettings | None, name: str) -> ssl.SSLContext | None:
        """The TLS context of an HTTP/1.1 port (None: cleartext); it follows its files once `contexts` start."""
        if settings is None:
            return None
        reloading = tls.ReloadingContext(settings, ["http/1.1"], name)
        self.contexts.append(reloading)
        return reloading.context

    async def stop(self) -> None:
        """After the drain: stop gRPC, then the HTTP and OpenAI endpoints."""
        if self.grpc is not None:
            await self.grpc.stop(1.0)
        for runner in self.runners:
            await runner.cleanup()
