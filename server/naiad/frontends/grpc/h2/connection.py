"""One HTTP/2 server connection's state and its sending side (asyncio.Protocol): streams, flow control out and
in, closing streams (RST_STREAM) and the connection (GOAWAY), keepalive PINGs and the handshake, idle and stall
deadlines. Reading frames is reader.py's; the calls are the layer above's (gRPC's: grpc/server.py)."""

from __future__ import annotations

import asyncio
import collections
import logging
import struct
from dataclasses import dataclass
from typing import Any

import hpack

from ...transport.heap_trim import TRIMMER
from .framing import (
    CANCEL,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FRAME_HEAD,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    NO_ERROR,
    PING,
    RST_STREAM,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_CONCURRENT_STREAMS,
    S_MAX_FRAME_SIZE,
    S_MAX_HEADER_LIST_SIZE,
    SETTINGS,
    WINDOW_UPDATE,
    frame,
)
from .headers import RequestHead

log = logging.getLogger("naiad.grpc")

# Bound here, not imported: CPython 3.11 compiles `imported_name.method(...)` without LOAD_METHOD, which
# would build a bound-method object at every call in these hot paths.
_FRAME = FRAME_HEAD

RECV_STREAM_WINDOW = 1 << 24  # what each stream may send us before we acknowledge
RECV_CONN_WINDOW = 1 << 30  # the same for the whole connection
RECV_MAX_FRAME = 1 << 20  # fewer frames for large tensors
MAX_HEADER_LIST = 64 * 1024  # decoded header list, and the encoded block (HEADERS + CONTINUATION) as well
WRITE_HIGH_WATER = 4 << 20  # the transport's write buffer above which reading pauses
KEEPALIVE_PING = b"naiad-ka"  # the opaque data of our keepalive PINGs
DRAIN_PING = b"naiad-dr"  # the PING after the first GOAWAY of a graceful drain
MAX_STREAM_ID = 2**31 - 1
MAX_MESSAGE = 2**31 - 1  # a request message's size limit unless set lower (gRPC's: a signed 32-bit length)
DRAIN_ACK_TIMEOUT = 1.0  # a client that does not answer the drain PING gets the final GOAWAY after this


