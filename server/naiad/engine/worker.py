"""A frontend worker process: HTTP, gRPC and the OpenAI API over an `EngineClient`, on connections the engine's
acceptor hands it (`--frontend-accept balanced`, adopter.py) or on SO_REUSEPORT sockets of its own; started by the engine (`python -m naiad.engine.worker <engine socket> serve <naiad serve's arguments>`). It exits
when the engine goes away, and drains its connections on SIGTERM."""

from __future__ import annotations

import argparse
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


async def run(path: str, args: argparse.Namespace) -> int:
    from ..endpoints import GRPC, HTTP, OPENAI, Endpoints
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
    adopter = None  # --frontend-accept balanced: the engine accepts, this worker adopts what it is handed
    if getattr(args, "frontend_accept", "reuseport") == "balanced":
        adopter = Adopter(os.path.join(os.path.dirname(path), "accept.sock"))
    listen = adopter is None
    # the same endpoints as one process serves (app.py), over the engine; every worker on the same ports
    endpoints = Endpoints(args)
    endpoints.create_openai(client)
    await endpoints.start(client, shm, reuse_port=True, listen=listen)
    if adopter is not None:
        kinds = {HTTP: acceptor.HTTP, OPENAI: acceptor.OPENAI, GRPC: acceptor.GRPC}
        for name, (factory, context) in endpoints.adoptable.items():
            adopter.add(kinds[name], factory, context)
    for reloading in endpoints.contexts:
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
    for reloading in endpoints.contexts:
        reloading.close()
    from ..frontends.transport.drain import drain

    # within the engine's wait for this worker (--exit-timeout-secs), which keeps serving it meanwhile
    budget = max(0.0, args.exit_timeout_secs - 1.0)
    quiet = args.drain_quiet_secs if listen else 0.0  # balanced: the engine's acceptor listened on (app.py)
    await drain(endpoints.runners, endpoints.grpc, args.drain_idle_connections_secs, budget, quiet)
    await endpoints.stop()
    client.close()
    return 0


def main(argv: list[str]) -> int:
    _die_with_parent()
    from ..logsettings import configure_logging
    from ..serve_flags import serve_parser

    path, rest = argv[0], argv[1:]
    args = serve_parser().parse_args(rest)
    configure_logging(args.log_verbose, args.log_info, args.log_format)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run(path, args))
    return uvloop.run(run(path, args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
