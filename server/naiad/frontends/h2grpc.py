"""gRPC over cleartext HTTP/2 (h2c), written for the inference hot path.

Why not grpc.aio: on one core, a grpc.aio server that only echoes its request answers ~2,100-2,400 unary
calls/s (the `h2` library, pure Python, the same), a fraction of a real Triton's C++ frontend. Most of that
time is the hand-off between grpcio's completion-queue thread and the event loop, not HTTP/2 itself. This
module speaks the subset of HTTP/2 that gRPC clients use (RFC 9113 framing, flow control, PING, SETTINGS,
GOAWAY, RST_STREAM) directly on an asyncio transport, with the `hpack` library for header compression, and
calls the same servicer coroutines as the grpc.aio server (`naiad serve --grpc-implementation grpcio` still
selects that one).

What is served: unary-unary, stream-stream and unary-stream methods given as a path table; gRPC message
compression gzip/deflate on requests (responses are sent uncompressed, which every client accepts), inflated
with a bound and off the event loop; trailers-only error responses with percent-encoded `grpc-message`;
`grpc-timeout` deadlines (DEADLINE_EXCEEDED, the call's work cancelled). Not served: TLS (h2c only), server
push.

Limits (H2Settings, from `naiad serve`'s --grpc-* flags): SETTINGS_MAX_CONCURRENT_STREAMS, a per-message
size limit, header blocks capped at MAX_HEADER_LIST, flow-control window granted to a streaming call as it
takes its messages, reading paused while the client does not read our writes, keepalive PINGs and grpcio's
ping-abuse policy (GOAWAY ENHANCE_YOUR_CALM "too_many_pings"), and handshake, idle and stall deadlines. The
RFC 9113 checks h2spec makes are applied (docs/security.md).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
import urllib.parse
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import hpack

log = logging.getLogger("naiad.grpc")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types and flags (RFC 9113 section 6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    range(10)
)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# error codes (section 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 5, 6, 7, 8, 9
ENHANCE_YOUR_CALM = 0xB

# settings identifiers
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 1, 2, 3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 4, 5, 6

MAX_WINDOW = 2**31 - 1
RECV_STREAM_WINDOW = 1 << 24  # what each stream may send us before we acknowledge
RECV_CONN_WINDOW = 1 << 30  # the same for the whole connection
RECV_MAX_FRAME = 1 << 20  # fewer frames for large tensors
MAX_HEADER_LIST = 64 * 1024  # decoded header list, and the encoded block (HEADERS + CONTINUATION) as well
MAX_MESSAGE = 2**31 - 1
MAX_STATUS_MESSAGE = 4096  # grpc-message is cut to this many characters
INLINE_INFLATE = (
    8192  # compressed messages up to this size are inflated on the event loop, larger ones off it
)
WRITE_HIGH_WATER = 4 << 20  # the transport's write buffer above which reading pauses

_FRAME = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id
_MSG_PREFIX = struct.Struct(">BI")  # gRPC message: compressed flag, length


def frame(ftype: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return _FRAME.pack(len(payload) << 8 | ftype, flags, sid) + payload


def _hpack_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """Literal header field without indexing, new name, no Huffman: leaves the peer's table untouched."""
    return b"\x00" + _hpack_int(len(name), 7) + name + _hpack_int(len(value), 7) + value


# ":status: 200" is static entry 8; content-type (static name 31) as a literal without indexing.
_RESPONSE_HEADERS = b"\x88" + _hpack_int(31, 4) + _hpack_int(16, 7) + b"application/grpc"
_GRPC_MESSAGE_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


def _status_block(code: int, message: str) -> bytes:
    block = _literal(b"grpc-status", str(code).encode())
    if len(message) > MAX_STATUS_MESSAGE:
        message = message[: MAX_STATUS_MESSAGE - 3] + "..."
    if message:
        block += _literal(b"grpc-message", urllib.parse.quote(message, safe=_GRPC_MESSAGE_SAFE).encode())
    return block


_OK_TRAILERS = _status_block(0, "")


def _code(status) -> int:
    """grpc.StatusCode or int -> the wire number."""
    return status.value[0] if isinstance(status, grpc.StatusCode) else int(status)


class WireMessage:
    """A response that serializes itself as a list of buffers, sent in order without joining them."""

    __slots__ = ()

    def wire_chunks(self) -> list:
        raise NotImplementedError


class Abort(Exception):
    """Raised by `Stream.abort` (the servicers' `context.abort`): ends the call with a status."""

    def __init__(self, code, details: str):
        super().__init__(details)
        self.code = _code(code)
        self.details = details


class _ConnectionError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Method:
    """One RPC: `call(request_or_iterator, context)` is a coroutine (unary response) or an async iterator."""

    request_type: Any
    call: Callable
    client_streaming: bool = False
    server_streaming: bool = False
    group: str | None = None  # restricted-protocol group


@dataclass(frozen=True)
class H2Settings:
    """Limits and timers of the server. Times in milliseconds, named as grpcio's channel arguments; the
    keepalive ones default to Triton's flag defaults. 0 turns a timer (or a count limit) off."""

    max_concurrent_streams: int = 100
    max_message: int = MAX_MESSAGE  # per request message, after decompression
    keepalive_time_ms: int = 7_200_000
    keepalive_timeout_ms: int = 20_000
    keepalive_permit_without_calls: bool = False
    http2_max_pings_without_data: int = 2
    http2_min_recv_ping_interval_without_data_ms: int = 300_000
    http2_max_ping_strikes: int = 2
    handshake_timeout_ms: int = 10_000  # the client's preface; and a header block left open
    max_connection_idle_ms: int = 3_600_000  # no call open for this long: GOAWAY NO_ERROR, then close
    stall_timeout_ms: int = 60_000  # a response blocked on a zero window, a request body that stops coming


