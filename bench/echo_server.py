"""The ceiling for bench/frontend_workers.py's HTTP loads: N processes on one port (SO_REUSEPORT), each answering
every POST with its own body, read into a buffer the connection reuses and written back from it.

It does what no inference server can do less of: one kernel copy of the request in, one of the response out, and
a few system calls, with no protocol or tensor work. Loaded by the same wrk on the same cores as Naiad, its
requests/s is what the machine allows a server (the client's own copies included), and its CPU per request the
floor under Naiad's.

    .venv/bin/python bench/echo_server.py --port 8100 --processes 2

Only what wrk sends is understood: one request at a time on a connection (no pipelining), a Content-Length body.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import sys

import uvloop

HEAD_MAX = 64 * 1024
_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)


class Echo(asyncio.BufferedProtocol):
    """One connection: the head into `head`, the body into `body` (grown to the largest seen), then the answer."""

    def __init__(self) -> None:
        self.head = bytearray(HEAD_MAX)
        self.fill = 0  # bytes of the head read
        self.body = bytearray()
        self.want = -1  # the body's length while it is read; -1 while the head is read
        self.have = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.want >= 0:
            return memoryview(self.body)[self.have : self.want]
        return memoryview(self.head)[self.fill :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.want >= 0:
            self.have += nbytes
            if self.have == self.want:
                self._answer()
            return
        self.fill += nbytes
        end = self.head.find(b"\r\n\r\n", 0, self.fill)
        if end < 0:
            if self.fill == HEAD_MAX:
                assert self.transport is not None
                self.transport.close()
            return
        m = _LENGTH.search(self.head, 0, end + 2)
        n = int(m.group(1)) if m else 0
        if len(self.body) < n:
            self.body = bytearray(n)
        early = self.fill - end - 4  # body bytes that came with the head
        self.body[:early] = self.head[end + 4 : self.fill]
        self.want, self.have, self.fill = n, early, 0
        if early == n:
            self._answer()

    def _answer(self) -> None:
        n, self.want = self.want, -1
        assert self.transport is not None
        # the client sends its next request only once it has read this answer: the body buffer is free again then
        self.transport.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n" % n
        )
        self.transport.write(memoryview(self.body)[:n])


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Echo, host, port, reuse_port=True, backlog=1024)
    stop = loop.create_future()
    loop.add_signal_handler(signal.SIGTERM, stop.set_result, None)
    await stop
    server.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--processes", type=int, default=1)
    args = p.parse_args()
    children = []
    for _ in range(args.processes - 1):
        pid = os.fork()
        if pid == 0:
            uvloop.run(serve(args.host, args.port))
            os._exit(0)
        children.append(pid)
    try:
        uvloop.run(serve(args.host, args.port))
    finally:
        for pid in children:
            os.kill(pid, signal.SIGTERM)
            os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
