"""`--frontend-accept balanced`: the engine process listens on the frontend ports and hands each accepted socket
to the frontend worker with the fewest open connections (ties round-robin), passing the file descriptor over a
Unix SOCK_SEQPACKET socket (SCM_RIGHTS); `adopter.py` is the worker's end."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import struct

from . import leftovers

log = logging.getLogger("naiad.engine")

# listener kinds: the first byte of the message that carries an accepted socket
HTTP, GRPC, OPENAI = b"h", b"g", b"o"
KINDS = (HTTP, GRPC, OPENAI)
# a worker's messages: b"R", b"-", its pid, 0 (once, on connecting); b"C", a kind, the sockets of that kind it has
# received so far, its connections of that kind open now
REPORT = struct.Struct("<ccqq")
BACKLOG = 1024
ACCEPTS_PER_WAKEUP = 64


class WorkerSlot:
    """One registered worker: its fd-passing socket and what the acceptor knows of its load."""

    def __init__(self, sock: socket.socket, order: int):
        self.sock = sock
        self.pid = 0
        self.order = order  # registration order, for round-robin ties
        self.sent = dict.fromkeys(KINDS, 0)  # sockets handed to it, by kind
        self.received = dict.fromkeys(KINDS, 0)  # of those, how many it had received at its last report
        self.open = dict.fromkeys(KINDS, 0)  # connections open at its last report
        self.last = 0  # when it was last handed a socket (Acceptor.handed then), for round-robin ties

    def load(self, kind: bytes) -> int:
        """Open connections of a kind: those it reported plus those sent since."""
        return self.open[kind] + self.sent[kind] - self.received[kind]

    def total(self) -> int:
        return sum(self.load(k) for k in KINDS)


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """Listening, non-blocking TCP sockets on host:port (every address it resolves to), as asyncio binds them."""
    infos = socket.getaddrinfo(
        host.strip("[]") or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )
    out: list[socket.socket] = []
    seen = set()
    try:
        for family, kind, proto, _, address in infos:
            if (family, address) in seen:
                continue
            seen.add((family, address))
            sock = socket.socket(family, kind, proto)
            out.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                raise OSError(exc.errno, f"cannot bind {address[0]}:{port}: {exc.strerror}") from None
            sock.listen(BACKLOG)
            sock.setblocking(False)
    except BaseException:
        for sock in out:
            sock.close()
        raise
    return out


class Acceptor:
    """Accepts on the frontend ports and spreads the connections over the registered workers by load."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, leftovers.ACCEPT_NAME)
        self.listeners: list[tuple[bytes, socket.socket]] = []
        self.workers: list[WorkerSlot] = []
        self.handed = 0  # sockets handed out in all, for tests and logs
        self._server: socket.socket | None = None
        self._registrations = 0
        self._accepting = False
        self.loop: asyncio.AbstractEventLoop | None = None

    def listen(self, kind: bytes, host: str, port: int) -> None:
        """Bind one frontend port; connections queue in its backlog until a worker registers."""
        self.listeners.extend((kind, sock) for sock in listen_sockets(host, port))

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        server.bind(self.path)
        server.listen(64)
        server.setblocking(False)
        self._server = server
        self.loop.add_reader(server.fileno(), self._on_worker)

    def registered(self) -> int:
        """Workers registered (that sent their pid) now."""
        return sum(1 for w in self.workers if w.pid)

    def close(self) -> None:
        self._pause()
        for _, sock in self.listeners:
            sock.close()
        self.listeners.clear()
        if self._server is not None and self.loop is not None:
            self.loop.remove_reader(self._server.fileno())
            self._server.close()
            self._server = None
        for w in list(self.workers):
            self._drop(w)

    # ---- workers ----
    def _on_worker(self) -> None:
        assert self._server is not None and self.loop is not None
        while True:
            try:
                sock, _ = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            sock.setblocking(False)
            self._registrations += 1
            slot = WorkerSlot(sock, self._registrations)
            self.workers.append(slot)
            self.loop.add_reader(sock.fileno(), self._on_report, slot)

    def _on_report(self, slot: WorkerSlot) -> None:
        while True:
            try:
                data = slot.sock.recv(64)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if len(data) != REPORT.size:  # b"": the worker is gone (its connections went with it)
                if data:
                    log.warning("frontend worker %d sent a malformed accept report; dropping it", slot.pid)
                self._drop(slot)
                return
            tag, kind, a, b = REPORT.unpack(data)
            if tag == b"R":
                slot.pid = a
                self._resume()
            elif tag == b"C" and kind in slot.open:
                slot.received[kind], slot.open[kind] = a, b

    def _drop(self, slot: WorkerSlot) -> None:
        if slot in self.workers:
            self.workers.remove(slot)
        if self.loop is not None:
            try:
                self.loop.remove_reader(slot.sock.fileno())
            except (ValueError, OSError):
                pass
        slot.sock.close()
        if not self.registered():
            self._pause()

    # ---- accepting ----
    def _resume(self) -> None:
        if self._accepting or self.loop is None:
            return
        self._accepting = True
        for kind, sock in self.listeners:
            self.loop.add_reader(sock.fileno(), self._on_accept, kind, sock)

    def _pause(self) -> None:
        if not self._accepting or self.loop is None:
            return
        self._accepting = False
        for _, sock in self.listeners:
            self.loop.remove_reader(sock.fileno())

    def _retry(self) -> None:
        if self.registered() and self.listeners:
            self._resume()

    def pick(self, kind: bytes) -> list[WorkerSlot]:
        """Registered workers, fewest open connections of this kind first (so that a few long gRPC channels are
        spread however many HTTP connections come and go), then fewest in all; among equals the one handed a
        socket least recently."""
        return sorted(
            (w for w in self.workers if w.pid), key=lambda w: (w.load(kind), w.total(), w.last, w.order)
        )

    def _on_accept(self, kind: bytes, listener: socket.socket) -> None:
        for _ in range(ACCEPTS_PER_WAKEUP):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: connections stay queued; try again in a second
                log.warning("accepting a connection failed: %s; pausing accepts for 1 s", exc)
                self._pause()
                assert self.loop is not None
                self.loop.call_later(1.0, self._retry)
                return
            with conn:
                self._hand(kind, conn)
            if not self._accepting:
                return

    def _hand(self, kind: bytes, conn: socket.socket) -> None:
        for slot in self.pick(kind):
            try:
                socket.send_fds(slot.sock, [kind], [conn.fileno()])
            except (BlockingIOError, InterruptedError):
                continue  # its queue is full: the next one takes it
            except OSError:
                self._drop(slot)
                continue
            slot.sent[kind] += 1
            self.handed += 1
            slot.last = self.handed
            return
        log.warning("no frontend worker could take a connection; closing it")


def from_args(args, directory: str) -> Acceptor | None:
    """The acceptor for `naiad serve`'s arguments: every frontend port the workers can adopt sockets on (the grpcio
    implementation cannot: its workers keep SO_REUSEPORT), or None with `--frontend-accept reuseport`."""
    if getattr(args, "frontend_accept", "reuseport") != "balanced":
        return None
    acceptor = Acceptor(directory)
    try:
        if args.allow_http:
            acceptor.listen(HTTP, args.http_address, args.http_port)
        if args.openai_port:
            acceptor.listen(OPENAI, args.openai_address or args.http_address, args.openai_port)
        if args.allow_grpc and args.grpc_implementation != "grpcio":
            acceptor.listen(GRPC, args.grpc_address, args.grpc_port)
    except BaseException:
        acceptor.close()
        raise
    return acceptor
