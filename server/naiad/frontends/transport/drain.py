"""Graceful drain on SIGTERM (as Go's http.Server.Shutdown, Envoy's drain and grpc-go's GracefulStop do it): keep
listening while new connections still arrive (`--drain-quiet-secs`: behind a Kubernetes Service they do until the
endpoint's removal reaches kube-proxy), then stop listening, serve what still arrives on open connections (HTTP/1.1
answers with `Connection: close`, gRPC after a two-step GOAWAY), close idle connections after a grace, and return
once every connection is closed or at the deadline."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

from aiohttp import hdrs, web

log = logging.getLogger("naiad")


class DrainState:
    """Whether an aiohttp app is draining (its responses then carry `Connection: close`), and how many connections
    its listening sites have accepted (count_connections)."""

    __slots__ = ("accepted", "draining")

    def __init__(self) -> None:
        self.draining = False
        self.accepted = 0


DRAIN_STATE = web.AppKey("naiad_drain_state", DrainState)


def install(app: web.Application) -> None:
    """Before the app is frozen: once draining, every response closes its connection after it is sent."""
    state = app[DRAIN_STATE] = DrainState()

    async def close_when_draining(request: web.BaseRequest, response: web.StreamResponse) -> None:
        if state.draining:
            response.force_close()  # aiohttp's handler closes the connection after this response
            response.headers[hdrs.CONNECTION] = "close"

    app.on_response_prepare.append(close_when_draining)


class _ConnectionHook(Protocol):
    """aiohttp's web.Server as `count_connections` sees it: `connection_made`, which its RequestHandlers call, may
    be set on the instance, in front of the class's method."""

    connection_made: Callable[[Any, Any], None]


def count_connections(runner: web.AppRunner) -> None:
    """Once `runner` is set up and listens: count the connections its aiohttp server accepts, in the app's
    DrainState (aiohttp's RequestHandler reports each one to its server's `connection_made`)."""
    if DRAIN_STATE not in runner.app:
        return
    state = runner.app[DRAIN_STATE]
    server = runner.server
    assert server is not None
    made = server.connection_made

    def connection_made(handler: Any, transport: Any) -> None:
        state.accepted += 1
        made(handler, transport)

    cast(_ConnectionHook, server).connection_made = connection_made


class HttpDrain:
    """One HTTP listener: a web.AppRunner, or http.HttpListener (the fast path in front of an aiohttp app)."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.fast = getattr(runner, "fast", None)
        self.aiohttp_runner: web.AppRunner = runner.runner if self.fast is not None else runner

    @staticmethod
    def drains(runner: Any) -> bool:
        """Only the apps that install() was called on drain (the metrics endpoint simply closes)."""
        inner = getattr(runner, "runner", runner)
        app = getattr(inner, "app", None)
        return app is not None and DRAIN_STATE in app

    def start(self) -> None:
        """Stop listening; responses from now on carry `Connection: close`."""
        listener = getattr(self.runner, "listener", None)
        if listener is not None:
            listener.close()
        for site in self.aiohttp_runner.sites:
            server = getattr(site, "_server", None)  # aiohttp keeps the asyncio.Server of a TCPSite there
            if server is not None:
                server.close()
        self.aiohttp_runner.app[DRAIN_STATE].draining = True
        if self.fast is not None:
            self.fast.draining = True

    def close_idle(self) -> None:
        """The grace is over: close the connections that wait for a request."""
        if self.fast is not None:
            self.fast.close_idle()
        server = self.aiohttp_runner.server
        if server is not None:
            for handler in server.connections:
                # (aiohttp 3.x's RequestHandler waits on _waiter for the next request; close() alone would
                # cancel that wait but leave the socket open)
                if handler._waiter is not None and not handler._messages:
                    handler.force_close()
                else:
                    handler.close()  # busy: closes after its response

    def accepted(self) -> int:
        """Connections accepted so far (the fast path hands aiohttp the ones it does not serve: counted once)."""
        fast = self.fast.accepted if self.fast is not None else 0
        return fast + self.aiohttp_runner.app[DRAIN_STATE].accepted

    def open_connections(self) -> int:
        """Connections not yet closed by either side. A connection aiohttp has closed (force_close drops its
        transport) stays in its server's list until the transport reports the loss, which over TLS waits for the
        client's close_notify, up to the SSL shutdown timeout (30 s): a client that simply closed its socket, as
        Python's and most others do, never sends one, so such a connection would hold the drain to its deadline."""
        n = len(self.fast.connections) if self.fast is not None else 0
        server = self.aiohttp_runner.server
        if server is not None:
            n += sum(1 for handler in server.connections if handler.transport is not None)
        return n


async def listen_while_arriving(accepted: Callable[[], int], quiet: float, limit: float) -> float:
    """Return once `accepted()` (connections accepted so far) has not grown for `quiet` seconds, or after `limit`:
    the seconds that took.

    A pod behind a Service is still sent new connections after SIGTERM until the EndpointSlice change reaches
    every node's kube-proxy; the pod's preStop delay usually covers that, but on a busy node it can take longer,
    and a closed listener then answers those connections with a reset ("connection refused")."""
    if quiet <= 0 or limit <= 0:
        return 0.0
    loop = asyncio.get_running_loop()
    start = last = loop.time()
    first = seen = accepted()
    step = min(0.05, quiet / 4)
    while True:
        await asyncio.sleep(step)
        now = loop.time()
        count = accepted()
        if count != seen:
            seen, last = count, now
        if now - last >= quiet or now - start >= limit:
            break
    how = f"none for {quiet:g}s" if now - last >= quiet else f"still arriving; {limit:g}s at most"
    log.info(
        "listened %.1fs after SIGTERM: %d new connection(s) (%s); closing the listeners",
        now - start,
        seen - first,
        how,
    )
    return now - start


async def drain(runners: list, grpc: Any, idle_grace: float, timeout: float, quiet: float = 0.0) -> float:
    """Drain the HTTP listeners in `runners` and the gRPC frontend `grpc` (or None): returns the seconds left of
    `timeout` once every connection is closed (or none, at the deadline). `quiet` > 0: first keep listening until
    no connection has arrived for that long (at most half the timeout)."""
    deadline = time.monotonic() + timeout
    https = [HttpDrain(r) for r in runners if HttpDrain.drains(r)]

    def accepted() -> int:
        return sum(h.accepted() for h in https) + (grpc.accepted() if grpc is not None else 0)

    await listen_while_arriving(accepted, quiet, timeout / 2)
    for h in https:
        h.start()
    grpc_task = None
    if grpc is not None:
        grpc_task = asyncio.ensure_future(grpc.drain(timeout))
    grace_end = time.monotonic() + min(idle_grace, timeout)
    idle_closed = False
    while True:
        now = time.monotonic()
        if not idle_closed and now >= grace_end:
            for h in https:
                h.close_idle()
            idle_closed = True
        http_open = sum(h.open_connections() for h in https)
        grpc_done = grpc_task is None or grpc_task.done()
        if (http_open == 0 and grpc_done) or now >= deadline:
            break
        await asyncio.sleep(0.05)
    if grpc_task is not None:
        if not grpc_task.done():
            grpc_task.cancel()
        for outcome in await asyncio.gather(grpc_task, return_exceptions=True):
            if isinstance(outcome, Exception):
                log.error("gRPC drain failed: %r", outcome)
    left = max(0.0, deadline - time.monotonic())
    log.info("drained the frontends' connections (%.1fs of the exit timeout left)", left)
    return left
