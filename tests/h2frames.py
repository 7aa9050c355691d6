"""A raw HTTP/2 client for tests that must send what no real client sends (floods, bombs, silence)."""

from __future__ import annotations

import socket
import ssl
import struct
import time

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
END_STREAM, END_HEADERS = 0x1, 0x4


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">IBI", len(payload) << 8 | ftype, flags, sid) + payload


def grpc_message(payload: bytes, compressed: bool = False) -> bytes:
    return struct.pack(">BI", int(compressed), len(payload)) + payload


class RawH2:
    """One connection: `send` frames, `frames()` reads what the server sent."""

    def __init__(self, address: str, settings: bytes = b"", tls: ssl.SSLContext | None = None):
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        if tls is not None:  # (ALPN h2 set by the caller)
            self.sock = tls.wrap_socket(self.sock, server_hostname=host)
        self.enc = hpack.Encoder()
        self.dec = hpack.Decoder()
        self.buf = b""
        self.closed = False
        self.sock.sendall(PREFACE + frame(SETTINGS, 0, 0, settings))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request_headers(
        self, path: str, *extra: tuple[str, str], end_stream: bool = False, sid: int = 1
    ) -> bytes:
        block = self.enc.encode(
            [
                (":method", "POST"),
                (":scheme", "http"),
                (":path", path),
                (":authority", "localhost"),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                *extra,
            ]
        )
        return frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), sid, block)

    def frames(self, timeout: float = 5.0, until=None) -> list[tuple[int, int, int, bytes]]:
        """Frames until `until(frame)` is true, the connection closes (`closed`) or `timeout` passes."""
        out = []
        deadline = time.monotonic() + timeout
        while True:
            while len(self.buf) >= 9:
                lt, flags, sid = struct.unpack(">IBI", self.buf[:9])
                n = lt >> 8
                if len(self.buf) < 9 + n:
                    break
                f = (lt & 0xFF, flags, sid & 0x7FFFFFFF, self.buf[9 : 9 + n])
                self.buf = self.buf[9 + n :]
                out.append(f)
                if until is not None and until(f):
                    return out
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                return out
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                return out
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                return out
            self.buf += chunk

    def decode(self, block: bytes) -> dict[str, str]:
        return dict(self.dec.decode(block))

    def close(self) -> None:
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def goaway(frames) -> tuple[int, bytes] | None:
    """(error code, debug data) of the first GOAWAY among `frames`."""
    for ftype, _, _, payload in frames:
        if ftype == GOAWAY:
            return struct.unpack(">I", payload[4:8])[0], payload[8:]
    return None