class Stream:
    """One call. Also the `context` handed to servicer methods (the subset of grpc.aio's they use)."""

    __slots__ = (
        "blocked_since",
        "body",
        "conn",
        "content_length",
        "deadline",
        "done",
        "encoding",
        "headers_sent",
        "held",
        "http_status",
        "inbuf",
        "last_data",
        "metadata",
        "method",
        "pending",
        "queue",
        "received",
        "remote_closed",
        "send_window",
        "sid",
        "task",
        "trailers",
        "unacked",
    )

    def __init__(self, conn: _Connection, sid: int, send_window: int):
        self.conn = conn
        self.sid = sid
        self.method: Method | None = None
        self.metadata: tuple = ()
        self.encoding = b""
        self.body: list = []  # unary request: DATA payloads until END_STREAM
        self.received = 0
        self.unacked = 0
        self.held = 0  # received bytes whose window is granted only once the call takes its queued messages
        self.send_window = send_window
        self.pending: collections.deque | None = None  # DATA not yet allowed by flow control
        self.trailers: bytes | None = None
        self.headers_sent = False
        self.remote_closed = False
        self.done = False
        self.task: asyncio.Task | None = None
        self.queue: asyncio.Queue | None = None  # client streaming: complete messages, then None
        self.inbuf: bytearray | None = None
        self.deadline: asyncio.TimerHandle | None = None  # grpc-timeout
        self.content_length: int | None = None
        self.http_status = b""  # not a gRPC request: answered with this status once the client's half ends
        self.last_data = conn.last_recv
        self.blocked_since = 0.0

    # -- the grpc.aio ServicerContext subset --
    async def abort(self, code, details: str = "", trailing_metadata=()):
        raise Abort(code, details)

    def invocation_metadata(self):
        return tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in self.metadata)

    def peer(self) -> str:
        peer = self.conn.transport.get_extra_info("peername") if self.conn.transport else None
        return f"ipv4:{peer[0]}:{peer[1]}" if peer else ""

    def cancelled(self) -> bool:
        return self.done

    def time_remaining(self):
        if self.deadline is None:
            return None
        return max(0.0, self.deadline.when() - self.conn.loop.time())


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


class _Head:
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


_WBITS = {b"gzip": 31, b"deflate": zlib.MAX_WBITS}


def _inflate(encoding: bytes, payload, limit: int) -> bytes:
    """A compressed message inflated to at most `limit` bytes; beyond that, RESOURCE_EXHAUSTED (the rest of
    the input is never inflated, so a small bomb costs at most `limit` + 1 bytes)."""
    wbits = _WBITS.get(encoding)
    if wbits is None:
        raise Abort(grpc.StatusCode.UNIMPLEMENTED, "unsupported grpc-encoding (gzip and deflate are served)")
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(payload, limit + 1)
    except zlib.error as exc:
        raise Abort(grpc.StatusCode.INTERNAL, f"failed to decompress the request message: {exc}") from None
    if len(out) > limit or d.unconsumed_tail:
        raise Abort(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"Received message larger than max ({limit} bytes) after decompression",
        )
    if not d.eof:
        raise Abort(grpc.StatusCode.INTERNAL, "failed to decompress the request message: truncated")
    return out


async def _decompress(loop, encoding: bytes, payload, limit: int) -> bytes:
    """`_inflate`, off the event loop (one at a time per server, so bombs cannot multiply) unless small."""
    if len(payload) <= INLINE_INFLATE:
        return _inflate(encoding, payload, limit)
    return await loop.run_in_executor(_inflater(), _inflate, encoding, payload, limit)


_INFLATER = None


def _inflater():
    global _INFLATER
    if _INFLATER is None:
        from concurrent.futures import ThreadPoolExecutor

        _INFLATER = ThreadPoolExecutor(1, thread_name_prefix="naiad-grpc-inflate")
    return _INFLATER


def _split_messages(buf: bytearray, limit: int) -> list:
    """Complete length-prefixed messages at the front of `buf` (removed from it), as (compressed, payload)."""
    out = []
    pos = 0
    while len(buf) - pos >= 5:
        compressed, length = _MSG_PREFIX.unpack_from(buf, pos)
        if length > limit:
            raise Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Received message larger than max ({length} vs. {limit})",
            )
        if len(buf) - pos - 5 < length:
            break
        out.append((compressed, bytes(buf[pos + 5 : pos + 5 + length])))
        pos += 5 + length
    if pos:
        del buf[:pos]
    return out


KEEPALIVE_PING = b"naiad-ka"  # the opaque data of our keepalive PINGs
SELF_DEPENDENT = 0x100  # (not a wire flag) the HEADERS frame made its stream depend on itself
MAX_RESETS_PER_TICK = 1000  # streams a client may reset between two sweeps before GOAWAY ENHANCE_YOUR_CALM
_PLAIN_TEXT = _hpack_int(31, 4) + _hpack_int(10, 7) + b"text/plain"
_NOT_GRPC = b"this is a gRPC server: requests are POST with content-type application/grpc\n"


