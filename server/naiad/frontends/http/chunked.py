"""A chunked HTTP/1.1 request body decoded in place into a pooled receive buffer, for the fast infer path.

The kernel reads a chunk's data straight to where it belongs in the body (the read is sized to what the chunk
still owes), and only the bytes that arrive in the same read as a chunk's size line are moved down over it, so a
large body costs the copy of the kernel's read and no other, as one with a Content-Length does. The buffer comes
from the receive pool at the size the last chunked body to the same route had; a body that outgrows it moves once
into one twice as large. Framing follows RFC 9112 7.1: hexadecimal sizes, chunk extensions ignored, trailer fields
read and dropped (the request's meaning is in its head); anything else is a 400 and the connection closes.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from ..transport.receive_buffers import POOL, POOLED_MIN, Connection, ConnectionReader, size_class

MAX_LINE = 4096  # a chunk-size line (with extensions) or a trailer field
MAX_TRAILER = 64 * 1024  # all trailer fields together
HEAD_READ = 64 * 1024  # a read that may hold a size line: what follows it is moved down over it
MIN_HEAD_READ = 4096  # such a read takes the room left in the buffer, if it is at least this much
LARGE_CHUNK = (
    16 * 1024
)  # after a chunk this large, a read for the next size line asks for LINE_READ bytes only
LINE_READ = (
    64  # (so the next chunk's data is read in place, not moved); a chunk's data read asks for this more
)
_HEX = frozenset(b"0123456789abcdefABCDEF")

# where the decoder is in the body
_SIZE = 0  # reading a chunk-size line
_DATA = 1  # in a chunk's data (`remaining` bytes still to come)
_DATA_END = 2  # the CRLF after a chunk's data
_TRAILER = 3  # after the last chunk: trailer fields up to an empty line
_LONG_LINE = {
    _SIZE: "chunk size line too long",
    _DATA_END: "chunk data longer than its size",
    _TRAILER: "trailer field too long",
}


class ChunkError(Exception):
    """Bad chunked framing (400), or a body over the size limit (413)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class ChunkedConnection(Connection, Protocol):
    """What the reader needs of the connection it reads for (fast.py's FastHttpProtocol)."""

    loop: asyncio.AbstractEventLoop
    last_active: float

    def chunked_received(self, reader: ChunkedBodyReader) -> None:
        """The last chunk and the trailer are in."""

    def chunked_failed(self, reader: ChunkedBodyReader, exc: ChunkError) -> None:
        """The framing is bad, or the body is over the limit."""


