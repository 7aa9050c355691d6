"""The chunked body decoder of the fast HTTP path (http/chunked.py), driven as the transport drives it: the body
comes out byte for byte however the wire is cut into reads, a chunk's data is read to where it belongs (only what
shares a read with a size line moves), a body of the hinted size needs no bigger buffer, what follows the body is
kept for the next request, and bad framing or a body over the limit is refused."""

from __future__ import annotations

import random

import pytest

from naiad.frontends.http.chunked import ChunkedBodyReader, ChunkError


class Conn:
    """What the reader calls back on its connection."""

    def __init__(self):
        self.loop = self
        self.last_active = 0.0
        self.done: ChunkedBodyReader | None = None
        self.failed: ChunkError | None = None

    def time(self) -> float:
        return 1.0

    def chunked_received(self, reader) -> None:
        self.done = reader

    def chunked_failed(self, reader, exc) -> None:
        self.failed = exc


def wire(body: bytes, sizes, trailer: bytes = b"", extension: bytes = b"") -> bytes:
    out, i = [], 0
    for n in sizes:
        piece = body[i : i + n]
        i += n
        if piece:
            out.append(b"%x%s\r\n%s\r\n" % (len(piece), extension, piece))
    assert i >= len(body)
    return b"".join(out) + b"0\r\n" + trailer + b"\r\n"


def drive(reader: ChunkedBodyReader, data: bytes, cuts: random.Random | None = None) -> int:
    """Send `data` through get_buffer/buffer_updated, each read all the reader offers (with `cuts`, a random part
    of it), as a socket with the bytes waiting does; the bytes read straight into the body, where they stay."""
    pos = in_place = 0
    while pos < len(data) and reader.conn.done is None and reader.conn.failed is None:
        buf = reader.get_buffer(-1)
        n = min(len(buf), len(data) - pos)
        if cuts is not None:
            n = cuts.randint(1, n)
        if reader.state == 1 and reader.pos == reader.end == reader.out:  # a chunk's data, at the body's end
            in_place += n
        buf[:n] = data[pos : pos + n]
        pos += n
        reader.buffer_updated(n)
    return in_place


@pytest.mark.parametrize("seed", range(6))
def test_body_byte_for_byte_however_cut(seed):
    rng = random.Random(seed)
    body = rng.randbytes(rng.randint(1, 300_000))
    sizes = [rng.choice((1, 7, 4096, 65536, 100_000)) for _ in range(len(body))]
    data = wire(
        body, sizes, trailer=b"X-Sum: 1\r\n" if seed % 2 else b"", extension=b";a=b" if seed % 3 else b""
    )
    conn = Conn()
    reader = ChunkedBodyReader(conn, 0, 1 << 30)
    split = rng.randint(0, min(len(data), 200))
    done = reader.feed(data[:split])  # what came with the head
    if not done:
        drive(reader, data[split:] + b"NEXT", rng)
        assert conn.done is reader
    assert bytes(reader.body()) == body
    assert b"NEXT".startswith(reader.rest())  # what followed the body, as far as its last read went


def test_data_lands_where_it_belongs_and_the_hint_is_enough():
    body = bytes(range(256)) * 4096  # 1 MiB
    data = wire(body, [65536] * 16)
    conn = Conn()
    reader = ChunkedBodyReader(conn, len(body), 1 << 30)
    first = reader.buf
    in_place = drive(reader, data)
    assert conn.done is reader and bytes(reader.body()) == body
    assert reader.buf is first  # no bigger buffer was needed
    assert in_place >= len(body) - 16 * 64  # all but what came with the size lines (a small read each)


def test_outgrows_a_small_hint():
    body = b"x" * 1_000_000
    conn = Conn()
    reader = ChunkedBodyReader(conn, 10, 1 << 30)
    drive(reader, wire(body, [300_000] * 4))
    assert conn.done is reader and bytes(reader.body()) == body and len(reader.buf) >= len(body)


@pytest.mark.parametrize(
    "data,message,status",
    [
        (b"-1\r\n", "invalid chunk size", 400),
        (b"0x1\r\n", "invalid chunk size", 400),
        (b"\r\n", "invalid chunk size", 400),
        (b"1" * 17 + b"\r\n", "invalid chunk size", 400),
        (b"3\r\nabcd\r\n", "chunk data longer than its size", 400),
        (b"3;" + b"e" * 5000, "chunk size line too long", 400),
        (b"0\r\n" + b"X-A: b\r\n" * 10_000, "invalid trailer", 400),
        (b"3e9\r\n", "request body larger than 1000 bytes", 413),
    ],
)
def test_refused(data, message, status):
    conn = Conn()
    reader = ChunkedBodyReader(conn, 0, 1000)
    with pytest.raises(ChunkError) as exc:
        reader.feed(data)
    assert str(exc.value) == message and exc.value.status == status
    conn = Conn()
    drive(ChunkedBodyReader(conn, 0, 1000), data, random.Random(1))  # the same through the transport's reads
    assert conn.failed is not None and str(conn.failed) == message
