"""A frontend worker's end of `--frontend-accept balanced`: receives accepted sockets from the engine's acceptor
(`acceptor.py`) and adopts each into its listener's protocol (`loop.connect_accepted_socket`, TLS included),
reporting how many connections it holds so that the acceptor can pick the least-loaded worker."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl as ssl_module
from collections.abc import Callable

from .acceptor import KINDS, REPORT

log = logging.getLogger("naiad.worker")


class AdoptedSocket(socket.socket):
    """An adopted connection's socket. The event loop closes it (asyncio) or detaches it (uvloop) when the
    connection ends, whichever protocol serves it by then (the frontends swap protocols on a transport), so
    that is where the end is counted."""

    on_end: Callable[[], None] | None = None

    def ended(self) -> None:
        callback, self.on_end = self.on_end, None
        if callback is not None:
            callback()

    def close(self) -> None:
        self.ended()
        super().close()

    def detach(self) -> int:
        self.ended()
        return super().detach()


class Adopter:
    """`add(kind, protocol_factory, ssl)` per listener kind, then `start()`; `close()` when the worker stops."""

    def __init__(self, path: str):
        self.path = path
        self.kinds: dict[bytes, tuple[Callable[[], asyncio.BaseProtocol], ssl_module.SSLContext | None]] = {}
        self.open = dict.fromkeys(KINDS, 0)  # connections held (adopted or being adopted), by kind
        self.received = dict.fromkeys(KINDS, 0)
        self._reported: dict[bytes, tuple[int, int]] = {}
        self._report_pending = False
        self._sock: socket.socket | None = None
        self._tasks: set[asyncio.Task] = set()
        self.loop: asyncio.AbstractEventLoop | None = None

    def add(
        self,
        kind: bytes,
        protocol_factory: Callable[[], asyncio.BaseProtocol],
        ssl: ssl_module.SSLContext | None,
    ) -> None:
        self.kinds[kind] = (protocol_factory, ssl)

    def start(self) -> None:
        """Register with the acceptor: from now on it may hand this worker connections."""
        self.loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(self.path)
        sock.setblocking(False)
        self._sock = sock
        self.loop.add_reader(sock.fileno(), self._on_message)
        self._send(b"R", b"-", os.getpid(), 0)

    def _send(self, tag: bytes, kind: bytes, a: int, b: int) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.send(REPORT.pack(tag, kind, a, b))
        except (BlockingIOError, InterruptedError):
            assert self.loop is not None
            self.loop.call_later(0.01, self._schedule)  # the acceptor is behind: try again shortly
            return False
        except OSError:
            return False  # the engine is gone; the worker's data channel notices and it exits
        return True

    def _on_message(self) -> None:
        assert self._sock is not None and self.loop is not None
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._sock, 16, 4)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds = b"", []
            if not data and not fds:
                self._stop_reading()
                return
            kind = data[:1]
            for fd in fds:
                conn = AdoptedSocket(fileno=fd)
                conn.setblocking(False)
                entry = self.kinds.get(kind)
                if entry is None:
                    log.warning("the acceptor handed over a connection of unknown kind %r; closing it", kind)
                    conn.close()
                    continue
                if conn.family in (socket.AF_INET, socket.AF_INET6):  # as a listener's own accepts get it
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.received[kind] += 1
                self.open[kind] += 1
                conn.on_end = lambda kind=kind: self._ended(kind)
                task = self.loop.create_task(self._adopt(conn, *entry))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self._schedule()

    async def _adopt(self, conn: AdoptedSocket, factory, ssl) -> None:
        assert self.loop is not None
        try:  # from here the transport owns the socket, and closes it on a failed handshake
            await self.loop.connect_accepted_socket(factory, conn, ssl=ssl)
        except Exception as exc:
            log.debug("adopting a connection failed: %s", exc)
            conn.ended()  # counted as gone even if the loop let go of the socket some other way

    def _ended(self, kind: bytes) -> None:
        self.open[kind] -= 1
        self._schedule()

    def _schedule(self) -> None:
        """Report once at the end of this loop turn, however many connections came and went in it."""
        if not self._report_pending and self.loop is not None and self._sock is not None:
            self._report_pending = True
            self.loop.call_soon(self._report)

    def _report(self) -> None:
        """Tell the acceptor what this worker holds now, for each kind that changed."""
        self._report_pending = False
        for kind in KINDS:
            state = (self.received[kind], self.open[kind])
            if state != self._reported.get(kind) and self._send(b"C", kind, *state):
                self._reported[kind] = state

    def _stop_reading(self) -> None:
        if self._sock is not None and self.loop is not None:
            self.loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        """Take no more connections (the acceptor stops sending to this worker); open ones stay."""
        self._stop_reading()
