"""gRPC over cleartext HTTP/2 (h2c), written for the inference hot path.

Why not grpc.aio: on one core, a grpc.aio server that only echoes its request answers ~2,100-2,400 unary
calls/s (the `h2` library, pure Python, the same), a fraction of a real Triton's C++ frontend. Most of that
time is the hand-off between grpcio's completion-queue thread and the event loop, not HTTP/2 itself. This
module speaks the subset of HTTP/2 that gRPC clients use (RFC 9113 framing, flow control, PING, SETTINGS,
GOAWAY, RST_STREAM) directly on an asyncio transport, with the `hpack` library for header compression, and
calls the same servicer coroutines as the grpc.aio server (`naiad serve --grpc-implementation grpcio` still
selects that one).

What is served: unary-unary, stream-stream and unary-stream methods given as a path table; gRPC message
compression gzip/deflate on requests (responses are sent uncompressed, which every client accepts);
trailers-only error responses with percent-encoded `grpc-message`. Not served: TLS (h2c only), server push,
`grpc-timeout` deadlines (the call runs to completion; a client that gives up resets the stream, which
cancels it).
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

# settings identifiers
S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 1, 2, 3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 4, 5, 6

MAX_WINDOW = 2**31 - 1
RECV_STREAM_WINDOW = 1 << 24  # what each stream may send us before we acknowledge
RECV_CONN_WINDOW = 1 << 30  # the same for the whole connection
RECV_MAX_FRAME = 1 << 20  # fewer frames for large tensors
MAX_HEADER_LIST = 1 << 20
MAX_MESSAGE = 2**31 - 1

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
    if message:
        block += _literal(b"grpc-message", urllib.parse.quote(message, safe=_GRPC_MESSAGE_SAFE).encode())
    return block


_OK_TRAILERS = _status_block(0, "")


def _code(status) -> int:
    """grpc.StatusCode or int -> the wire number."""
    return status.value[0] if isinstance(status, grpc.StatusCode) else int(status)


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


class Stream:
    """One call. Also the `context` handed to servicer methods (the subset of grpc.aio's they use)."""

    __slots__ = (
        "body",
        "conn",
        "done",
        "encoding",
        "headers_sent",
        "inbuf",
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
        self.metadata: list[tuple[bytes, bytes]] = []
        self.encoding = b""
        self.body: list = []  # unary request: DATA payloads until END_STREAM
        self.received = 0
        self.unacked = 0
        self.send_window = send_window
        self.pending: collections.deque | None = None  # DATA not yet allowed by flow control
        self.trailers: bytes | None = None
        self.headers_sent = False
        self.remote_closed = False
        self.done = False
        self.task: asyncio.Task | None = None
        self.queue: asyncio.Queue | None = None  # client streaming: complete messages, then None
        self.inbuf: bytearray | None = None

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
        return None


def _decompress(encoding: bytes, payload) -> bytes:
    if encoding == b"gzip":
        return zlib.decompress(payload, wbits=31)
    if encoding == b"deflate":
        return zlib.decompress(payload)
    raise Abort(grpc.StatusCode.UNIMPLEMENTED, f"unsupported grpc-encoding '{encoding.decode('latin-1')}'")


def _split_messages(buf: bytearray, encoding: bytes) -> list:
    """Complete length-prefixed messages at the front of `buf` (removed from it)."""
    out = []
    pos = 0
    while len(buf) - pos >= 5:
        compressed, length = _MSG_PREFIX.unpack_from(buf, pos)
        if len(buf) - pos - 5 < length:
            break
        payload = bytes(buf[pos + 5 : pos + 5 + length])
        out.append(_decompress(encoding, payload) if compressed else payload)
        pos += 5 + length
    if pos:
        del buf[:pos]
    return out


class _Connection(asyncio.Protocol):
    def __init__(self, server: H2GrpcServer):
        self.server = server
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
        self.header_cache: dict[bytes, list] = {}
        self.send_window = 65535
        self.peer_initial_window = 65535
        self.peer_max_frame = 16384
        self.recv_unacked = 0
        self.blocked: dict[int, Stream] = {}
        self.draining = False
        self.closed = False

    # ---- asyncio.Protocol ----
    def connection_made(self, transport):
        self.transport = transport
        self.server.connections.add(self)
        settings = struct.pack(
            ">HIHIHI",
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

    def data_received(self, data: bytes):
        if self.closed:
            return
        if self.buf:
            buf = self.buf
            buf += data
            if self.preface and len(buf) >= 9 and len(buf) < 9 + (int.from_bytes(buf[:3], "big")):
                return  # the frame is still incomplete: wait without copying
            data = bytes(buf)
            buf.clear()
        try:
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
        except _ConnectionError as exc:
            self._goaway(exc.code, str(exc))
            self.transport.close()
        except hpack.HPACKError as exc:
            self._goaway(COMPRESSION_ERROR, f"header block: {exc}")
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
            self.headers_block += payload
            if flags & END_HEADERS:
                self._header_block_done()
        elif ftype == SETTINGS:
            if sid:
                raise _ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
            if not flags & ACK:
                self._settings(payload)
        elif ftype == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif ftype == PING:
            if len(payload) != 8:
                raise _ConnectionError(FRAME_SIZE_ERROR, "PING payload must be 8 bytes")
            if not flags & ACK:
                self.transport.write(frame(PING, ACK, 0, bytes(payload)))
        elif ftype == RST_STREAM:
            st = self.streams.pop(sid, None)
            if st is not None:
                self._drop(st)
        elif ftype == GOAWAY:
            self.draining = True  # the client is leaving: finish what runs, take nothing new
            self._maybe_close()
        elif ftype == PUSH_PROMISE:
            raise _ConnectionError(PROTOCOL_ERROR, "clients cannot push")
        # PRIORITY and unknown frame types are ignored, as the RFC requires

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
            elif key == S_MAX_FRAME_SIZE:
                if not 16384 <= value <= 16777215:
                    raise _ConnectionError(PROTOCOL_ERROR, "invalid SETTINGS_MAX_FRAME_SIZE")
                self.peer_max_frame = value
        self.transport.write(frame(SETTINGS, ACK, 0))
        self._flush_blocked()

    def _window_update(self, sid: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise _ConnectionError(FRAME_SIZE_ERROR, "WINDOW_UPDATE payload must be 4 bytes")
        inc = struct.unpack_from(">I", payload)[0] & 0x7FFFFFFF
        if sid == 0:
            self.send_window += inc
            self._flush_blocked()
            return
        st = self.streams.get(sid)
        if st is not None:
            st.send_window += inc
            if st.pending:
                self._flush(st)

    def _headers(self, flags: int, sid: int, payload: memoryview) -> None:
        if sid == 0 or not sid & 1:
            raise _ConnectionError(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        start, end = 0, len(payload)
        if flags & PADDED:
            pad = payload[0]
            start, end = 1, end - pad
        if flags & PRIORITY_FLAG:
            start += 5
        if start > end:
            raise _ConnectionError(PROTOCOL_ERROR, "HEADERS padding exceeds the frame")
        self.headers_sid = sid
        self.headers_flags = flags
        self.headers_block[:] = payload[start:end]
        if flags & END_HEADERS:
            self._header_block_done()

    def _header_block_done(self) -> None:
        sid, flags = self.headers_sid, self.headers_flags
        self.headers_sid = 0
        headers = self._decode_headers(bytes(self.headers_block))
        st = self.streams.get(sid)
        if st is not None:  # trailers from the client end its half of the stream
            if flags & END_STREAM:
                self._remote_end(st)
            return
        if sid <= self.last_sid:
            return  # a stream that is already over (reset or finished): ignore
        self.last_sid = sid
        st = Stream(self, sid, self.peer_initial_window)
        if self.draining:
            self.transport.write(frame(RST_STREAM, 0, sid, struct.pack(">I", REFUSED_STREAM)))
            return
        self.streams[sid] = st
        path = method = ctype = b""
        meta = st.metadata
        for name, value in headers:
            if name[:1] == b":":
                if name == b":path":
                    path = value
                elif name == b":method":
                    method = value
            elif name == b"content-type":
                ctype = value
            elif name == b"grpc-encoding":
                st.encoding = value
            elif name != b"te":
                meta.append((name, value))
        end = bool(flags & END_STREAM)
        st.remote_closed = end  # an immediate error response must not reset a stream the client has ended
        if method != b"POST" or not ctype.startswith(b"application/grpc"):
            self._respond_http(st, b"415" if method == b"POST" else b"405")
        else:
            self._start_call(st, path)
        if end:
            self._remote_end(st)

    def _decode_headers(self, block: bytes) -> list:
        """HPACK-decode a header block. Clients repeat the same block of indexed fields call after call; while
        decoding it leaves the dynamic table as it was, the result is reused (the cache empties whenever a
        block changes the table, since indexed fields then may mean other headers)."""
        headers = self.header_cache.get(block)
        if headers is not None:
            return headers
        table = self.decoder.header_table
        entries = table.dynamic_entries
        first, count, size = entries[0] if entries else None, len(entries), table.maxsize
        headers = self.decoder.decode(block, raw=True)
        if (entries[0] if entries else None) is first and len(entries) == count and table.maxsize == size:
            if len(self.header_cache) >= 64:
                self.header_cache.clear()
            self.header_cache[block] = headers
        else:
            self.header_cache.clear()
        return headers

    def _data(self, flags: int, sid: int, payload: memoryview) -> None:
        n = len(payload)
        self.recv_unacked += n
        if self.recv_unacked >= RECV_CONN_WINDOW // 2:
            self.transport.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.recv_unacked)))
            self.recv_unacked = 0
        st = self.streams.get(sid)
        if st is None or st.remote_closed:
            if sid > self.last_sid or sid == 0:
                raise _ConnectionError(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            return  # a stream we already ended: the bytes are acknowledged above and dropped
        if flags & PADDED:
            pad = payload[0]
            payload = payload[1 : n - pad]
        st.unacked += n
        if st.unacked >= RECV_STREAM_WINDOW // 2 and not flags & END_STREAM:
            self.transport.write(frame(WINDOW_UPDATE, 0, sid, struct.pack(">I", st.unacked)))
            st.unacked = 0
        if st.method is not None:
            st.received += len(payload)
            if st.received > MAX_MESSAGE + 5:
                self._finish_error(st, grpc.StatusCode.RESOURCE_EXHAUSTED, "request message too large")
            elif st.queue is not None:
                st.inbuf += payload
                try:
                    for msg in _split_messages(st.inbuf, st.encoding):
                        st.queue.put_nowait(msg)
                except (Abort, zlib.error) as exc:
                    self._finish_error(st, getattr(exc, "code", grpc.StatusCode.INTERNAL), str(exc))
            else:
                st.body.append(payload)  # a view: the frame's bytes stay alive, uncopied, until parsed
        if flags & END_STREAM:
            self._remote_end(st)

    # ---- calls ----
    def _start_call(self, st: Stream, path: bytes) -> None:
        server = self.server
        method = server.methods.get(path)
        if method is None:
            self._finish_error(
                st, grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {path.decode('latin-1')}"
            )
            return
        if server.authorize is not None:
            denial = server.authorize(method, st.metadata)
            if denial:
                self._finish_error(st, grpc.StatusCode.PERMISSION_DENIED, denial)
                return
        st.method = method
        if method.client_streaming:
            st.queue = asyncio.Queue()
            st.inbuf = bytearray()
            st.task = self.loop.create_task(self._run(st, self._request_iterator(st)))

    def _remote_end(self, st: Stream) -> None:
        st.remote_closed = True
        if st.queue is not None:
            if st.inbuf:
                self._finish_error(
                    st, grpc.StatusCode.INTERNAL, "incomplete message at the end of the stream"
                )
            st.queue.put_nowait(None)
        elif st.method is not None and st.task is None and not st.done:
            body = st.body[0] if len(st.body) == 1 else b"".join(st.body)
            st.body = []
            try:
                if len(body) < 5:
                    raise Abort(grpc.StatusCode.INTERNAL, "the request has no message")
                compressed, length = _MSG_PREFIX.unpack_from(body)
                if length != len(body) - 5:
                    raise Abort(
                        grpc.StatusCode.INTERNAL,
                        f"expected one request message of {length} bytes, got {len(body) - 5} bytes",
                    )
                payload = body[5:]
                if compressed:
                    payload = _decompress(st.encoding, payload)
                request = st.method.request_type.FromString(payload)
            except Abort as exc:
                self._finish_error(st, exc.code, exc.details)
                return
            except Exception as exc:
                self._finish_error(st, grpc.StatusCode.INTERNAL, f"failed to parse the request: {exc}")
                return
            st.task = self.loop.create_task(self._run(st, request))
        if st.done:
            self._forget(st)

    async def _request_iterator(self, st: Stream):
        request_type = st.method.request_type
        while True:
            msg = await st.queue.get()
            if msg is None:
                return
            try:
                yield request_type.FromString(msg)
            except Exception as exc:
                raise Abort(grpc.StatusCode.INTERNAL, f"failed to parse a request message: {exc}") from None

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
                self._reply(st, response.SerializeToString())
        except Abort as exc:
            self._finish_error(st, exc.code, exc.details)
        except asyncio.CancelledError:
            if not st.done:
                self._finish_error(st, grpc.StatusCode.CANCELLED, "the call was cancelled")
            raise
        except Exception as exc:
            log.exception("gRPC call %s failed", st.sid)
            self._finish_error(st, grpc.StatusCode.UNKNOWN, f"Unexpected error: {exc}")

    # ---- sending ----
    def _reply(self, st: Stream, msg: bytes) -> None:
        """A unary call's whole response (headers, message, trailers) in one write when the windows allow."""
        total = len(msg) + 5
        if (
            st.pending
            or st.headers_sent
            or st.done
            or self.closed
            or total > self.peer_max_frame
            or total > st.send_window
            or total > self.send_window
        ):
            self._send_message(st, msg)
            self._finish(st, _OK_TRAILERS)
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

    def _send_message(self, st: Stream, msg: bytes) -> None:
        if self.closed or st.done:
            return
        out = []
        if not st.headers_sent:
            st.headers_sent = True
            out.append(frame(HEADERS, END_HEADERS, st.sid, _RESPONSE_HEADERS))
        n = len(msg)
        prefix = _MSG_PREFIX.pack(0, n)
        total = n + 5
        if (
            not st.pending
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
            return
        if out:
            self.transport.writelines(out)
        if st.pending is None:
            st.pending = collections.deque()
        st.pending.append(memoryview(prefix))
        st.pending.append(memoryview(msg))
        self._flush(st)

    def _flush(self, st: Stream) -> None:
        """Send queued DATA as far as both windows allow, then the trailers once nothing is queued."""
        out = []
        pending = st.pending
        while pending:
            allowed = min(st.send_window, self.send_window, self.peer_max_frame)
            if allowed <= 0:
                break
            chunk = pending[0]
            if len(chunk) > allowed:
                pending[0] = chunk[allowed:]
                chunk = chunk[:allowed]
            else:
                pending.popleft()
            st.send_window -= len(chunk)
            self.send_window -= len(chunk)
            out.append(_FRAME.pack(len(chunk) << 8 | DATA, 0, st.sid))
            out.append(chunk)
        if not pending and st.trailers is not None:
            out.append(_FRAME.pack(len(st.trailers) << 8 | HEADERS, END_STREAM | END_HEADERS, st.sid))
            out.append(st.trailers)
            st.trailers = None
            self.blocked.pop(st.sid, None)
            self._closed_local(st, out)
        elif pending:
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

    def _respond_http(self, st: Stream, status: bytes) -> None:
        st.done = True
        block = b"\x08" + _hpack_int(len(status), 7) + status  # :status, literal without indexing (name 8)
        out = [frame(HEADERS, END_STREAM | END_HEADERS, st.sid, block)]
        self._closed_local(st, out)
        self.transport.writelines(out)

    def _closed_local(self, st: Stream, out: list) -> None:
        """Our half is closed: forget the stream, or tell a client still sending to stop (RST NO_ERROR)."""
        st.done = True
        if not st.remote_closed:
            out.append(frame(RST_STREAM, 0, st.sid, struct.pack(">I", NO_ERROR)))
            st.remote_closed = True
        self._forget(st)

    def _forget(self, st: Stream) -> None:
        self.streams.pop(st.sid, None)
        self.blocked.pop(st.sid, None)
        self._maybe_close()

    def _drop(self, st: Stream) -> None:
        """The client reset the stream or went away: cancel its work, send nothing more."""
        st.done = True
        st.remote_closed = True
        self.blocked.pop(st.sid, None)
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


class H2GrpcServer:
    """Listens on host:port and serves `methods` ({b"/package.Service/Method": Method})."""

    def __init__(self, methods: dict[bytes, Method], authorize: Callable | None = None):
        self.methods = methods
        self.authorize = authorize  # (method, metadata) -> denial message or None
        self.connections: set[_Connection] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int, ssl=None) -> None:
        """`ssl`: an ssl.SSLContext (ALPN "h2") to serve h2 over TLS instead of cleartext h2c."""
        self.loop = asyncio.get_running_loop()
        host = host.strip("[]") or None
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True, backlog=1024, ssl=ssl
        )

    async def stop(self, grace: float) -> None:
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
