"""A unary call's reply on Naiad's HTTP/2 server (grpc/server.py `_Connection._reply`), in this process: a
large response made of buffers (a WireMessage: the protobuf head, then the output tensors' own memory) goes to
the transport as those buffers, never joined into a copy, whether it fits one DATA frame (grpc core clients,
perf_analyzer and tritonclient allow 16 MiB frames) or not; a small one goes as one write. The client reads it
byte for byte."""

from __future__ import annotations

import os
import struct

import pytest
from h2frames import DATA, END_STREAM, HEADERS, WINDOW_UPDATE, RawH2, frame, grpc_message
from h2server import Recorder, running

from naiad.frontends.grpc import server as grpc_server
from naiad.frontends.grpc.messages import Method, WireMessage

PATH = "/test.Blob/Get"
HEAD = b"head:"


class Ask:
    """The request: how many bytes of reply."""

    def __init__(self, n: int):
        self.n = n

    @classmethod
    def FromString(cls, view) -> Ask:
        return cls(int(bytes(view)))


class Blob(WireMessage):
    __slots__ = ("body",)

    def __init__(self, body: bytearray):
        self.body = body

    def wire_chunks(self) -> list:
        return [HEAD, self.body]


@pytest.fixture
def server(monkeypatch):
    """(address, the bodies replied, what the transports were asked to write) of a server on its own thread."""
    bodies: list[bytearray] = []
    written: list[list] = []

    async def get(request: Ask, context) -> Blob:
        body = bytearray(os.urandom(request.n))
        bodies.append(body)
        return Blob(body)

    made = grpc_server._Connection.connection_made

    def recorded(self, transport) -> None:
        made(self, Recorder(transport, written))

    monkeypatch.setattr(grpc_server._Connection, "connection_made", recorded)
    with running({PATH.encode(): Method(Ask, get)}) as address:
        yield address, bodies, written


def call(address: str, n: int, max_frame: int) -> tuple[bytes, int]:
    """(the reply message, how many DATA frames carried it) of one call from a client that allows frames of
    `max_frame` bytes and opens its windows wide."""
    settings = struct.pack(">HIHI", 4, (1 << 31) - 1, 5, max_frame)  # INITIAL_WINDOW_SIZE, MAX_FRAME_SIZE
    with RawH2(address, settings=settings) as conn:
        conn.send(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", (1 << 31) - 1 - 65535)))
        conn.send(conn.request_headers(PATH) + frame(DATA, END_STREAM, 1, grpc_message(str(n).encode())))
        frames = conn.frames(timeout=30, until=lambda f: f[0] == HEADERS and f[2] == 1 and f[1] & END_STREAM)
    data = [f[3] for f in frames if f[0] == DATA and f[2] == 1]
    message = b"".join(data)
    assert int.from_bytes(message[1:5], "big") == len(message) - 5
    return message[5:], len(data)


@pytest.mark.parametrize(
    ("n", "max_frame", "frames"),
    [(4 << 20, (1 << 24) - 1, 1), (4 << 20, 16384, None), (1000, (1 << 24) - 1, 1)],
    ids=["large-in-one-frame", "large-in-16KiB-frames", "small"],
)
def test_a_reply_goes_out_from_its_own_buffers(server, n, max_frame, frames):
    address, bodies, written = server
    message, count = call(address, n, max_frame)
    body = bodies[-1]
    assert message == HEAD + bytes(body)
    if frames is not None:
        assert count == frames
    passed = [item for items in written for item in items]
    if n > 16384:  # the body itself, or views of it: no copy of the tensor
        assert any(item is body or (isinstance(item, memoryview) and item.obj is body) for item in passed)
        assert not any(isinstance(item, bytes) and len(item) >= n for item in passed), "the reply was joined"
    else:  # one write of the whole answer
        assert any(isinstance(item, bytes) and bytes(body) in item for item in passed)
