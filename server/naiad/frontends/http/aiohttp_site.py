"""An aiohttp app's TCP site bound as every Naiad HTTP listener binds it (reuse address, SO_REUSEPORT for frontend
workers, a deep backlog, optional TLS)."""

from __future__ import annotations

import ssl as ssl_module

from aiohttp import web

from ..transport.drain import count_connections


async def start_tcp_site(
    runner: web.AppRunner, host: str, port: int, ssl: ssl_module.SSLContext | None, reuse_port: bool
) -> web.TCPSite:
    """Listen on host:port with the runner's app; `reuse_port`: SO_REUSEPORT, so every frontend worker listens."""
    site = web.TCPSite(
        runner,
        host,
        port,
        reuse_address=True,
        reuse_port=reuse_port or None,
        backlog=1024,
        ssl_context=ssl,
    )
    await site.start()
    count_connections(runner)  # an app that drains (drain.install) keeps listening while connections arrive
    return site