class _Connection(asyncio.Protocol):
    def __init__(self, server: H2GrpcServer):
        self.server = server
        self.settings = server.settings
        self.max_message = server.settings.max_message
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.preface = False
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = MAX_HEADER_LIST
        self.decoder.max_allowed_table_size = 4096
        self.streams: dict[int, Stream] = {}
        self.last_sid = 0
        self.headers_sid = 0  # a header block continues in CONTINUATION frames
        self.headers_flags = 0
        self.headers_block = bytearray()
        self.headers_since = 0.0
        self.header_cache: dict[bytes, _Head] = {}
        self.reset_sids: dict[int, None] = {}  # streams we ended while the client could still send on them
        self.send_window = 65535
        self.peer_initial_window = 65535
        self.peer_max_frame = 16384
        self.recv_unacked = 0
        self.blocked: dict[int, Stream] = {}
        self.draining = False
        self.closed = False
        now = self.loop.time()
        self.opened = self.last_recv = self.idle_since = now
        self.write_paused_since: float | None = None
        self.ping_sent_at: float | None = None  # our keepalive PING awaiting its ACK
        self.pings_without_data = 0
        self.last_ping_recv = float("-inf")
        self.ping_strikes = 0
        self.resets = 0

    # ---- asyncio.Protocol ----
    def connection_made(self, transport):
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        self.server.connections.add(self)
        settings = struct.pack(
            ">HIHIHIHI",
            S_MAX_CONCURRENT_STREAMS,
            self.settings.max_concurrent_streams or MAX_WINDOW,
            S_INITIAL_WINDOW_SIZE,
            RECV_STREAM_WINDOW,
            S_MAX_FRAME_SIZE,
            RECV_MAX_FRAME,
            S_MAX_HEADER_LIST_SIZE,
            MAX_HEADER_LIST,
        )
        transport.write(
            frame(SETTINGS, 0, 0, settings)
            + frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", RECV_CONN_WINDOW - 65535))
        )

    def connection_lost(self, exc):
        self.closed = True
        self.server.connections.discard(self)
        for st in list(self.streams.values()):
            self._drop(st)
        self.streams.clear()
        self.blocked.clear()
        self.header_cache.clear()
        self.buf = bytearray()

    def pause_writing(self):
        """The client is not reading what we write: stop reading what it sends (no new calls, no replies to
        its control frames) until the buffer drains."""
        self.write_paused_since = self.loop.time()
        if not self.closed:
            self.transport.pause_reading()

    def resume_writing(self):
        self.write_paused_since = None
        if not self.closed:
            self.transport.resume_reading()

    def data_received(self, data: bytes):
        if self.closed:
            return
        self.last_recv = self.loop.time()
        try:
            if self.buf:
                buf = self.buf
                buf += data
                if self.preface and len(buf) >= 9:
                    length = int.from_bytes(buf[:3], "big")
                    if length > RECV_MAX_FRAME:
                        raise _ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
                    if len(buf) < 9 + length:
                        return  # the frame is still incomplete: wait without copying
                data = bytes(buf)
                buf.clear()
            pos = 0
            if not self.preface:
                if len(data) < 24:
                    if PREFACE.startswith(data):
                        self.buf += data
                        return
                    raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                if data[:24] != PREFACE:
                    raise _ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self.preface = True
                pos = 24
            n = len(data)
            view = memoryview(data)
            while n - pos >= 9:
                lt, flags, sid = _FRAME.unpack_from(data, pos)
                length = lt >> 8
                if length > RECV_MAX_FRAME:
                    raise _ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
                end = pos + 9 + length
                if end > n:
                    break
                self._frame(lt & 0xFF, flags, sid & 0x7FFFFFFF, view[pos + 9 : end])
                pos = end
                if self.closed:
                    return
            if pos < n:
                self.buf += view[pos:]
                if len(self.buf) >= 9:
                    length = int.from_bytes(self.buf[:3], "big")
                    if length > RECV_MAX_FRAME:
                        raise _ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
        except _ConnectionError as exc:
            self._close_with(exc.code, str(exc))
        except hpack.HPACKError as exc:
            self._close_with(COMPRESSION_ERROR, f"header block: {type(exc).__name__}")

    def _close_with(self, code: int, message: str) -> None:
        self._goaway(code, message)
        self.buf = bytearray()
        self.headers_block = bytearray()
        if self.transport is not None:
            self.transport.close()

    # ---- frames ----
    def _frame(self, ftype: int, flags: int, sid: int, payload: memoryview) -> None:
        if self.headers_sid and ftype != CONTINUATION:
            raise _ConnectionError(PROTOCOL_ERROR, "a header block was interrupted")
        if ftype == DATA:
            self._data(flags, sid, payload)
        elif ftype == HEADERS:
            self._headers(flags, sid, payload)
        elif ftype == CONTINUATION:
            if sid != self.headers_sid or not sid:
                raise _ConnectionError(PROTOCOL_ERROR, "unexpected CONTINUATION frame")
            if len(self.headers_block) + len(payload) > MAX_HEADER_LIST:
                raise _ConnectionError(ENHANCE_YOUR_CALM, "header block too large")
            self.headers_block += payload
            if flags & END_HEADERS:
                self._header_block_done()
        elif ftype == SETTINGS:
            if sid:
                raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
            if flags & ACK:
                if len(payload):
                    raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            else:
                self._settings(payload)
        elif ftype == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif ftype == PING:
            self._ping(flags, sid, payload)
        elif ftype == RST_STREAM:
            if not sid:
                raise _ConnectionError(PROTOCOL_ERROR, "RST_STREAM on stream 0")
            if len(payload) != 4:
                raise _ConnectionError(FRAME_SIZE_ERROR, "RST_STREAM payload must be 4 bytes")
            if sid > self.last_sid:
                raise _ConnectionError(PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
            st = self.streams.pop(sid, None)
            if st is not None:
                self._drop(st)
                self.resets += 1
                if self.resets > MAX_RESETS_PER_TICK:
                    raise _ConnectionError(ENHANCE_YOUR_CALM, "too many streams reset")
                self._maybe_close()
        elif ftype == PRIORITY:
            if not sid:
                raise _ConnectionError(PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                self._reset_stream(sid, FRAME_SIZE_ERROR)
            elif int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == sid:
                self._reset_stream(sid, PROTOCOL_ERROR)
        elif ftype == GOAWAY:
            if sid:
                raise _ConnectionError(PROTOCOL_ERROR, "GOAWAY on a stream")
            self.draining = True  # the client is leaving: finish what runs, take nothing new
            self._maybe_close()
        elif ftype == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "clients cannot push")
        # unknown frame types are ignored, as the RFC requires

    def _settings(self, payload: memoryview) -> None:
        if len(payload) % 6:
            raise _ConnectionError(FRAME_SIZE_ERROR, "SETTINGS payload is not a multiple of 6")
        for off in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, off)
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise _ConnectionError(FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for st in self.streams.values():
                    st.send_window += delta
                    if st.send_window > MAX_WINDOW:
                        raise _ConnectionError(FLOW_CONTROL_ERROR, "a stream window grew past 2^31-1")
            elif key == S_MAX_FRAME_SIZE:
                if not 16384 <= value <= 16777215:
                    raise _ConnectionError(PROTOCOL_ERROR, "invalid SETTINGS_MAX_FRAME_SIZE")
                self.peer_max_frame = value
            elif key == S_ENABLE_PUSH and value > 1:
                raise _ConnectionError(PROTOCOL_ERROR, "invalid SETTINGS_ENABLE_PUSH")
        self.transport.write(frame(SETTINGS, ACK, 0))
        self._flush_blocked()

    def _ping(self, flags: int, sid: int, payload: memoryview) -> None:
        """Answer a PING; count the ones that come too often as grpcio's ping policy does (a strike each, and
        GOAWAY ENHANCE_YOUR_CALM "too_many_pings" beyond http2_max_ping_strikes)."""
        if sid:
            raise _ConnectionError(PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise _ConnectionError(FRAME_SIZE_ERROR, "PING payload must be 8 bytes")
        if flags & ACK:
            if payload == KEEPALIVE_PING:
                self.ping_sent_at = None
            return
        s = self.settings
        now = self.last_recv
        if not self.streams and not s.keepalive_permit_without_calls:
            interval = 7200.0  # grpcio: two hours between pings on a connection without calls
        else:
            interval = s.http2_min_recv_ping_interval_without_data_ms / 1000
        if now < self.last_ping_recv + interval:
            self.ping_strikes += 1
            if s.http2_max_ping_strikes and self.ping_strikes > s.http2_max_ping_strikes:
                raise _ConnectionError(ENHANCE_YOUR_CALM, "too_many_pings")
        self.last_ping_recv = now
        self.transport.write(frame(PING, ACK, 0, bytes(payload)))

    def _sent_data(self) -> None:
        """We sent headers or data: the ping policies start over (grpcio's ResetPingStrikes)."""
        self.ping_strikes = 0
        self.last_ping_recv = float("-inf")
        self.pings_without_data = 0

    def _window_update(self, sid: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "WINDOW_UPDATE payload must be 4 bytes")
        inc = struct.unpack_from(">I", payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if not inc:
                raise _ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE with an increment of 0")
            self.send_window += inc
            if self.send_window > MAX_WINDOW:
                raise _ConnectionError(FLOW_CONTROL_ERROR, "the connection window grew past 2^31-1")
            self._flush_blocked()
            return
        st = self.streams.get(sid)
        if st is None:
            if sid > self.last_sid:
                raise _ConnectionError(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
            return
        if not inc:
            self._reset_stream(sid, PROTOCOL_ERROR)
            return
        st.send_window += inc
        if st.send_window > MAX_WINDOW:
            self._reset_stream(sid, FLOW_CONTROL_ERROR)
        elif st.pending:
            self._flush(st)

    def _headers(self, flags: int, sid: int, payload: memoryview) -> None:
        if sid == 0 or not sid & 1:
            raise _ConnectionError(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        start, end = 0, len(payload)
        if flags & PADDED:
            if not end:
                raise _ConnectionError(PROTOCOL_ERROR, "an empty PADDED HEADERS frame")
            start, end = 1, end - payload[0]
        if flags & PRIORITY_FLAG:
            if end - start >= 5 and int.from_bytes(payload[start : start + 4], "big") & 0x7FFFFFFF == sid:
                flags |= SELF_DEPENDENT
            start += 5
        if start > end:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS padding exceeds the frame")
        if end - start > MAX_HEADER_LIST:
            raise _ConnectionError(ENHANCE_YOUR_CALM, "header block too large")
        self.headers_sid = sid
        self.headers_flags = flags
        self.headers_since = self.last_recv
        self.headers_block[:] = payload[start:end]
        if flags & END_HEADERS:
            self._header_block_done()

    def _header_block_done(self) -> None:
        sid, flags = self.headers_sid, self.headers_flags
        self.headers_sid = 0
        head = self._decode_headers(bytes(self.headers_block))
        if len(self.headers_block) > 4096:
            self.headers_block = bytearray()
        st = self.streams.get(sid)
        if st is not None:  # trailers from the client end its half of the stream
            if st.remote_closed:
                self._reset_stream(sid, STREAM_CLOSED)
            elif not flags & END_STREAM or head.pseudo:
                self._reset_stream(sid, PROTOCOL_ERROR)
            else:
                self._remote_end(st)
            return
        if sid <= self.last_sid:
            if sid in self.reset_sids:
                return  # trailers of a stream we already ended: ignore
            raise _ConnectionError(PROTOCOL_ERROR, f"HEADERS on closed stream {sid}")
        self.last_sid = sid
        if self.draining:
            self._reset_stream(sid, REFUSED_STREAM)
            return
        limit = self.settings.max_concurrent_streams
        if limit and len(self.streams) >= limit:
            self._reset_stream(sid, REFUSED_STREAM)
            self.resets += 1
            if self.resets > MAX_RESETS_PER_TICK:
                raise _ConnectionError(ENHANCE_YOUR_CALM, "too many streams refused")
            return
        if flags & SELF_DEPENDENT or head.error:
            self._reset_stream(sid, PROTOCOL_ERROR)
            return
        st = Stream(self, sid, self.peer_initial_window)
        self.streams[sid] = st
        st.metadata = head.metadata
        st.encoding = head.encoding
        st.content_length = head.content_length
        end = bool(flags & END_STREAM)
        st.remote_closed = end  # an immediate error response must not reset a stream the client has ended
        if head.method != b"POST" or not head.ctype.startswith(b"application/grpc"):
            st.http_status = b"415" if head.method == b"POST" else b"405"
        else:
            self._start_call(st, head.path, head.timeout)
        if end:
            self._remote_end(st)

    def _decode_headers(self, block: bytes) -> _Head:
        """HPACK-decode and validate a header block. Clients repeat the same small block of indexed fields
        call after call; while decoding it leaves the dynamic table as it was, the result is reused (the
        cache empties whenever a block changes the table, since indexed fields then may mean other headers).
        Only small blocks that decode to small lists are kept."""
        head = self.header_cache.get(block)
        if head is not None:
            return head
        table = self.decoder.header_table
        entries = table.dynamic_entries
        first, count, size = entries[0] if entries else None, len(entries), table.maxsize
        headers = self.decoder.decode(block, raw=True)
        head = _Head(headers)
        if (entries[0] if entries else None) is first and len(entries) == count and table.maxsize == size:
            if len(block) <= 1024 and sum(len(k) + len(v) for k, v in headers) <= 4096:
                if len(self.header_cache) >= 64:
                    self.header_cache.clear()
                self.header_cache[block] = head
        else:
            self.header_cache.clear()
        return head

    def _ack_conn(self, n: int) -> None:
        self.recv_unacked += n
        if self.recv_unacked >= RECV_CONN_WINDOW // 2:
            self.transport.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.recv_unacked)))
            self.recv_unacked = 0

    def _data(self, flags: int, sid: int, payload: memoryview) -> None:
        n = len(payload)
        st = self.streams.get(sid)
        if st is None or st.remote_closed:
            if sid > self.last_sid or sid == 0:
                raise _ConnectionError(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            self._ack_conn(n)  # the bytes are dropped: the connection window is given back at once
            if st is not None:
                self._reset_stream(sid, STREAM_CLOSED)  # half-closed (remote)
            elif sid not in self.reset_sids:
                raise _ConnectionError(STREAM_CLOSED, f"DATA on closed stream {sid}")
            return
        if flags & PADDED:
            if not n or payload[0] >= n:
                raise _ConnectionError(PROTOCOL_ERROR, "DATA padding exceeds the frame")
            payload = payload[1 : n - payload[0]]
        st.last_data = self.last_recv
        if st.queue is not None and not st.queue.empty():
            st.held += n  # the call has not taken what it has: grant no more window until it does
        else:
            self._ack_conn(n)
            st.unacked += n
            if st.unacked >= RECV_STREAM_WINDOW // 2 and not flags & END_STREAM:
                self.transport.write(frame(WINDOW_UPDATE, 0, sid, struct.pack(">I", st.unacked)))
                st.unacked = 0
        st.received += len(payload)
        if st.content_length is not None and st.received > st.content_length:
            self._reset_stream(sid, PROTOCOL_ERROR)
            return
        if st.method is not None:
            if st.queue is not None:
                st.inbuf += payload
                try:
                    for item in _split_messages(st.inbuf, self.max_message):
                        st.queue.put_nowait(item)
                except Abort as exc:
                    self._finish_error(st, exc.code, exc.details)
            elif st.received > self.max_message + 5:
                self._finish_error(
                    st,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Received message larger than max ({st.received - 5} vs. {self.max_message})",
                )
            else:
                st.body.append(payload)  # a view: the frame's bytes stay alive, uncopied, until parsed
        if flags & END_STREAM:
            self._remote_end(st)

    def _release(self, st: Stream) -> None:
        """The call took its queued messages: grant the window held back for them."""
        held, st.held = st.held, 0
        if not self.closed and not st.remote_closed:
            self.transport.write(
                frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", held))
                + frame(WINDOW_UPDATE, 0, st.sid, struct.pack(">I", held))
            )
        elif not self.closed:
            self._ack_conn(held)

    def _give_back(self, st: Stream) -> None:
        """A stream that ends with window held back: the connection window is the connection's, give it back."""
        held, st.held = st.held, 0
        if not self.closed:
            self._ack_conn(held)

    # ---- calls ----
    def _start_call(self, st: Stream, path: bytes, timeout: float | None) -> None:
        server = self.server
        method = server.methods.get(path)
        if method is None:
            self._finish_error(st, grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            return
        if server.authorize is not None:
            denial = server.authorize(method, st.metadata)
            if denial:
                self._finish_error(st, grpc.StatusCode.PERMISSION_DENIED, denial)
                return
        st.method = method
        if timeout is not None:
            st.deadline = self.loop.call_later(timeout, self._deadline_exceeded, st)
        if method.client_streaming:
            st.queue = asyncio.Queue()
            st.inbuf = bytearray()
            st.task = self.loop.create_task(self._run(st, self._request_iterator(st)))

    def _deadline_exceeded(self, st: Stream) -> None:
        """grpc-timeout passed: the call ends with DEADLINE_EXCEEDED and its work is cancelled (a request
        still queued for a model instance is dropped from the queue)."""
        st.deadline = None
        if not st.done and not self.closed:
            self._finish_error(st, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def _remote_end(self, st: Stream) -> None:
        st.remote_closed = True
        if st.content_length is not None and st.received != st.content_length:
            self._reset_stream(st.sid, PROTOCOL_ERROR)
            return
        if st.http_status:
            self._respond_http(st)
            return
        if st.queue is not None:
            if st.inbuf:
                self._finish_error(
                    st, grpc.StatusCode.INTERNAL, "incomplete message at the end of the stream"
                )
            st.queue.put_nowait(None)
        elif st.method is not None and st.task is None and not st.done:
            # one frame: a view of it; more: joined once, and the message is a view of that (no second copy)
            body = st.body[0] if len(st.body) == 1 else memoryview(b"".join(st.body))
            st.body = []
            error = None
            if len(body) < 5:
                error = "the request has no message"
            else:
                compressed, length = _MSG_PREFIX.unpack_from(body)
                if length != len(body) - 5:
                    error = f"expected one request message of {length} bytes, got {len(body) - 5} bytes"
            if error is not None:
                self._finish_error(st, grpc.StatusCode.INTERNAL, error)
            elif compressed:
                st.task = self.loop.create_task(self._run_compressed(st, body[5:]))
            else:
                try:
                    request = st.method.request_type.FromString(body[5:])
                except Exception as exc:
                    error = f"failed to parse the request: {exc}"
                del body
                if error is not None:
                    self._finish_error(st, grpc.StatusCode.INTERNAL, error)
                else:
                    st.task = self.loop.create_task(self._run(st, request))
        if st.done:
            self._forget(st)

    async def _run_compressed(self, st: Stream, payload) -> None:
        error = None
        try:
            payload = await _decompress(self.loop, st.encoding, payload, self.max_message)
            request = st.method.request_type.FromString(payload)
        except Abort as exc:
            error = (exc.code, exc.details)
        except Exception as exc:
            error = (_code(grpc.StatusCode.INTERNAL), f"failed to parse the request: {exc}")
        del payload
        if error is not None:
            self._finish_error(st, *error)
            return
        await self._run(st, request)

    async def _request_iterator(self, st: Stream):
        request_type = st.method.request_type
        queue = st.queue
        while True:
            item = await queue.get()
            if item is None:
                return
            if st.held and queue.empty():
                self._release(st)
            compressed, msg = item
            del item
            if compressed:
                msg = await _decompress(self.loop, st.encoding, msg, self.max_message)
            error = None
            try:
                request = request_type.FromString(msg)
            except Exception as exc:
                error = f"failed to parse a request message: {exc}"
            del msg
            if error is not None:
                raise Abort(grpc.StatusCode.INTERNAL, error)
            yield request
            del request

    async def _run(self, st: Stream, request) -> None:
        method = st.method
        try:
            if method.server_streaming:
                async for response in method.call(request, st):  # a reset stream cancels this task
                    self._send_message(st, response.SerializeToString())
                self._finish(st, _OK_TRAILERS)
            else:
                response = await method.call(request, st)
                if response is None:
                    raise Abort(grpc.StatusCode.INTERNAL, "the method returned no response")
                if isinstance(response, WireMessage):  # (not getattr: a miss on a protobuf message raises)
                    self._reply(st, response.wire_chunks())
                else:
                    self._reply(st, response.SerializeToString())
        except Abort as exc:
            exc.__traceback__ = exc.__context__ = None  # holds the frames, and with them the request
            self._finish_error(st, exc.code, exc.details)
        except asyncio.CancelledError:
            if not st.done:
                self._finish_error(st, grpc.StatusCode.CANCELLED, "the call was cancelled")
            raise
        except Exception as exc:
            log.exception("gRPC call %s failed", st.sid)
            exc.__traceback__ = None
            self._finish_error(st, grpc.StatusCode.UNKNOWN, f"Unexpected error: {exc}")

    # ---- sending ----
    def _reply(self, st: Stream, msg) -> None:
        """A unary call's whole response (headers, message, trailers) in one write when the windows allow;
        `msg`: the serialized message, or a list of buffers that make it up (sent without joining them)."""
        if type(msg) is list:
            total = 5
            for chunk in msg:
                total += len(chunk)
            if total <= self.peer_max_frame:
                msg = b"".join(msg)
        else:
            total = len(msg) + 5
        if st.pending or st.headers_sent or st.done or self.closed:
            self._send_message(st, msg, total - 5)
            self._finish(st, _OK_TRAILERS)
            return
        if total > self.peer_max_frame or total > st.send_window or total > self.send_window:
            # headers, the message in as many full DATA frames as the windows allow, and the trailers when
            # all of it went: one writelines (the rest goes as WINDOW_UPDATEs come in)
            st.headers_sent = True
            st.done = True
            st.trailers = _OK_TRAILERS
            pending = st.pending = collections.deque()
            pending.append(memoryview(_MSG_PREFIX.pack(0, total - 5)))
            if type(msg) is list:
                pending.extend(memoryview(c) for c in msg if len(c))
            elif msg:
                pending.append(memoryview(msg))
            self._sent_data()
            self._flush(
                st,
                [_FRAME.pack(len(_RESPONSE_HEADERS) << 8 | HEADERS, END_HEADERS, st.sid), _RESPONSE_HEADERS],
            )
            return
        st.send_window -= total
        self.send_window -= total
        st.headers_sent = True
        sid = st.sid
        out = [
            _FRAME.pack(len(_RESPONSE_HEADERS) << 8 | HEADERS, END_HEADERS, sid),
            _RESPONSE_HEADERS,
            _FRAME.pack(total << 8 | DATA, 0, sid),
            _MSG_PREFIX.pack(0, total - 5),
            msg,
            _FRAME.pack(len(_OK_TRAILERS) << 8 | HEADERS, END_STREAM | END_HEADERS, sid),
            _OK_TRAILERS,
        ]
        self._closed_local(st, out)
        if total < 16384:
            self.transport.write(b"".join(out))
        else:
            self.transport.writelines(out)

    def _send_message(self, st: Stream, msg, n: int | None = None) -> None:
        """One message: `msg` is its bytes, or a list of buffers of `n` bytes in all."""
        if self.closed or st.done:
            return
        out = []
        if not st.headers_sent:
            st.headers_sent = True
            out.append(frame(HEADERS, END_HEADERS, st.sid, _RESPONSE_HEADERS))
        if type(msg) is list:
            if n is None:
                n = sum(len(c) for c in msg)
            if not st.pending and n + 5 <= self.peer_max_frame:
                msg = b"".join(msg)
            else:
                chunks = msg
                msg = None
        else:
            n = len(msg)
        prefix = _MSG_PREFIX.pack(0, n)
        total = n + 5
        if (
            msg is not None
            and not st.pending
            and total <= self.peer_max_frame
            and total <= st.send_window
            and total <= self.send_window
        ):
            st.send_window -= total
            self.send_window -= total
            out.append(_FRAME.pack(total << 8 | DATA, 0, st.sid))
            out.append(prefix)
            out.append(msg)
            self.transport.writelines(out)
            if self.ping_strikes or self.pings_without_data:
                self._sent_data()
            return
        self._sent_data()
        if out:
            self.transport.writelines(out)
        if st.pending is None:
            st.pending = collections.deque()
        st.pending.append(memoryview(prefix))
        if msg is not None:
            st.pending.append(memoryview(msg))
        else:
            st.pending.extend(memoryview(c) for c in chunks if len(c))
        self._flush(st)

    def _flush(self, st: Stream, out: list | None = None) -> None:
        """Send queued DATA as far as both windows allow, then the trailers once nothing is queued. A frame is
        filled from as many queued buffers as fit (views, no copies), so a message goes out in full frames.
        `out`: frames to write before them, in the same writelines."""
        if out is None:
            out = []
        pending = st.pending
        while pending:
            allowed = min(st.send_window, self.send_window, self.peer_max_frame)
            if allowed <= 0:
                break
            head = len(out)
            out.append(None)  # the frame header, once its size is known
            size = 0
            while pending and size < allowed:
                chunk = pending[0]
                room = allowed - size
                if len(chunk) > room:
                    pending[0] = chunk[room:]
                    chunk = chunk[:room]
                else:
                    pending.popleft()
                size += len(chunk)
                out.append(chunk)
            st.send_window -= size
            self.send_window -= size
            out[head] = _FRAME.pack(size << 8 | DATA, 0, st.sid)
        if out:
            st.blocked_since = self.loop.time()  # progress
        if not pending and st.trailers is not None:
            if st.trailers:
                out.append(_FRAME.pack(len(st.trailers) << 8 | HEADERS, END_STREAM | END_HEADERS, st.sid))
                out.append(st.trailers)
            else:
                out.append(_FRAME.pack(DATA, END_STREAM, st.sid))
            st.trailers = None
            self.blocked.pop(st.sid, None)
            self._closed_local(st, out)
        elif pending:
            if st.sid not in self.blocked:
                st.blocked_since = self.loop.time()
            self.blocked[st.sid] = st
        else:
            self.blocked.pop(st.sid, None)
        if out and not self.closed:
            self.transport.writelines(out)

    def _flush_blocked(self) -> None:
        for st in list(self.blocked.values()):
            if self.send_window <= 0:
                break
            self._flush(st)

    def _finish(self, st: Stream, block: bytes) -> None:
        """End the call with a trailer block (after any queued DATA)."""
        if st.done or self.closed:
            return
        if st.pending:
            if not st.headers_sent:
                st.headers_sent = True
                self.transport.write(frame(HEADERS, END_HEADERS, st.sid, _RESPONSE_HEADERS))
            st.trailers = block
            st.done = True
            self._flush(st)
            return
        st.done = True
        if not st.headers_sent:  # trailers-only response
            st.headers_sent = True
            block = _RESPONSE_HEADERS + block
        out = [_FRAME.pack(len(block) << 8 | HEADERS, END_STREAM | END_HEADERS, st.sid), block]
        self._closed_local(st, out)
        self.transport.writelines(out)

    def _finish_error(self, st: Stream, code, message: str) -> None:
        if st.task is not None and st.task is not asyncio.current_task() and not st.task.done():
            st.task.cancel()
        self._finish(st, _status_block(_code(code), message))

    def _respond_http(self, st: Stream) -> None:
        """Not a gRPC request: an HTTP status and a line of text saying what this server is (flow-controlled
        DATA, then an empty DATA frame ending the stream)."""
        status = st.http_status
        block = b"\x08" + _hpack_int(len(status), 7) + status + _PLAIN_TEXT  # :status (name 8), no indexing
        st.headers_sent = True
        self.transport.write(frame(HEADERS, END_HEADERS, st.sid, block))
        st.pending = collections.deque([memoryview(_NOT_GRPC)])
        st.trailers = b""  # (empty: end with DATA, not with a trailer block)
        st.done = True
        self._flush(st)

    def _closed_local(self, st: Stream, out: list) -> None:
        """Our half is closed: forget the stream, or tell a client still sending to stop (RST NO_ERROR)."""
        st.done = True
        if not st.remote_closed:
            out.append(frame(RST_STREAM, 0, st.sid, struct.pack(">I", NO_ERROR)))
            st.remote_closed = True
            self._note_reset(st.sid)
        if self.ping_strikes or self.pings_without_data:
            self._sent_data()
        self._forget(st)

    def _note_reset(self, sid: int) -> None:
        """Remember (boundedly) a stream we ended while the client could still send: frames the client
        sent before it learnt of that are ignored rather than treated as errors."""
        reset = self.reset_sids
        reset[sid] = None
        if len(reset) > 1024:
            del reset[next(iter(reset))]

    def _reset_stream(self, sid: int, code: int) -> None:
        """A stream error: RST_STREAM with `code`; the call, if any, is cancelled."""
        if self.closed:
            return
        st = self.streams.pop(sid, None)
        if st is not None:
            self._drop(st)
        self._note_reset(sid)
        self.transport.write(frame(RST_STREAM, 0, sid, struct.pack(">I", code)))
        self._maybe_close()

    def _forget(self, st: Stream) -> None:
        streams = self.streams
        streams.pop(st.sid, None)
        self.blocked.pop(st.sid, None)
        if st.deadline is not None:
            st.deadline.cancel()
            st.deadline = None
        if st.held:
            self._give_back(st)
        if not streams:
            self.idle_since = self.loop.time()
            if self.draining:
                self._maybe_close()

    def _drop(self, st: Stream) -> None:
        """The client reset the stream or went away: cancel its work, send nothing more."""
        st.done = True
        st.remote_closed = True
        st.pending = None
        st.body = []
        self.blocked.pop(st.sid, None)
        if st.deadline is not None:
            st.deadline.cancel()
            st.deadline = None
        if st.held:
            self._give_back(st)
        if not self.streams:
            self.idle_since = self.loop.time()
        if st.task is not None and not st.task.done():
            st.task.cancel()
        if st.queue is not None:
            st.queue.put_nowait(None)

    # ---- connection lifecycle ----
    def _goaway(self, code: int, message: str = "") -> None:
        if self.closed:
            return
        self.draining = True
        self.transport.write(
            frame(GOAWAY, 0, 0, struct.pack(">II", self.last_sid, code) + message.encode()[:256])
        )

    def _maybe_close(self) -> None:
        if self.draining and not self.streams and not self.closed and self.transport is not None:
            self.transport.close()

    def shutdown(self) -> None:
        """Graceful: no new streams; the connection closes when its calls are done."""
        if not self.closed and not self.draining:
            self._goaway(NO_ERROR)
        self._maybe_close()

    def abort(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.abort()

    def tick(self, now: float) -> None:
        """The server's sweep (about once a second): handshake, header-block, idle, stall and keepalive
        deadlines."""
        if self.closed or self.transport is None:
            return
        s = self.settings
        self.resets = 0
        handshake = s.handshake_timeout_ms / 1000
        if handshake and not self.preface and now - self.opened > handshake:
            log.debug("gRPC connection: no HTTP/2 preface within %.1fs, closing", handshake)
            self.abort()
            return
        if handshake and self.headers_sid and now - self.headers_since > handshake:
            self._close_with(ENHANCE_YOUR_CALM, "header block not completed in time")
            return
        stall = s.stall_timeout_ms / 1000
        if stall and self.write_paused_since is not None and now - self.write_paused_since > stall:
            log.info("gRPC connection: the client has not read for %.0fs, closing", stall)
            self.abort()
            return
        if s.keepalive_time_ms:
            if self.ping_sent_at is not None:
                if now - self.ping_sent_at > s.keepalive_timeout_ms / 1000:
                    log.info("gRPC connection: keepalive PING not answered in time, closing")
                    self.abort()
                    return
            elif (
                now - self.last_recv >= s.keepalive_time_ms / 1000
                and (self.streams or s.keepalive_permit_without_calls)
                and (
                    not s.http2_max_pings_without_data
                    or self.pings_without_data < s.http2_max_pings_without_data
                )
            ):
                self.ping_sent_at = now
                self.pings_without_data += 1
                self.transport.write(frame(PING, 0, 0, KEEPALIVE_PING))
        idle = s.max_connection_idle_ms / 1000
        if idle and not self.streams and not self.draining and now - self.idle_since > idle:
            self._goaway(NO_ERROR, "max_idle")
            self._maybe_close()
            return
        if stall:
            for st in list(self.streams.values()):
                if st.pending and now - st.blocked_since > stall:
                    self._reset_stream(st.sid, CANCEL)  # the client stopped reading this response
                elif not st.remote_closed and (st.queue is None or st.inbuf) and now - st.last_data > stall:
                    self._reset_stream(st.sid, CANCEL)  # the request stopped coming


class H2GrpcServer:
    """Listens on host:port and serves `methods` ({b"/package.Service/Method": Method})."""

    def __init__(
        self,
        methods: dict[bytes, Method],
        authorize: Callable | None = None,
        settings: H2Settings | None = None,
    ):
        self.methods = methods
        self.authorize = authorize  # (method, metadata) -> denial message or None
        self.settings = settings or H2Settings()
        self.connections: set[_Connection] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.TimerHandle | None = None
        s = self.settings
        timers = [
            t / 1000
            for t in (
                s.keepalive_time_ms and s.keepalive_timeout_ms,
                s.handshake_timeout_ms,
                s.stall_timeout_ms,
                s.max_connection_idle_ms,
            )
            if t
        ]
        self.tick_interval = max(0.05, min([1.0, *(t / 4 for t in timers)]))

    async def start(self, host: str, port: int, ssl=None) -> None:
        """`ssl`: an ssl.SSLContext (ALPN "h2") to serve h2 over TLS instead of cleartext h2c."""
        self.loop = asyncio.get_running_loop()
        host = host.strip("[]") or None
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True, backlog=1024, ssl=ssl
        )
        self._sweeper = self.loop.call_later(self.tick_interval, self._sweep)

    def _sweep(self) -> None:
        now = self.loop.time()
        for conn in list(self.connections):
            try:
                conn.tick(now)
            except Exception:  # never let one connection stop the sweep
                log.exception("gRPC connection sweep failed")
                conn.abort()
        self._sweeper = self.loop.call_later(self.tick_interval, self._sweep)

    async def stop(self, grace: float) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.shutdown()
        deadline = self.loop.time() + grace
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()


def service_methods(
    service_descriptor,
    servicer,
    group: Callable[[str], str | None] = lambda name: None,
    request_types: dict | None = None,
) -> dict[bytes, Method]:
    """The path table for a protobuf service whose servicer has one coroutine (or async generator) per RPC."""
    from google.protobuf import message_factory

    table = {}
    for m in service_descriptor.methods:
        impl = getattr(servicer, m.name, None)
        if impl is None:
            continue
        request_type = (request_types or {}).get(m.name) or message_factory.GetMessageClass(m.input_type)
        table[f"/{service_descriptor.full_name}/{m.name}".encode()] = Method(
            request_type, impl, m.client_streaming, m.server_streaming, group(m.name)
        )
    return table
