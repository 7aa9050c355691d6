"""Large gRPC messages sent in small DATA frames (grpc/h2/message_reader.py), against the HTTP/2 server in
this process: the message comes out byte for byte however the frames are cut into reads, with a PING, a small
call or another large call's frames between its frames, padded frames, more or less than the message
announced, past the stream's window (the server opens it), a content-length the frames overrun, a client gone
in the middle, and behind TLS; every pooled buffer is free afterwards. The socket's low mark: raised while a
message is read, 1 after, and dropped for a client that stops in the middle of its message."""

from __future__ import annotations

import hashlib
import random
import socket
import ssl
import struct
import time

import pytest
from h2frames import DATA, END_STREAM, HEADERS, PING, RST_STREAM, WINDOW_UPDATE, RawH2, frame, grpc_message
from h2server import running

from naiad.frontends.grpc.h2.low_mark import READ_LOWAT, STALL_S, LowMark
from naiad.frontends.grpc.h2.message_reader import MessageReader
from naiad.frontends.grpc.messages import Method
from naiad.frontends.transport.receive_buffers import POOL

PATH = "/test.Echo/Digest"
FRAME = 16384  # what h2load, grpc-go and grpc-java send
PADDED = 0x8


class Digest:
    """A request message parsed as its length and SHA-256, which is also the reply."""

    def __init__(self, data: bytes):
        self.data = data

    @classmethod
    def FromString(cls, view) -> Digest:
        return cls(len(view).to_bytes(8, "big") + hashlib.sha256(view).digest())

    def SerializeToString(self) -> bytes:
        return self.data


async def digest(request: Digest, context) -> Digest:
    return request


def expected(message: bytes) -> bytes:
    return len(message).to_bytes(8, "big") + hashlib.sha256(message).digest()


@pytest.fixture
def server(monkeypatch):
    """(address, the stream ids whose messages the reader took over) of a server on its own uvloop thread."""
    yield from serve(monkeypatch)


def serve(monkeypatch, tls: ssl.SSLContext | None = None):
    taken: list[int] = []
    start = MessageReader.start.__func__  # type: ignore[attr-defined]

    def counted(cls, conn, st, rest) -> bool:
        if start(cls, conn, st, rest):
            taken.append(st.sid)
            return True
        return False

    monkeypatch.setattr(MessageReader, "start", classmethod(counted))
    with running({PATH.encode(): Method(Digest, digest)}, tls) as address:
        yield address, taken
    assert_buffers_free()


def assert_buffers_free() -> None:
    deadline = time.monotonic() + 5
    while POOL.idle_bytes() != POOL.bytes and time.monotonic() < deadline:
        time.sleep(0.02)
    assert POOL.idle_bytes() == POOL.bytes, "a pooled receive buffer is still referred to"


def data_frames(body: bytes, sid: int, size: int = FRAME, end: bool = True) -> list[bytes]:
    out = []
    for pos in range(0, len(body), size):
        last = end and pos + size >= len(body)
        out.append(frame(DATA, END_STREAM if last else 0, sid, body[pos : pos + size]))
    return out


def send_in_pieces(conn: RawH2, frames: list[bytes], seed: int) -> None:
    """`frames` in writes that now and then stop, for a moment, inside a frame's header, just after it or inside
    its payload, so that the server's reads end there; else in writes of 300 KiB."""
    rng = random.Random(seed)
    out = bytearray()
    for f in frames:
        if rng.random() < 0.15:
            cut = rng.choice((rng.randint(1, 8), 9, rng.randint(10, len(f) - 1) if len(f) > 10 else 9))
            conn.send(bytes(out) + f[:cut])
            time.sleep(0.002)
            out[:] = f[cut:]
        else:
            out += f
        if len(out) >= 300_000:
            conn.send(bytes(out))
            out.clear()
    conn.send(bytes(out))


