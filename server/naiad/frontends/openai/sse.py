"""Server-Sent Events for OpenAI streams: `data: {json}` events and `data: [DONE]`, written through aiohttp's bounded
buffer; a client that stops reading for longer than the stall timeout has its connection aborted."""

from __future__ import annotations

import asyncio
import socket

import orjson
from aiohttp import web

WRITE_BUFFER_HIGH = 64 * 1024  # bytes the transport holds for a slow reader before writes wait
KERNEL_SEND_BUFFER = 256 * 1024  # SO_SNDBUF of a streaming connection


class StreamStalled(Exception):
    """The client read nothing for the stall timeout: the stream is abandoned."""


class EventStream:
    def __init__(self, request: web.Request, stall_timeout: float):
        self.request = request
        self.stall_timeout = stall_timeout
        self.response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
        self.started = False

    async def start(self) -> None:
        if not self.started:
            await self.response.prepare(self.request)
            transport = self.request.transport
            if transport is not None:
                transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH)
                sock = transport.get_extra_info("socket")
                if sock is not None:
                    # the kernel's share of an unread stream is bounded too (autotuning lets it grow to MBs)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, KERNEL_SEND_BUFFER)
            self.started = True

    def gone(self) -> bool:
        """The client closed the connection."""
        transport = self.request.transport
        return transport is None or transport.is_closing()

    async def _write(self, data: bytes) -> None:
        await self.start()
        try:
            await asyncio.wait_for(self.response.write(data), self.stall_timeout)
        except asyncio.TimeoutError:
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            raise StreamStalled() from None

    async def send(self, obj: dict) -> None:
        await self._write(b"data: " + orjson.dumps(obj) + b"\n\n")

    async def done(self) -> web.StreamResponse:
        await self._write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
