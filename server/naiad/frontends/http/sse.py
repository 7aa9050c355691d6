"""Server-Sent Events, the one writer of Triton's generate_stream and the OpenAI streams: `data: {json}` events,
each written at once (`send`) or held to go out with the next one in the same write (`hold`).

The response's headers go out with its first event, in one write: aiohttp's StreamResponse writes its headers as
soon as it is prepared, so a stream's first event cost two writes (two loopback sends, two wakeups of the client)
before the client had its first token. Prepared only when the first event is ready, the headers wait for it a few
microseconds at most.

With a stall timeout (the OpenAI streams) the stream is written through aiohttp's bounded buffer, and a client that
stops reading for longer than the timeout has its connection aborted (StreamStalled); without one (generate_stream,
as Triton's) the events are written as aiohttp writes them.
"""

from __future__ import annotations

import asyncio
import socket

import orjson
from aiohttp import web

WRITE_BUFFER_HIGH = 64 * 1024  # bytes the transport holds for a slow reader before writes wait
KERNEL_SEND_BUFFER = 256 * 1024  # SO_SNDBUF of a streaming connection
DONE = b"data: [DONE]\n\n"  # the OpenAI streams' last event


def _event(obj: dict, name: str | None) -> bytes:
    data = b"data: " + orjson.dumps(obj) + b"\n\n"
    return data if name is None else b"event: " + name.encode() + b"\n" + data


class EventResponse(web.StreamResponse):
    """A `text/event-stream` response; `prepare()` buffers the headers until the first `write()` (or the end)."""

    _send_headers_immediately = False  # aiohttp's own switch (web.Response turns it off the same way)

    def __init__(self) -> None:
        super().__init__(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )


class StreamStalled(Exception):
    """The client read nothing for the stall timeout: the stream is abandoned."""


class EventStream:
    """One event stream answering `request`. `response` (an EventResponse) may have its status and headers set
    until the stream starts; `stall_timeout` (seconds, or None): see the module's docstring."""

    def __init__(self, request: web.Request, stall_timeout: float | None = None):
        self.request = request
        self.stall_timeout = stall_timeout
        self.response = EventResponse()  # the headers go out with the first event
        self.started = False
        self._held: list[bytes] = []

    async def start(self) -> None:
        if not self.started:
            await self.response.prepare(self.request)
            transport = self.request.transport
            if transport is not None and self.stall_timeout is not None:
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
        transport = self.request.transport
        if (
            self.stall_timeout is None
            or transport is None
            or transport.get_write_buffer_size() + len(data) <= WRITE_BUFFER_HIGH
        ):
            # a write that cannot wait (the transport stays under its high mark: aiohttp's drain returns at once)
            # needs no timeout: the stream's usual case, and a timeout a token cost ~4% of the OpenAI stream's loop
            await self.response.write(data)
            return
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

    async def send(self, obj: dict, event: str | None = None) -> None:
        """An event, written now (with the events held before it); `event`: its name (an `event:` line, as the
        Responses API and Anthropic's Messages name theirs)."""
        await self._write(_event(obj, event))

    def hold(self, obj: dict, event: str | None = None) -> None:
        """An event that goes out with the next one, in the same write (the chat stream's role chunk waits for its
        first token; a response whose next one is already waiting waits for it: one send, one wakeup of the
        client)."""
        self._held.append(_event(obj, event))

    async def end(self, last: bytes | None = None) -> web.StreamResponse:
        """The end of the stream: the events still held, and `last` (raw bytes, such as DONE), in one write if
        there is anything to write, then the end of the response."""
        await self.start()
        if last is not None or self._held:
            await self._write(last or b"")
        await self.response.write_eof()
        return self.response

    async def done(self) -> web.StreamResponse:
        """The OpenAI streams' end: the `data: [DONE]` event, then the end of the response."""
        return await self.end(DONE)