class H2ConnectionError(Exception):
    """A connection error (RFC 9113 section 5.4.1): GOAWAY with `code`, then the connection closes."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class H2Settings:
    """Limits and timers of the server. Times in milliseconds, named as grpcio's channel arguments; the
    keepalive ones default to Triton's flag defaults. 0 turns a timer (or a count limit) off. The call layer's
    own settings are a subclass's (grpc/server.py's GrpcSettings)."""

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
    """One stream: a call's request coming in and its response going out. The call layer above keeps what
    it serves the stream with here too (`method`, `encoding`, `http_status`, `task`, `queue`, `deadline`), and
    its subclass (`H2Reader.stream_type`) adds what its handlers call on it."""

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
        "interleaved",
        "last_data",
        "metadata",
        "method",
        "msg",
        "msg_fill",
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

    def __init__(self, conn: H2Connection, sid: int, send_window: int):
        self.conn = conn
        self.sid = sid
        self.method: Any = None  # what serves the call (gRPC's Method); None: no call reads the stream's DATA
        self.metadata: tuple = ()
        self.encoding = b""  # the coding of the request's compressed messages (grpc-encoding)
        self.body: list = []  # unary request: DATA payloads until END_STREAM
        self.msg: memoryview | None = None  # a large message being received, in a pooled buffer
        self.msg_fill = 0
        self.interleaved = False  # its message's frames came between other frames (message_reader.py)
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
        self.deadline: asyncio.TimerHandle | None = None  # the call's deadline (grpc-timeout)
        self.content_length: int | None = None
        self.http_status = b""  # no call serves it: answered with this status once the client's half ends
        self.last_data = conn.last_recv
        self.blocked_since = 0.0


class H2Connection(asyncio.Protocol):
    """The connection's state and what sends on it. `server` is what accepted it (grpc/server.py's
    H2GrpcServer): its settings, loop and set of connections."""

    # from connection_made on, which comes before any other callback; the server reaches a connection only after
    # it too (its `connections`, which connection_made joins)
    transport: asyncio.Transport

    def __init__(self, server: Any):
        self.server = server
        self.settings = server.settings
        self.max_message = server.settings.max_message
        self.loop = server.loop
        self.buf = bytearray()
        # a call whose pooled message this read's DATA went into (message_reader.py may read the rest)
        self.filling: Stream | None = None
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
        self.header_cache: dict[bytes, RequestHead] = {}
        self.reset_sids: dict[int, None] = {}  # streams we ended while the client could still send on them
        self.send_window = 65535
        self.peer_initial_window = 65535
        self.peer_max_frame = 16384
        self.recv_unacked = 0
        self.blocked: dict[int, Stream] = {}
        self.draining = False
        self.drain_ping_at: float | None = None  # drain(): the first GOAWAY and its PING went out then
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

    def _close_with(self, code: int, message: str) -> None:
        self._goaway(code, message)
        self.buf = bytearray()
        self.headers_block = bytearray()
        self.transport.close()

    def _sent_data(self) -> None:
        """We sent headers or data: the ping policies start over (grpcio's ResetPingStrikes)."""
        self.ping_strikes = 0
        self.last_ping_recv = float("-inf")
        self.pings_without_data = 0

    def _ack_conn(self, n: int) -> None:
        self.recv_unacked += n
        if self.recv_unacked >= RECV_CONN_WINDOW // 2:
            self.transport.write(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self.recv_unacked)))
            self.recv_unacked = 0

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

    # ---- sending ----
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
            chunk = pending[0]
            full = min(len(chunk), st.send_window, self.send_window) // allowed
            if full > 1:  # a large buffer (a tensor): its full-size frames share one header
                header = _FRAME.pack(allowed << 8 | DATA, 0, st.sid)
                end = full * allowed
                for start in range(0, end, allowed):
                    out.append(header)
                    out.append(chunk[start : start + allowed])
                if end < len(chunk):
                    pending[0] = chunk[end:]
                else:
                    pending.popleft()
                st.send_window -= end
                self.send_window -= end
                if self.ping_strikes or self.pings_without_data:
                    self._sent_data()
                continue
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
            if self.ping_strikes or self.pings_without_data:
                self._sent_data()  # (grpcio resets them on every DATA it writes, not only a message's first)
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
        self._release_request(st)
        if not streams:
            self.idle_since = self.loop.time()
            if self.draining:
                # after the caller has written the stream's last frames (_finish writes them after this)
                self.loop.call_soon(self._maybe_close)

    def _release_request(self, st: Stream) -> None:
        """The stream is over: drop what it still holds of the request (DATA not yet parsed, messages the
        call never took), so that nothing large outlives it even where a cancelled call's Task keeps the
        stream in a reference cycle; after a large request, give the freed memory back to the system."""
        st.body = []
        st.inbuf = None
        st.msg = None
        queue = st.queue
        if queue is not None:
            while not queue.empty():
                queue.get_nowait()
            queue.put_nowait(None)  # (the call, if it still reads, sees the end of the requests)
        TRIMMER.released(self.loop, st.received)

    def _drop(self, st: Stream) -> None:
        """The client reset the stream or went away: cancel its work, send nothing more."""
        st.done = True
        st.remote_closed = True
        st.pending = None
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
        self._release_request(st)

    # ---- connection lifecycle ----
    def _goaway(self, code: int, message: str = "") -> None:
        if self.closed:
            return
        self.draining = True
        self.transport.write(
            frame(GOAWAY, 0, 0, struct.pack(">II", self.last_sid, code) + message.encode()[:256])
        )

    def _maybe_close(self) -> None:
        if self.draining and not self.streams and not self.closed:
            self.transport.close()

    def shutdown(self) -> None:
        """Graceful: no new streams; the connection closes when its calls are done."""
        if not self.closed and not self.draining:
            self._goaway(NO_ERROR)
        self._maybe_close()

    def drain(self) -> None:
        """Graceful two-step GOAWAY (grpc-go's GracefulStop, Go's http2 server): GOAWAY NO_ERROR with the last
        stream id 2^31-1 and a PING; calls the client sends meanwhile are still served. Once the PING's ACK
        shows the client has seen the first GOAWAY (or after DRAIN_ACK_TIMEOUT), shutdown() sends the real last
        stream id: no stream the client started can then be lost in flight, and its next call goes elsewhere."""
        if self.closed or self.draining or self.drain_ping_at is not None:
            return
        self.drain_ping_at = self.loop.time()
        self.transport.write(
            frame(GOAWAY, 0, 0, struct.pack(">II", MAX_STREAM_ID, NO_ERROR)) + frame(PING, 0, 0, DRAIN_PING)
        )

    def abort(self) -> None:
        if not self.closed:
            self.transport.abort()

    def tick(self, now: float) -> None:
        """The server's sweep (about once a second): handshake, header-block, idle, stall and keepalive
        deadlines."""
        if self.closed:
            return
        s = self.settings
        self.resets = 0
        if (
            self.drain_ping_at is not None
            and not self.draining
            and now - self.drain_ping_at > DRAIN_ACK_TIMEOUT
        ):
            self.shutdown()  # the client did not answer the drain PING: the second GOAWAY all the same
            if self.closed or self.transport.is_closing():
                return
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
                elif (
                    not st.remote_closed
                    and (st.queue is None or st.inbuf or st.msg is not None)
                    and now - st.last_data > stall
                ):
                    self._reset_stream(st.sid, CANCEL)  # the request stopped coming
