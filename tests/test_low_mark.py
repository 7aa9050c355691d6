"""The receive low mark (low_mark.py) on real sockets: raised to what is owed, at most READ_LOWAT and a quarter of
the receive buffer, lowered to the end of a read, back to 1 after it, dropped for good when nothing comes for
STALL_S, left alone on a Unix socket and a closed transport; the HTTP/2 frame reader raises it while a large frame
arrives and the message comes out whole (the message reader's: test_h2_message_reader.py; large HTTP bodies, whole,
in pieces and pipelined with it raised: test_large_tensors.py, test_http_fast.py)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import socket
import tempfile

import pytest
import uvloop
from h2frames import DATA, END_STREAM, HEADERS, RawH2, frame, grpc_message

from naiad.frontends.h2_reader import DataReader
from naiad.frontends.low_mark import READ_LOWAT, STALL_S, LowMark


def lowat(sock: socket.socket) -> int:
    return sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)


async def accepted(family: int = socket.AF_INET):
    """(the server side's transport, its socket, the client socket) of one connection on this loop."""
    loop = asyncio.get_running_loop()
    got: asyncio.Future = loop.create_future()

    class Proto(asyncio.Protocol):
        def connection_made(self, transport):
            got.set_result(transport)

    if family == socket.AF_UNIX:
        path = os.path.join(tempfile.mkdtemp(), "s")
        server = await loop.create_unix_server(Proto, path)
        client = socket.socket(socket.AF_UNIX)
        client.setblocking(False)
        await loop.sock_connect(client, path)
    else:
        server = await loop.create_server(Proto, "127.0.0.1", 0)
        client = socket.socket()
        client.setblocking(False)
        await loop.sock_connect(client, server.sockets[0].getsockname())
    transport = await got
    server.close()
    return transport, transport.get_extra_info("socket"), client


def run(coro):
    return uvloop.run(coro)


def test_the_mark_is_what_is_owed_at_most_read_lowat_and_a_quarter_of_the_buffer():
    async def main():
        transport, sock, client = await accepted()
        low = LowMark(transport, asyncio.get_running_loop())
        quarter = sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) // 4
        low.expect(64 << 20)
        assert lowat(sock) == min(READ_LOWAT, quarter)
        low.got(1000, 5000)  # the end of the read is near: the mark comes down to it
        assert lowat(sock) == 5000
        low.got(4999, 1)
        assert lowat(sock) == 1
        low.expect(3000)
        assert lowat(sock) == 3000
        low.clear()
        assert lowat(sock) == 1
        transport.close()
        client.close()

    run(main())


def test_nothing_coming_for_stall_s_drops_the_mark_for_good():
    async def main():
        transport, sock, client = await accepted()
        low = LowMark(transport, asyncio.get_running_loop())
        low.expect(1 << 20)
        assert lowat(sock) > 1
        await asyncio.sleep(STALL_S * 0.6)
        low.got(100, 1 << 20)  # progress: the first check keeps the mark
        await asyncio.sleep(STALL_S * 0.6)
        assert lowat(sock) > 1
        await asyncio.sleep(STALL_S * 2.5)  # then nothing
        assert lowat(sock) == 1
        low.expect(1 << 20)
        assert lowat(sock) == 1, "raised again after a stall"
        transport.close()
        client.close()

    run(main())


def test_no_mark_on_a_unix_socket_and_none_touched_once_the_transport_closes():
    async def main():
        transport, sock, client = await accepted(socket.AF_UNIX)
        low = LowMark(transport, asyncio.get_running_loop())
        low.expect(1 << 20)
        assert low.mark == 1 and lowat(sock) == 1
        transport.close()
        client.close()

        transport, sock, client = await accepted()
        low = LowMark(transport, asyncio.get_running_loop())
        low.expect(1 << 20)
        transport.close()
        low.clear()  # (its descriptor is gone or another socket's: no system call)
        assert low.sock is None
        await asyncio.sleep(STALL_S * 2)  # the stall check finds nothing to do
        client.close()

    run(main())


@pytest.fixture
def grpc_server(monkeypatch):
    import test_h2_message_reader as messages

    yield from messages.serve(monkeypatch)


def test_a_large_frame_is_read_with_the_mark_raised_and_comes_out_whole(grpc_server, monkeypatch):
    """1 MiB DATA frames (grpcio and perf_analyzer send frames as large as the server allows) in writes of
    16 KiB: the frame reader raises the mark for the rest of each frame, and the message is byte for byte."""
    address, _ = grpc_server
    marks: list[int] = []
    init = DataReader.__init__

    def recorded(self, *args) -> None:
        init(self, *args)
        marks.append(self.low.mark)

    monkeypatch.setattr(DataReader, "__init__", recorded)
    msg = os.urandom(6 << 20)
    body = grpc_message(msg)
    frames = [
        frame(DATA, END_STREAM if pos + (1 << 20) >= len(body) else 0, 1, body[pos : pos + (1 << 20)])
        for pos in range(0, len(body), 1 << 20)
    ]
    with RawH2(address) as conn:
        conn.send(conn.request_headers("/test.Echo/Digest"))
        wire = b"".join(frames)
        for pos in range(0, len(wire), 16384):
            conn.send(wire[pos : pos + 16384])
        answer, trailers = b"", {}

        def done(f) -> bool:
            nonlocal answer
            if f[0] == DATA and f[2] == 1:
                answer += f[3]
            elif f[0] == HEADERS and f[1] & END_STREAM:
                trailers.update(conn.decode(f[3]))
            return bool(trailers)

        conn.frames(timeout=30, until=done)
    assert trailers.get("grpc-status") == "0", trailers
    assert answer[5:] == len(msg).to_bytes(8, "big") + hashlib.sha256(msg).digest()
    assert marks and max(marks) > 1, marks
