"""gRPC over HTTP/2 at the message level: request header blocks, length-prefixed messages, status trailers, and
the types servicers meet (Method, Abort, WireMessage). Compressed messages are compression.py's."""

from __future__ import annotations

import struct
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from .h2.framing import hpack_int, hpack_literal

MAX_MESSAGE = 2**31 - 1
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


# headers RFC 9113 section 8.2.2 forbids in HTTP/2
_CONNECTION_HEADERS = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade")
)
_REQUEST_PSEUDO = frozenset((b":method", b":scheme", b":path", b":authority"))
_NOT_METADATA = frozenset((b"te", b"content-type", b"grpc-encoding", b"grpc-timeout", b"content-length"))


class RequestHead:
    """A decoded header block, validated (RFC 9113 section 8.3) and split into what the call uses. `error`
    says why it is not a well-formed request header block; `pseudo`: it has pseudo-headers (not trailers)."""

    __slots__ = (
        "content_length",
        "ctype",
        "encoding",
        "error",
        "metadata",
        "method",
        "path",
        "pseudo",
        "scheme",
        "timeout",
    )

    def __init__(self, headers: list):
        self.path = self.method = None
        self.ctype = self.encoding = b""
        self.timeout: float | None = None
        self.content_length: int | None = None
        self.error = ""
        self.pseudo = self.scheme = False
        meta = []
        seen: set = set()
        regular = False
        for name, value in headers:
            if name[:1] == b":":
                self.pseudo = True
                if regular:
                    self.error = "a pseudo-header after a regular header"
                elif name not in _REQUEST_PSEUDO:
                    self.error = "an unknown pseudo-header"
                elif name in seen:
                    self.error = "a duplicate pseudo-header"
                seen.add(name)
                if name == b":path":
                    self.path = value
                elif name == b":method":
                    self.method = value
                elif name == b":scheme":
                    self.scheme = True
                continue
            regular = True
            if name != name.lower():
                self.error = "an upper-case header name"
            elif name in _CONNECTION_HEADERS or (name == b"te" and value != b"trailers"):
                self.error = "a connection-specific header"
            elif name in _NOT_METADATA:
                if name == b"content-type":
                    self.ctype = value
                elif name == b"grpc-encoding":
                    self.encoding = value
                elif name == b"grpc-timeout":
                    self.timeout = _grpc_timeout(value)
                elif name == b"content-length":
                    self.content_length = int(value) if value.isdigit() else -1
                continue
            meta.append((name, value))
        self.metadata = tuple(meta)
        if not self.error and (not self.path or self.method is None or not self.scheme):
            self.error = "a missing or empty request pseudo-header"
        if not self.error and self.content_length == -1:
            self.error = "an invalid content-length"


def message_length(buf, pos: int, limit: int) -> int:
    """The length a message prefix at `buf[pos:]` announces; RESOURCE_EXHAUSTED past `limit`."""
    length = int.from_bytes(buf[pos + 1 : pos + 5], "big")
    if length > limit:
        raise Abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"Received message larger than max ({length} vs. {limit})",
        )
    return length
