"""A streaming call's messages on Naiad's HTTP/2 server (grpc/h2/reader.py `_stream_messages`, grpc/server.py
`_run`), in this process: a large request message is assembled in a pooled receive buffer and reaches the call
as a view of it, a small one as bytes, byte for byte and in order however the DATA frames cut them (16 KiB
frames, cuts through the 5-byte prefixes, 1 MiB frames the transport reads in place, one frame a message),
compressed ones inflated; a stream that ends inside a large message is answered INTERNAL; every pooled buffer
is free afterwards. A streamed response made of buffers (a WireMessage) reaches the transport as those
buffers, not joined into a copy."""

from __future__ import annotations

import gzip
import mmap
import os
import random
import struct

import pytest
from h2frames import DATA, END_STREAM, HEADERS, WINDOW_UPDATE, RawH2, frame, grpc_message
from h2server import Recorder, running
from test_h2_message_reader import assert_buffers_free

from naiad.frontends.grpc import server as grpc_server
from naiad.frontends.grpc.h2 import reader
from naiad.frontends.grpc.h2.connection import RECV_MAX_FRAME
from naiad.frontends.grpc.messages import Method, WireMessage

PATH = "/test.Echo/Stream"
HEAD = b"head:"
SIZES = [100, 800_000, 10, 300_000, 70_000, 0, 20_000]  # 70_000 and up: pooled (POOLED_MIN is 64 KiB)


class Seen:
    """A request message, as the call got it."""

    def __init__(self, view):
        self.view = view

    @classmethod
    def FromString(cls, view) -> Seen:
        return cls(view)


class Echo(WireMessage):
    __slots__ = ("body",)

    def __init__(self, body):
        self.body = body

    def wire_chunks(self) -> list:
        return [HEAD, self.body]

    def SerializeToString(self) -> bytes:
        return HEAD + bytes(self.body)


@pytest.fixture
def server(monkeypatch):
    """(address, [(pooled?, bytes) of each request message], what the transports were asked to write, how many
    DATA frames were read in place)."""
    seen: list[tuple[bool, bytes]] = []
    written: list[list] = []
    in_place: list[int] = []

    async def echo(requests, context):
        async for request in requests:
            view = request.view
            seen.append((isinstance(view, memoryview) and isinstance(view.obj, mmap.mmap), bytes(view)))
            yield Echo(view)  # the reply's body is the request's own buffer
            del request, view

    made = grpc_server._Connection.connection_made

    def recorded(self, transport) -> None:
        made(self, Recorder(transport, written))

    reader_init = reader.DataReader.__init__

    def counted(self, *args) -> None:
        in_place.append(1)
        reader_init(self, *args)

    monkeypatch.setattr(grpc_server._Connection, "connection_made", recorded)
    monkeypatch.setattr(reader.DataReader, "__init__", counted)
    method = Method(Seen, echo, client_streaming=True, server_streaming=True)
    with running({PATH.encode(): method}) as address:
        yield address, seen, written, in_place
    assert_buffers_free()


def cut(data: bytes, sizes) -> list[bytes]:
    out, pos = [], 0
    for n in sizes:
        if pos >= len(data):
            break
        out.append(data[pos : pos + n])
        pos += n
    if pos < len(data):
        out.append(data[pos:])
    return out


def odd_sizes():
    """Tiny cuts (through the 5-byte prefixes) between larger ones."""
    rng = random.Random(7)
    while True:
        yield rng.randint(1, 9)
        yield rng.randint(1000, 40000)


def exchange(
    address: str, payloads: list[bytes], *headers: tuple[str, str]
) -> tuple[list[bytes], dict[str, str]]:
    """Send `payloads` as DATA frames of one call (the last ends it); (the response messages, the trailers)."""
    settings = struct.pack(">HIHI", 4, (1 << 31) - 1, 5, (1 << 24) - 1)  # INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE
    with RawH2(address, settings=settings) as conn:
        conn.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", (1 << 31) - 1 - 65535)))
        conn.send(conn.request_headers(PATH, *headers))
        for i, payload in enumerate(payloads):
            conn.send(frame(DATA, END_STREAM if i == len(payloads) - 1 else 0, 1, payload))
        frames = conn.frames(timeout=30, until=lambda f: f[0] == HEADERS and f[2] == 1 and f[1] & END_STREAM)
        headers = [conn.decode(f[3]) for f in frames if f[0] == HEADERS and f[2] == 1]
    data = b"".join(f[3] for f in frames if f[0] == DATA and f[2] == 1)
    messages, pos = [], 0
    while pos < len(data):
        n = int.from_bytes(data[pos + 1 : pos + 5], "big")
        messages.append(data[pos + 5 : pos + 5 + n])
        pos += 5 + n
    return messages, headers[-1]


@pytest.mark.parametrize("cuts", ["16KiB", "odd", "1MiB", "a-message-a-frame"])
def test_streamed_messages_arrive_whole_and_large_ones_in_pooled_buffers(server, cuts):
    address, seen, written, in_place = server
    messages = [os.urandom(n) for n in SIZES]
    wire = [grpc_message(m) for m in messages]
    if cuts == "a-message-a-frame":
        payloads = wire
    else:
        sizes = {
            "16KiB": iter(lambda: 16384, None),
            "odd": odd_sizes(),
            "1MiB": iter(lambda: RECV_MAX_FRAME, None),
        }
        payloads = cut(b"".join(wire), sizes[cuts])
    replies, trailers = exchange(address, payloads)
    assert trailers.get("grpc-status") == "0", trailers
    assert [data for _, data in seen] == messages
    assert [pooled for pooled, _ in seen] == [n >= 64 * 1024 for n in SIZES]
    assert replies == [HEAD + m for m in messages]
    passed = [item for items in written for item in items]
    assert not any(isinstance(item, bytes) and len(item) >= 70_000 for item in passed), "a reply was joined"
    if cuts == "a-message-a-frame":  # (800 KB in one frame: the socket has part of it when the frame starts)
        assert in_place, "no large DATA frame was read into its message in place"
    written.clear()  # (it holds views of the pooled buffers)


def test_a_stream_that_ends_inside_a_large_message_is_answered_internal(server):
    address, seen, _, _ = server
    whole = grpc_message(os.urandom(500_000))
    replies, trailers = exchange(address, [grpc_message(b"first"), whole[:16384], whole[16384:300_000]])
    assert [data for _, data in seen] == [b"first"]
    assert replies == [HEAD + b"first"]
    assert trailers.get("grpc-status") == "13", trailers
    assert "incomplete message" in trailers.get("grpc-message", "")


def test_compressed_messages_of_a_stream_are_inflated(server):
    address, seen, written, _ = server
    messages = [os.urandom(200_000), b"small" * 10]  # the first compressed is still past POOLED_MIN
    wire = b"".join(grpc_message(gzip.compress(m), compressed=True) for m in messages)
    replies, trailers = exchange(address, cut(wire, iter(lambda: 16384, None)), ("grpc-encoding", "gzip"))
    written.clear()
    assert trailers.get("grpc-status") == "0", trailers
    assert [data for _, data in seen] == messages
    assert replies == [HEAD + m for m in messages]
