"""Naiad's HTTP/2 gRPC server (H2GrpcServer) on its own uvloop thread in the test's process, for tests that talk to
it with raw frames and look inside it (monkeypatched methods, a transport that records its writes)."""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import uvloop

from naiad.frontends.grpc.server import H2GrpcServer


@contextmanager
def running(methods: dict, tls: ssl.SSLContext | None = None) -> Iterator[str]:
    """The server for `methods` ({b"/pkg.Service/Method": Method}) while the block runs: its "host:port"."""
    srv = H2GrpcServer(methods)
    loop = uvloop.new_event_loop()
    up = threading.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(srv.start("127.0.0.1", 0, ssl=tls))
        up.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert up.wait(10)
    port = srv._server.sockets[0].getsockname()[1]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(srv.stop(1), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


class Recorder:
    """The connection's transport, recording what it is asked to write."""

    def __init__(self, transport, written: list):
        self._transport = transport
        self._written = written

    def write(self, data) -> None:
        self._written.append([data])
        self._transport.write(data)

    def writelines(self, items) -> None:
        items = list(items)
        self._written.append(items)
        self._transport.writelines(items)

    def __getattr__(self, name):
        return getattr(self._transport, name)