class Calls:
    """Reads the server's frames into each call's reply and trailers."""

    def __init__(self, conn: RawH2):
        self.conn = conn
        self.payload: dict[int, bytes] = {}
        self.trailers: dict[int, dict] = {}
        self.other: list[tuple[int, int, int, bytes]] = []

    def wait(self, sids: set[int], timeout: float = 30) -> None:
        def done(f) -> bool:
            ftype, flags, sid, data = f
            if ftype == DATA and sid in sids:
                self.payload[sid] = self.payload.get(sid, b"") + data
            elif ftype == HEADERS and sid in sids:
                headers = self.conn.decode(data)
                if flags & END_STREAM:
                    self.trailers[sid] = headers
            else:
                self.other.append(f)
            return sids <= set(self.trailers)

        self.conn.frames(timeout=timeout, until=done)
        assert sids <= set(self.trailers), f"no answer for {sids - set(self.trailers)}"

    def ok(self, sid: int, message: bytes) -> None:
        assert self.trailers[sid].get("grpc-status") == "0", self.trailers[sid]
        assert self.payload[sid][5:] == expected(message)


def message(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


def test_a_message_in_small_frames_comes_out_whole_however_the_reads_fall(server):
    address, taken = server
    for seed, n in enumerate((4 << 20, (1 << 20) + 3, 300_001)):
        msg = message(n, seed)
        with RawH2(address) as conn:
            length = ("content-length", str(len(msg) + 5))  # (h2load sends one)
            conn.send(conn.request_headers(PATH, *([length] if seed != 1 else [])))
            send_in_pieces(conn, data_frames(grpc_message(msg), 1), seed)
            calls = Calls(conn)
            calls.wait({1})
            calls.ok(1, msg)
    assert taken, "the reader never took a message over"
    assert_buffers_free()


def test_frames_of_anything_else_between_a_message_s_frames(server):
    """A PING, a small call and a padded frame in the middle of a large message: all answered, the message whole."""
    address, _ = server
    msg, small = message(3 << 20, 1), b"small"
    frames = data_frames(grpc_message(msg), 1)
    padded = frames[100]  # frame 100 again, padded: 1 byte of pad length, the payload, 7 bytes of padding
    body = padded[9:]
    frames[100] = frame(DATA, PADDED, 1, bytes([7]) + body + bytes(7))
    with RawH2(address) as conn:
        conn.send(conn.request_headers(PATH))
        conn.send(b"".join(frames[:60]) + frame(PING, 0, 0, b"12345678"))
        conn.send(conn.request_headers(PATH, sid=3) + frame(DATA, END_STREAM, 3, grpc_message(small)))
        send_in_pieces(conn, frames[60:], 5)
        calls = Calls(conn)
        calls.wait({1, 3})
        calls.ok(1, msg)
        calls.ok(3, small)
        assert any(f[0] == PING and f[3] == b"12345678" for f in calls.other)


def test_two_large_messages_whose_frames_alternate(server):
    address, _ = server
    a, b = message(2 << 20, 2), message((2 << 20) + 77, 3)
    fa, fb = data_frames(grpc_message(a), 1), data_frames(grpc_message(b), 3)
    mixed = [f for pair in zip(fa, fb, strict=False) for f in pair] + fa[len(fb) :] + fb[len(fa) :]
    with RawH2(address) as conn:
        conn.send(conn.request_headers(PATH) + conn.request_headers(PATH, sid=3))
        send_in_pieces(conn, mixed, 7)
        calls = Calls(conn)
        calls.wait({1, 3})
        calls.ok(1, a)
        calls.ok(3, b)


def test_more_or_less_than_the_message_announced(server):
    address, _ = server
    msg = message(1 << 20, 4)
    for claimed in (len(msg) - 100_000, len(msg) + 100_000):
        body = struct.pack(">BI", 0, claimed) + msg
        with RawH2(address) as conn:
            conn.send(conn.request_headers(PATH))
            send_in_pieces(conn, data_frames(body, 1), claimed)
            calls = Calls(conn)
            calls.wait({1})
            assert calls.trailers[1].get("grpc-status") == "13", calls.trailers[1]
            assert "expected one request message of" in calls.trailers[1].get("grpc-message", "")


def test_a_message_larger_than_the_stream_window_gets_more_window(server):
    """20 MiB against the 16 MiB a stream may send unacknowledged: the client sends what its window allows,
    and the server, reading frames in place, grants the rest."""
    address, taken = server
    msg = message(20 << 20, 6)
    frames = data_frames(grpc_message(msg), 1)
    window = 1 << 24  # the server's SETTINGS_INITIAL_WINDOW_SIZE
    first = window // FRAME
    with RawH2(address) as conn:
        conn.send(conn.request_headers(PATH))
        conn.send(b"".join(frames[:first]))
        granted = 0
        need = len(grpc_message(msg)) - first * FRAME

        def more(f) -> bool:
            nonlocal granted
            if f[0] == WINDOW_UPDATE and f[2] == 1:
                granted += struct.unpack(">I", f[3])[0]
            return granted >= need

        conn.frames(timeout=30, until=more)
        assert granted >= need, f"the stream's window opened by {granted} bytes, {need} needed"
        conn.send(b"".join(frames[first:]))
        calls = Calls(conn)
        calls.wait({1})
        calls.ok(1, msg)
    assert 1 in taken


def test_a_client_gone_in_the_middle_of_a_message(server):
    address, _ = server
    msg = message(4 << 20, 8)
    frames = data_frames(grpc_message(msg), 1)
    with RawH2(address) as conn:
        conn.send(conn.request_headers(PATH))
        conn.send(b"".join(frames[: len(frames) // 2]) + frames[len(frames) // 2][:5000])
        time.sleep(0.2)
    assert_buffers_free()
    with RawH2(address) as conn:  # the server goes on
        conn.send(conn.request_headers(PATH))
        conn.send(b"".join(frames))
        calls = Calls(conn)
        calls.wait({1})
        calls.ok(1, msg)


def test_a_content_length_the_frames_overrun_resets_the_stream(server):
    """HTTP/2's own check (RFC 9113 section 8.1.1) holds while the reader takes the frames: more DATA than the
    request's content-length resets the stream with PROTOCOL_ERROR, and the connection goes on."""
    address, _ = server
    msg = message(2 << 20, 9)
    body = grpc_message(msg)
    with RawH2(address) as conn:
        conn.send(conn.request_headers(PATH, ("content-length", str(len(body) - 50_000))))
        send_in_pieces(conn, data_frames(body, 1), 9)
        reset = conn.frames(timeout=30, until=lambda f: f[0] == RST_STREAM and f[2] == 1)
        assert (
            reset and reset[-1][0] == RST_STREAM and struct.unpack(">I", reset[-1][3])[0] == 1
        )  # PROTOCOL_ERROR
        conn.send(conn.request_headers(PATH, sid=3) + frame(DATA, END_STREAM, 3, grpc_message(b"after")))
        calls = Calls(conn)
        calls.wait({3})
        calls.ok(3, b"after")


def test_a_message_in_small_frames_over_tls(monkeypatch, tmp_path):
    """Behind TLS the reader gets the decrypted bytes (uvloop's SSL transport fills a BufferedProtocol too)."""
    from pki import Pki

    pki = Pki(tmp_path, "naiad-test-ca")
    cert, key = pki.issue("server")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    server_ctx.set_alpn_protocols(["h2"])
    client_ctx = ssl.create_default_context(cafile=pki.ca)
    client_ctx.set_alpn_protocols(["h2"])
    served = serve(monkeypatch, server_ctx)
    address, taken = next(served)
    try:
        msg = message(4 << 20, 10)
        with RawH2(address, tls=client_ctx) as conn:
            conn.send(conn.request_headers(PATH, ("content-length", str(len(msg) + 5))))
            send_in_pieces(conn, data_frames(grpc_message(msg), 1), 10)
            calls = Calls(conn)
            calls.wait({1})
            calls.ok(1, msg)
        assert taken == [1]
    finally:
        next(served, None)  # (the server's teardown)


def lowat_seen(monkeypatch) -> tuple[list[int], list]:
    """(the socket's SO_RCVLOWAT at each read the message reader takes, the server-side sockets a mark was raised
    on)."""
    seen: list[int] = []
    sockets: list = []
    updated, expect = MessageReader.buffer_updated, LowMark.expect

    def recorded(self, nbytes: int) -> None:
        sock = self.conn.transport.get_extra_info("socket")
        seen.append(sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT))
        updated(self, nbytes)

    def raised(self, owed: int) -> None:
        expect(self, owed)
        if self.mark > 1:
            sockets.append(self.sock)

    monkeypatch.setattr(MessageReader, "buffer_updated", recorded)
    monkeypatch.setattr(LowMark, "expect", raised)
    return seen, sockets


def test_the_socket_wakes_for_many_frames_while_a_message_is_read_and_for_any_byte_after(server, monkeypatch):
    """SO_RCVLOWAT is raised while the reader has the transport (a client's 16 KiB frames wake the server a
    read per READ_LOWAT bytes, not per few frames) and is 1 again once the message is in: a small call after it
    on the same connection is answered."""
    address, taken = server
    seen, sockets = lowat_seen(monkeypatch)
    msgs = [message(4 << 20, 20 + i) for i in range(3)]
    with RawH2(address) as conn:
        for i, msg in enumerate(msgs):
            sid = 1 + 2 * i
            conn.send(conn.request_headers(PATH, sid=sid))
            conn.send(b"".join(data_frames(grpc_message(msg), sid)))
            calls = Calls(conn)
            calls.wait({sid})
            calls.ok(sid, msg)
            assert sockets, "the low mark was never raised"
            assert sockets[-1].getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        conn.send(conn.request_headers(PATH, sid=7) + frame(DATA, END_STREAM, 7, grpc_message(b"tiny")))
        calls = Calls(conn)
        calls.wait({7}, timeout=5)
        calls.ok(7, b"tiny")
    assert taken == [1, 3, 5]
    raised = [v for v in seen if v > 1]
    assert raised and max(raised) <= READ_LOWAT, seen
    # the receive buffer grows on a fast connection: by the last message the mark is the full READ_LOWAT
    assert READ_LOWAT in seen, seen


@pytest.mark.parametrize("then", ["end", "ping"])
def test_a_client_that_stops_in_the_middle_of_a_message_is_answered(server, monkeypatch, then):
    """A client that sends part of its message, then ends the stream (or pings) with fewer bytes queued than the
    low mark, waits for the server: the stall check drops the mark and what it sent is read (an error for the
    short message, the PING's ack) within a few STALL_S, not never."""
    address, taken = server
    _, sockets = lowat_seen(monkeypatch)
    msg = message(4 << 20, 30)
    frames = data_frames(grpc_message(msg), 1)
    with RawH2(address) as conn:
        conn.send(conn.request_headers(PATH))
        conn.send(b"".join(frames[:64]))  # 1 MiB of the 4
        time.sleep(0.2)  # (read and squeezed: the stop below is after it)
        last = frame(DATA, END_STREAM, 1, b"") if then == "end" else frame(PING, 0, 0, b"stopped!")
        conn.send(last)
        began = time.monotonic()
        if then == "end":
            calls = Calls(conn)
            calls.wait({1}, timeout=5)
            assert calls.trailers[1].get("grpc-status") == "13", calls.trailers[1]
        else:
            acks = conn.frames(timeout=5, until=lambda f: f[0] == PING and f[3] == b"stopped!")
            assert acks and acks[-1][0] == PING, "the PING was never answered"
        waited = time.monotonic() - began
    assert taken == [1] and sockets, "the reader did not raise the low mark"
    assert waited < 10 * STALL_S, f"answered after {waited:.3f} s"