class ChunkedBodyReader(ConnectionReader[ChunkedConnection]):
    """The transport's protocol while a chunked body arrives. The decoded body is `buf[:out]`; the bytes
    `buf[pos:end]` were read but not yet decoded (a partial size line, or what follows the body)."""

    __slots__ = (
        "buf",
        "end",
        "fill",
        "large",
        "limit",
        "out",
        "pos",
        "remaining",
        "state",
        "trailer",
        "view",
    )

    def __init__(self, conn: ChunkedConnection, size_hint: int, limit: int):
        self.conn = conn
        self.limit = limit  # the most decoded bytes a body may have
        self.buf = POOL.take(min(max(size_hint + MIN_HEAD_READ, POOLED_MIN), limit + MAX_LINE))
        self.view = memoryview(self.buf)
        self.out = self.pos = self.end = 0
        self.fill = 0  # bytes read from the socket for this body (the server's slow-client sweep reads it)
        self.state = _SIZE
        self.remaining = 0
        # the last chunk was LARGE_CHUNK or more: read the next size line alone (and the first one)
        self.large = True
        self.trailer = 0  # trailer bytes so far

    # ---- asyncio.BufferedProtocol ----
    def get_buffer(self, sizehint: int) -> memoryview:
        end = self.end
        if self.state == _DATA and self.pos == end:
            want = self.remaining + LINE_READ  # the chunk's data, to where it belongs, and the next size line
            if end + want > len(self.buf):
                self._grow(end + want)
        else:  # a size line and what follows it: the room left (a body of the size hinted ends in it)
            if len(self.buf) - end < MIN_HEAD_READ:
                self._grow(end + HEAD_READ)
            want = min(LINE_READ if self.large else HEAD_READ, len(self.buf) - end)
        return self.view[end : end + want]

    def buffer_updated(self, nbytes: int) -> None:
        self.fill += nbytes
        self.end += nbytes
        conn = self.conn
        conn.last_active = conn.loop.time()
        try:
            done = self._decode()
        except ChunkError as exc:
            conn.chunked_failed(self, exc)
            return
        if done:
            conn.chunked_received(self)

    def connection_lost(self, exc) -> None:
        self.release()
        self.conn.connection_lost(exc)

    # ---- decoding ----
    def feed(self, data) -> bool:
        """Bytes that came before the reader took over (after the request's head): True when the body is done."""
        n = len(data)
        if self.end + n > len(self.buf):
            self._grow(self.end + n)
        self.view[self.end : self.end + n] = data
        self.end += n
        self.fill += n
        return self._decode()

    def body(self) -> memoryview:
        """The decoded body: a read-only view the request's tensors are views of."""
        return self.view[: self.out].toreadonly()

    def rest(self) -> bytes:
        """What was read past the end of the body (the next pipelined request's first bytes)."""
        return bytes(self.view[self.pos : self.end])

    def release(self) -> None:
        """Drop this reader's hold on the buffer (uvloop keeps a BufferedProtocol's bound methods a while): a
        released reader has none."""
        del self.view, self.buf

    def _decode(self) -> bool:
        """Decode what was read; True once the last chunk and the trailer are in."""
        view = self.view
        buf = self.buf
        while self.pos < self.end:
            state = self.state
            if state == _DATA:
                n = min(self.remaining, self.end - self.pos)
                if self.pos != self.out:  # data that came in one read with its size line: over the line
                    view[self.out : self.out + n] = view[self.pos : self.pos + n]
                self.out += n
                self.pos += n
                self.remaining -= n
                if not self.remaining:
                    self.state = _DATA_END
                continue
            line_end = buf.find(b"\r\n", self.pos, self.end)
            if line_end < 0:
                if self.end - self.pos > MAX_LINE:
                    raise ChunkError(_LONG_LINE[state])
                break
            line = bytes(view[self.pos : line_end])
            self.pos = line_end + 2
            if state == _DATA_END:
                if line:
                    raise ChunkError("chunk data longer than its size")
                self.state = _SIZE
            elif state == _SIZE:
                self.remaining = size = _chunk_size(line)
                if size == 0:
                    self.state = _TRAILER
                elif self.out + size > self.limit:
                    raise ChunkError(f"request body larger than {self.limit} bytes", 413)
                else:
                    self.state = _DATA
                    self.large = size >= LARGE_CHUNK
            else:  # _TRAILER
                if not line:
                    return True
                self.trailer += len(line) + 2
                if self.trailer > MAX_TRAILER or b":" not in line:
                    raise ChunkError("invalid trailer")
        # keep the buffer compact: a partial line moves down to where the next chunk's data goes
        if self.pos != self.out:
            left = self.end - self.pos
            if left:
                view[self.out : self.out + left] = view[self.pos : self.end]
            self.pos = self.out
            self.end = self.out + left
        return False

    def _grow(self, need: int) -> None:
        """Move the bytes so far into a pooled buffer twice as large (at least `need`)."""
        buf = POOL.take(size_class(max(need, min(2 * len(self.buf), self.limit + 2 * HEAD_READ))))
        view = memoryview(buf)
        view[: self.end] = self.view[: self.end]
        self.buf, self.view = buf, view


def _chunk_size(line: bytes) -> int:
    """The size on a chunk-size line: hexadecimal digits, then optional `;extensions` (ignored)."""
    digits = line.split(b";", 1)[0].rstrip(b" \t")
    if not digits or len(digits) > 16 or not _HEX.issuperset(digits):
        raise ChunkError("invalid chunk size")
    return int(digits, 16)
