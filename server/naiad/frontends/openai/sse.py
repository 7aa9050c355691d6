"""Server-Sent Events for OpenAI streams: `data: {json}` events and `data: [DONE]`, written through aiohttp's bounded
buffer; a client that stops reading for longer than the stall timeout has its connection aborted."""

from __future__ import annotations

import asyncio
import socket

import orjson
from aiohttp import web

from ..http.sse import EventResponse

WRITE_BUFFER_HIGH = 64 * 1024  # bytes the transport holds for a slow reader before writes wait
KERNEL_SEND_BUFFER = 256 * 1024  # SO_SNDBUF of a streaming connection


class StreamStalled(Exception):
    """The client read nothing for the stall timeout: the stream is abandoned."""


class EventStream:
    def __init__(self, request: web.Request, stall_timeout: float):
        self.request = request
        self.stall_timeout = stall_timeout
        self.response = EventResponse()  # the headers go out with the first event
        self.started = False
        self._held: list[bytes] = []

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
        if self._held:
            data = b"".join((*self._held, data))
            self._held.clear()
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for wraps each write, each token, in a Task
            if (
                asyncio.current_task() is None
            ):  # (a coroutine driven outside a Task cannot be given a timeout)
                await asyncio.wait_for(self.response.write(data), self.stall_timeout)
            else:
                async with asyncio.timeout(self.stall_timeout):
                    await self.response.write(data)
        except TimeoutError:
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            raise StreamStalled() from None

    async def send(self, obj: dict) -> None:
        await self._write(b"data: " + orjson.dumps(obj) + b"\n\n")

    def hold(self, obj: dict) -> None:
        """An event that goes out with the next one, in the same write (the chat stream's role chunk waits for its
        first token: one send, one wakeup of the client)."""
        self._held.append(b"data: " + orjson.dumps(obj) + b"\n\n")

    async def done(self) -> web.StreamResponse:
        await self._write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
