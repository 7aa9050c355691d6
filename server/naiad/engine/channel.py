"""One end of a worker-engine connection: an asyncio protocol that reads length-prefixed msgspec frames and
writes them coalesced, one write per event-loop turn however many messages were sent in it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from . import wire

log = logging.getLogger("naiad.engine")


class Channel(asyncio.Protocol):
    """`on_message(msg)` for each message read; `on_lost()` once when the peer goes away."""

    def __init__(self, on_message: Callable[[wire.Message], None], on_lost: Callable[[], None]):
        self.on_message = on_message
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.loop = asyncio.get_event_loop()
        self._rbuf = bytearray()
        self._wbuf: list[bytes] = []
        self._reading = False
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        if not self.closed:
            self.closed = True
            self.on_lost()

    def data_received(self, data: bytes) -> None:
        buf = self._rbuf
        buf += data
        off, end = 0, len(buf)
        decode = wire.decoder.decode
        length = wire.LENGTH.unpack_from
        self._reading = True  # what the messages answer is written at the end, not from a callback of its own
        try:
            with memoryview(buf) as view:
                while end - off >= 4:
                    (n,) = length(view, off)
                    if end - off - 4 < n:
                        break
                    msg = decode(view[off + 4 : off + 4 + n])
                    off += 4 + n
                    try:
                        self.on_message(msg)
                    except Exception:
                        log.exception("handling a %s message failed", type(msg).__name__)
        finally:
            self._reading = False
            if off:
                del buf[:off]
            if self._wbuf:  # what those messages answered at once goes out now, not a loop turn later
                self._flush()

    def send(self, msg: wire.Message) -> None:
        """Queue a message; everything queued in this loop turn (or this read) goes out in one write."""
        if self.closed:
            return
        if not self._wbuf and not self._reading:
            self.loop.call_soon(self._flush)
        self._wbuf.append(wire.frame(msg))

    def send_threadsafe(self, msg: wire.Message) -> None:
        self.loop.call_soon_threadsafe(self.send, msg)

    def _flush(self) -> None:
        chunks, self._wbuf = self._wbuf, []
        if self.transport is not None and not self.closed and chunks:
            self.transport.write(chunks[0] if len(chunks) == 1 else b"".join(chunks))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
