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

REPORT_INTERVAL_S = 0.02  # how often open connections are counted again while any are open


class Adopter:
    """`add(kind, protocol_factory, ssl)` per listener kind, then `start()`; `close()` when the worker stops."""

    def __init__(self, path: str):
        self.path = path
        self.kinds: dict[bytes, tuple[Callable[[], asyncio.BaseProtocol], ssl_module.SSLContext | None]] = {}
        self.transports: dict[bytes, set[asyncio.BaseTransport]] = {k: set() for k in KINDS}
        self.pending = dict.fromkeys(KINDS, 0)  # sockets being adopted (a TLS handshake in progress)
        self.received = dict.fromkeys(KINDS, 0)
        self._reported: dict[bytes, tuple[int, int]] = {}
        self._sock: socket.socket | None = None
        self._timer: asyncio.TimerHandle | None = None
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

    def open(self, kind: bytes) -> int:
        return self.pending[kind] + len(self.transports[kind])

    def _send(self, tag: bytes, kind: bytes, a: int, b: int) -> bool:
        if self._sock is None:
            return False
        try:
            self._sock.send(REPORT.pack(tag, kind, a, b))
        except (BlockingIOError, InterruptedError):
            self._schedule()  # try again on the next count
            return False
        except OSError:
            return False  # the engine is gone; the worker's data channel notices and it exits
        return True

    def _on_message(self) -> None:
        assert self._sock is not None
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
                conn = socket.socket(fileno=fd)
                conn.setblocking(False)
                if conn.family in (socket.AF_INET, socket.AF_INET6):  # as a listener's own accepts get it
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                entry = self.kinds.get(kind)
                if entry is None:
                    log.warning("the acceptor handed over a connection of unknown kind %r; closing it", kind)
                    conn.close()
                    continue
                self.received[kind] += 1
                self.pending[kind] += 1
                task = self.loop.create_task(self._adopt(kind, conn, *entry))  # type: ignore[union-attr]
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self._report()

    async def _adopt(self, kind: bytes, conn: socket.socket, factory, ssl) -> None:
        try:  # from here the transport owns the socket, and closes it on a failed handshake
            transport, _ = await self.loop.connect_accepted_socket(factory, conn, ssl=ssl)  # type: ignore[union-attr]
        except Exception as exc:
            log.debug("adopting a connection failed: %s", exc)
        else:
            self.transports[kind].add(transport)
        finally:
            self.pending[kind] -= 1
            self._report()

    def _report(self) -> None:
        """Tell the acceptor what this worker holds now (if that changed); count again soon while any are open."""
        busy = False
        for kind, transports in self.transports.items():
            closed = [t for t in transports if t.is_closing()]
            for t in closed:
                transports.discard(t)
            state = (self.received[kind], self.open(kind))
            if state != self._reported.get(kind) and self._send(b"C", kind, *state):
                self._reported[kind] = state
            busy = busy or state[1] > 0
        if busy:
            self._schedule()

    def _schedule(self) -> None:
        if self._timer is None and self.loop is not None and self._sock is not None:
            self._timer = self.loop.call_later(REPORT_INTERVAL_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._report()

    def _stop_reading(self) -> None:
        if self._sock is not None and self.loop is not None:
            self.loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        """Take no more connections (the acceptor stops sending to this worker); open ones stay."""
        self._stop_reading()
