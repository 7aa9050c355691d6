"""A connection socket's receive low mark (SO_RCVLOWAT) while a large gRPC message in small frames is still to come.

An idle server whose client writes a large message in 16 KiB HTTP/2 frames (grpc-go, grpc-java, h2load) wakes for
each few frames that land: a sleep, an epoll return and a read for every few tens of KiB, ~25 times for 4 MiB. With
the low mark raised the kernel wakes the loop once READ_LOWAT bytes are queued. That is safe only while at least
that many bytes are sure to come: the caller bounds the mark by what is owed, and the client may send it (the
stream's window keeps more than half of its 16 MiB open; the kernel also wakes when its receive window runs low).
The mark stays at most a quarter of the socket's receive buffer (which grows on a fast connection): Linux clamps
the TCP window to a low mark the buffer cannot hold twice, for the rest of the connection.

A client slower than READ_LOWAT per STALL_S, or one that stops in the middle of its message (to send a PING, or the
end of its stream), would hold what it did send: a check every STALL_S drops the mark for good once no byte came
since the last one, so such a client is read as its bytes come, as without the mark, and the stall timeouts see its
progress. Plain TCP only: behind TLS the reads are the SSL transport's, not measured. Not used for large frames
(grpc core, perf_analyzer) or HTTP/1.1 bodies: their clients write in large pieces, the reads were few already,
and a mark per frame or body (raised, brought down to its last bytes, cleared) made more system calls than the
wakes it saved (bench/README.md).
"""

from __future__ import annotations

import asyncio
import socket

# the low mark while a large read is owed (128 KiB: measured against 64 KiB and 512 KiB, bench/README.md)
READ_LOWAT = 128 * 1024
STALL_S = 0.05  # no byte for this long: the mark is dropped for the rest of the read
_TCP = (socket.AF_INET, socket.AF_INET6)


class LowMark:
    """The low mark of one transport's socket for one large read: `expect(n)` while at least n bytes are owed,
    `got(n)` as they come, `clear()` at the end (or when the connection goes on without it)."""

    __slots__ = ("cap", "loop", "mark", "received", "seen", "sock", "timer", "transport")

    def __init__(self, transport: asyncio.BaseTransport, loop: asyncio.AbstractEventLoop):
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is None or sock.family not in _TCP or transport.get_extra_info("sslcontext") is not None:
            sock = None
        self.sock = sock
        self.loop = loop
        self.mark = 1
        self.cap = 0
        self.received = self.seen = 0
        self.timer: asyncio.TimerHandle | None = None

    def expect(self, owed: int) -> None:
        """Wake for min(owed, READ_LOWAT, a quarter of the receive buffer) bytes."""
        sock = self.sock
        if sock is None:
            return
        try:
            if not self.cap:
                self.cap = min(READ_LOWAT, sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4)
            mark = min(owed, self.cap)
            if mark <= 1:
                return
            if mark != self.mark:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, mark)
                self.mark = mark
        except OSError:
            self.sock = None
            return
        if self.timer is None:
            self.timer = self.loop.call_later(STALL_S, self._check)

    def got(self, nbytes: int) -> None:
        """`nbytes` came (the stall check's progress)."""
        self.received += nbytes

    def clear(self) -> None:
        """Wake for any byte again."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.mark != 1:
            self.mark = 1
            if self.transport.is_closing():  # (its descriptor may be closed, or another socket's by now)
                self.sock = None
                return
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            except OSError:
                self.sock = None

    def _check(self) -> None:
        self.timer = None
        if self.mark == 1:
            return
        if self.received == self.seen:
            self.clear()  # nothing came: the rest as its bytes come
            self.sock = None
            return
        self.seen = self.received
        self.timer = self.loop.call_later(STALL_S, self._check)
