"""gRPC over HTTP/2 at the message level: gRPC's request headers, length-prefixed messages, status trailers, and
the types servicers meet (Method, Abort, WireMessage). Compressed messages are compression.py's."""

from __future__ import annotations

import struct
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from .h2.framing import hpack_int, hpack_literal
from .h2.headers import RequestHead

MAX_STATUS_MESSAGE = 4096  # grpc-message is cut to this many characters

MSG_PREFIX = struct.Struct(">BI")  # gRPC message: compressed flag, length

# ":status: 200" is static entry 8; content-type (static name 31) as a literal without indexing.
RESPONSE_HEADERS = b"\x88" + hpack_int(31, 4) + hpack_int(16, 7) + b"application/grpc"
_GRPC_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def status_block(code: int, message: str, metadata=()) -> bytes:
    block = hpack_literal(b"grpc-status", str(code).encode())
    for key, value in metadata:
        block += hpack_literal(key.lower().encode("latin-1"), str(value).encode("latin-1"))
    if len(message) > MAX_STATUS_MESSAGE:
        message = message[: MAX_STATUS_MESSAGE - 3] + "..."
    if message:
        block += hpack_literal(b"grpc-message", urllib.parse.quote(message, safe=_GRPC_MESSAGE_SAFE).encode())
    return block


OK_TRAILERS = status_block(0, "")


def status_code(status) -> int:
    """grpc.StatusCode or int -> the wire number."""
    return status.value[0] if isinstance(status, grpc.StatusCode) else int(status)


class WireMessage:
    """A response that serializes itself as a list of buffers, sent in order without joining them."""

    __slots__ = ()

    def wire_chunks(self) -> list:
        raise NotImplementedError


class Abort(Exception):
    """Raised by `Stream.abort` (the servicers' `context.abort`): ends the call with a status."""

    def __init__(self, code, details: str, trailing_metadata=()):
        super().__init__(details)
        self.code = status_code(code)
        self.details = details
        self.trailing_metadata = tuple(trailing_metadata)  # (key, value) pairs sent after grpc-status
        self.inflated = 0  # a refused compressed message: the bytes it had inflated to (since freed)


@dataclass(frozen=True)
class Method:
    """One RPC: `call(request_or_iterator, context)` is a coroutine (unary response) or an async iterator."""

    request_type: Any
    call: Callable
    client_streaming: bool = False
    server_streaming: bool = False
    group: str | None = None  # restricted-protocol group


_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def _grpc_timeout(value: bytes) -> float | None:
    """The `grpc-timeout` header (at most 8 digits and a unit) in seconds; None when malformed."""
    unit = _TIMEOUT_UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


class GrpcRequestHead(RequestHead):
    """A request's header block with gRPC's own headers read too: `encoding` (grpc-encoding, the coding of its
    compressed messages) and `timeout` (grpc-timeout in seconds; None when absent or malformed)."""

    __slots__ = ("encoding", "timeout")

    TAKEN = RequestHead.TAKEN | {b"grpc-encoding", b"grpc-timeout"}

    def __init__(self, headers: list):
        self.encoding = b""
        self.timeout: float | None = None
        RequestHead.__init__(self, headers)  # (not super(): ~0.4 µs more a new header block)

    def take(self, name: bytes, value: bytes) -> None:
        if name == b"grpc-encoding":
            self.encoding = value
        else:
            self.timeout = _grpc_timeout(value)
