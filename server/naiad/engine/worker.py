"""A frontend worker process: HTTP, gRPC and the OpenAI API over an `EngineClient`, on connections the engine's
acceptor hands it (`--frontend-accept balanced`, adopter.py) or on SO_REUSEPORT sockets of its own; started by the engine (`python -m naiad.engine.worker <engine socket> serve <naiad serve's arguments>`). It exits
when the engine goes away, and drains its connections on SIGTERM."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger("naiad.worker")

ENGINE_GONE = 3  # the worker's exit status when the engine process went away


def _die_with_parent() -> None:
    """SIGTERM when the engine process dies, however it dies (Linux)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


async def run(path: str, args) -> int:
    from ..app import parse_restricted
    from ..frontends.transport import tls
    from ..frontends.transport.receive_buffers import POOL
    from . import acceptor
    from .adopter import Adopter
    from .client import EngineClient
    from .remote_shm import RemoteSharedMemory

    client = EngineClient(path)
    shm = client.shm = RemoteSharedMemory(client.control, enabled=args.allow_client_shm)
    # large request bodies land in shared memory the engine maps: their tensors reach it without a copy
    POOL.share(client.pool)
    from ..llm import images, tokenizing
    from ..stop_signals import StopSignals

    tokenizing.configure(args.llm_tokenize_timeout_secs)
    images.configure(args.max_image_bytes, args.max_image_pixels, args.max_images_per_request)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # SIGHUP: the engine reopens the log file; a worker has none
    StopSignals(loop, stop.set, args.exit_timeout_secs, name="naiad-worker").install()
    busy_poll = None
    if args.busy_poll_us:
        from ..frontends.transport.busy_poll import BusyPoll

        busy_poll = BusyPoll(loop, args.busy_poll_us)
    runners: list = []  # each with cleanup(): HttpListener or web.AppRunner
    contexts: list = []
    grpc_frontend = None
    adopter = None  # --frontend-accept balanced: the engine accepts, this worker adopts what it is handed
    if getattr(args, "frontend_accept", "reuseport") == "balanced":
        adopter = Adopter(os.path.join(os.path.dirname(path), "accept.sock"))
    listen = adopter is None
    openai = None  # the OpenAI API's /v1 routes, on the HTTP port and on --openai-port
    if args.allow_http or args.openai_port:
        from ..frontends.llm.media import media_settings_from_args
        from ..frontends.openai.routes import OpenAIFrontend

        openai = OpenAIFrontend(
            client,
            chat_template=args.chat_template,
            stall_timeout=args.openai_stall_timeout,
            allow_runtime_lora=getattr(args, "allow_runtime_lora", False),
            media_settings=media_settings_from_args(args),
            max_input_size=args.http_max_input_size,
        )
    if args.allow_http:
        from ..frontends.http.frontend import HttpFrontend

        http = HttpFrontend(
            client,  # type: ignore[arg-type]
            shm=shm,
            max_input_size=args.http_max_input_size,
            restricted=parse_restricted(args.http_restricted_api),
            busy_poll=busy_poll,
            openai=openai,
        )
        settings = tls.settings_from_args(args, "http")
        context = None
        if settings is not None:
            reloading = tls.ReloadingContext(settings, ["http/1.1"], "HTTP")
            contexts.append(reloading)
            context = reloading.context
        started = await http.start(
            args.http_address, args.http_port, ssl=context, reuse_port=True, listen=listen
        )
        runners.append(started)
        if adopter is not None:
            from ..frontends.http.frontend import protocol_factory

            adopter.add(acceptor.HTTP, protocol_factory(started), context)
    if args.openai_port and openai is not None:  # with the HTTP port's TLS and restricted-API settings
        settings = tls.settings_from_args(args, "http")
        context = None
        if settings is not None:
            reloading = tls.ReloadingContext(settings, ["http/1.1"], "OpenAI")
            contexts.append(reloading)
            context = reloading.context
        host = args.openai_address or args.http_address
        restricted = parse_restricted(args.http_restricted_api)
        openai_runner = await openai.start(
            host, args.openai_port, ssl=context, restricted=restricted, reuse_port=True, listen=listen
        )
        runners.append(openai_runner)
        if adopter is not None:
            from ..frontends.http.frontend import protocol_factory

            adopter.add(acceptor.OPENAI, protocol_factory(openai_runner), context)
    if args.allow_grpc:
        from ..frontends.grpc.frontend import GrpcFrontend, h2_settings

        grpc_frontend = GrpcFrontend(
            client,  # type: ignore[arg-type]
            shm=shm,
            restricted=parse_restricted(args.grpc_restricted_protocol),
            implementation=args.grpc_implementation,
            settings=h2_settings(args),
            busy_poll=busy_poll,
        )
        adopt_grpc = (
            adopter is not None and args.grpc_implementation != "grpcio"
        )  # grpcio cannot adopt sockets
        await grpc_frontend.start(
            args.grpc_address,
            args.grpc_port,
            tls.settings_from_args(args, "grpc"),
            reuse_port=True,
            listen=not adopt_grpc,
        )
        if adopter is not None and adopt_grpc:
            adopter.add(acceptor.GRPC, grpc_frontend.protocol_factory, grpc_frontend.ssl_context)
    for reloading in contexts:
        reloading.start()
    if adopter is not None:
        adopter.start()
    await client.connect()  # the engine counts a worker as started once its data channel is up
    lost = loop.create_task(client.lost.wait())
    stopping = loop.create_task(stop.wait())
    await asyncio.wait({lost, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if client.lost.is_set():
        log.error("frontend worker %d: the engine process is gone; exiting", os.getpid())
        client.pool.close()
        return ENGINE_GONE
    if adopter is not None:
        adopter.close()
    for reloading in contexts:
        reloading.close()
    from ..frontends.transport.drain import drain

    # within the engine's wait for this worker (--exit-timeout-secs), which keeps serving it meanwhile
    budget = max(0.0, args.exit_timeout_secs - 1.0)
    quiet = args.drain_quiet_secs if listen else 0.0  # balanced: the engine's acceptor listened on (app.py)
    await drain(runners, grpc_frontend, args.drain_idle_connections_secs, budget, quiet)
    if grpc_frontend is not None:
        await grpc_frontend.stop(1.0)
    for runner in runners:
        await runner.cleanup()
    client.close()
    return 0


def main(argv: list[str]) -> int:
    _die_with_parent()
    from ..cli import build_parser, configure_logging

    path, rest = argv[0], argv[1:]
    args = build_parser().parse_args(rest)
    configure_logging(args.log_verbose, args.log_info, args.log_format)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run(path, args))
    return uvloop.run(run(path, args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
