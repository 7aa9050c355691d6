"""The receive low mark (grpc/h2/low_mark.py) on real sockets: raised to what is owed, at most READ_LOWAT and
a quarter of the receive buffer, back to 1 after the read, dropped for good when nothing comes for STALL_S,
left alone on a Unix socket and a closed transport (the message reader's use of it:
test_h2_message_reader.py)."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile

import uvloop

from naiad.frontends.grpc.h2.low_mark import READ_LOWAT, STALL_S, LowMark


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
        low.clear()
        assert lowat(sock) == 1
        low = LowMark(transport, asyncio.get_running_loop())
        low.expect(3000)  # less is owed: the mark is that
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
        low.got(100)  # progress: the first check keeps the mark
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
