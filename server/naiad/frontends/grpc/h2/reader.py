"""Reading an HTTP/2 connection: the frame loop, each frame type's checks (RFC 9113 and what h2spec tests),
SETTINGS, PING and WINDOW_UPDATE, HPACK header blocks (decoded once per distinct block), and DATA assembled into
the calls' request messages (length-prefixed, as gRPC frames them). The call layer above (grpc/server.py)
subclasses H2Reader: it supplies `_start_call`, `_remote_end` and `_too_large`, and may name its own classes of
streams and request heads (`stream_type`, `head_type`)."""

from __future__ import annotations

import abc
import struct
from typing import Any

import hpack

from ...transport.receive_buffers import POOL, POOLED_MIN, ConnectionReader
from . import hpack_blocks
from .connection import (
    DRAIN_PING,
    KEEPALIVE_PING,
    MAX_HEADER_LIST,
    RECV_MAX_FRAME,
    RECV_STREAM_WINDOW,
    H2Connection,
    H2ConnectionError,
    Stream,
)
from .framing import (
    ACK,
    COMPRESSION_ERROR,
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_HEAD,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    MAX_WINDOW,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RST_STREAM,
    S_ENABLE_PUSH,
    S_INITIAL_WINDOW_SIZE,
    S_MAX_FRAME_SIZE,
    SETTINGS,
    STREAM_CLOSED,
    WINDOW_UPDATE,
    frame,
)
from .headers import RequestHead
from .message_reader import MessageReader

# Bound here, not imported: CPython 3.11 compiles `imported_name.method(...)` without LOAD_METHOD, which
# would build a bound-method object at every call in these hot paths.
_FRAME = FRAME_HEAD
SELF_DEPENDENT = 0x100  # (not a wire flag) the HEADERS frame made its stream depend on itself
MAX_RESETS_PER_TICK = 1000  # streams a client may reset between two sweeps before GOAWAY ENHANCE_YOUR_CALM


class MessageTooLarge(Exception):
    """A request message announced (or grew to) more than the connection's `max_message` bytes."""

    def __init__(self, length: int):
        super().__init__(length)
        self.length = length


def message_length(buf, pos: int, limit: int) -> int:
    """The length a message prefix at `buf[pos:]` announces (a flag byte, then 4 bytes big-endian: gRPC's
    framing); MessageTooLarge past `limit`."""
    length = int.from_bytes(buf[pos + 1 : pos + 5], "big")
    if length > limit:
        raise MessageTooLarge(length)
    return length


class H2Reader(H2Connection, abc.ABC):
    """What the client sends, frame by frame, applied to the connection's state."""

    stream_type: type[Stream] = Stream  # what a new stream is made as
    head_type: type[RequestHead] = RequestHead  # what a request's header block is read into

    def data_received(self, data: bytes | memoryview) -> None:
        if self.closed:
            return
        self.last_recv = self.loop.time()
        try:
            if self.buf:
                buf = self.buf
                rest = None
                if self.preface and len(buf) >= 9 and len(data) >= POOLED_MIN:
                    rest = self._complete_frame(data)  # (a large read is not copied again to join it)
                if rest is not None:
                    if self.closed:
                        return
                    data = rest
                else:
                    buf += data
                    if self.preface and len(buf) >= 9:
                        length = int.from_bytes(buf[:3], "big")
                        if length > RECV_MAX_FRAME:
                            raise H2ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
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
                    raise H2ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                if data[:24] != PREFACE:
                    raise H2ConnectionError(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self.preface = True
                pos = 24
            n = len(data)
            view = memoryview(data)
            while n - pos >= 9:
                lt, flags, sid = _FRAME.unpack_from(data, pos)
                length = lt >> 8
                if length > RECV_MAX_FRAME:
                    raise H2ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
                end = pos + 9 + length
                if end > n:
                    if (
                        lt & 0xFF == DATA
                        and end - n >= POOLED_MIN
                        and self._read_data(flags, sid, length, view[pos + 9 :])
                    ):
                        return  # the rest of this DATA frame goes straight into its message (DataReader)
                    break
                self._frame(lt & 0xFF, flags, sid & 0x7FFFFFFF, view[pos + 9 : end])
                pos = end
                if self.closed:
                    return
            st = self.filling
            if st is not None:
                self.filling = None
                if MessageReader.start(self, st, view[pos:]):
                    return  # the rest of the message is read into its buffer (message_reader.py)
            if pos < n:
                self.buf += view[pos:]
                if len(self.buf) >= 9:
                    length = int.from_bytes(self.buf[:3], "big")
                    if length > RECV_MAX_FRAME:
                        raise H2ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
        except H2ConnectionError as exc:
            self._close_with(exc.code, str(exc))
        except hpack.HPACKError as exc:
            self._close_with(COMPRESSION_ERROR, f"header block: {type(exc).__name__}")

    def _complete_frame(self, data: bytes | memoryview) -> memoryview | None:
        """The frame begun in `self.buf` completed from the head of `data`, which holds the rest of it: the
        frame is handled and what follows it in `data` returned as a view (None: `data` does not finish it)."""
        buf = self.buf
        length = int.from_bytes(buf[:3], "big")
        if length > RECV_MAX_FRAME:
            raise H2ConnectionError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
        need = 9 + length - len(buf)
        if len(data) < need:
            return None
        view = memoryview(data)
        buf += view[:need]
        whole = bytes(buf)
        buf.clear()
        lt, flags, sid = _FRAME.unpack_from(whole, 0)
        self._frame(lt & 0xFF, flags, sid & 0x7FFFFFFF, memoryview(whole)[9:])
        return view[need:]

    # ---- frames ----
    def _frame(self, ftype: int, flags: int, sid: int, payload: memoryview) -> None:
        if self.headers_sid and ftype != CONTINUATION:
            raise H2ConnectionError(PROTOCOL_ERROR, "a header block was interrupted")
        if ftype == DATA:
            self._data(flags, sid, payload)
        elif ftype == HEADERS:
            self._headers(flags, sid, payload)
        elif ftype == CONTINUATION:
            if sid != self.headers_sid or not sid:
                raise H2ConnectionError(PROTOCOL_ERROR, "unexpected CONTINUATION frame")
            if len(self.headers_block) + len(payload) > MAX_HEADER_LIST:
                raise H2ConnectionError(ENHANCE_YOUR_CALM, "header block too large")
            self.headers_block += payload
            if flags & END_HEADERS:
                self._header_block_done()
        elif ftype == SETTINGS:
            if sid:
                raise H2ConnectionError(PROTOCOL_ERROR, "SETTINGS on a stream")
            if flags & ACK:
                if len(payload):
                    raise H2ConnectionError(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            else:
                self._settings(payload)
        elif ftype == WINDOW_UPDATE:
            self._window_update(sid, payload)
        elif ftype == PING:
            self._ping(flags, sid, payload)
        elif ftype == RST_STREAM:
            if not sid:
                raise H2ConnectionError(PROTOCOL_ERROR, "RST_STREAM on stream 0")
            if len(payload) != 4:
                raise H2ConnectionError(FRAME_SIZE_ERROR, "RST_STREAM payload must be 4 bytes")
            if sid > self.last_sid:
                raise H2ConnectionError(PROTOCOL_ERROR, f"RST_STREAM on idle stream {sid}")
            st = self.streams.pop(sid, None)
            if st is not None:
                self._drop(st)
                self.resets += 1
                if self.resets > MAX_RESETS_PER_TICK:
                    raise H2ConnectionError(ENHANCE_YOUR_CALM, "too many streams reset")
                self._maybe_close()
        elif ftype == PRIORITY:
            if not sid:
                raise H2ConnectionError(PROTOCOL_ERROR, "PRIORITY on stream 0")
            if len(payload) != 5:
                self._reset_stream(sid, FRAME_SIZE_ERROR)
            elif int.from_bytes(payload[:4], "big") & 0x7FFFFFFF == sid:
                self._reset_stream(sid, PROTOCOL_ERROR)
        elif ftype == GOAWAY:
            if sid:
                raise H2ConnectionError(PROTOCOL_ERROR, "GOAWAY on a stream")
            # the client is leaving: finish what runs, take nothing new. The connection stays open until the client
            # closes it (or its last call ends): closed here, a PING the client sent after its GOAWAY met a closed
            # socket and the client read a reset, not an answer (h2spec http2/7/1, RFC 9113 section 6.8)
            self.draining = True
        elif ftype == PUSH_PROMISE:
            raise H2ConnectionError(PROTOCOL_ERROR, "clients cannot push")
        # unknown frame types are ignored, as the RFC requires

    def _settings(self, payload: memoryview) -> None:
        if len(payload) % 6:
            raise H2ConnectionError(FRAME_SIZE_ERROR, "SETTINGS payload is not a multiple of 6")
        for off in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, off)
            if key == S_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise H2ConnectionError(FLOW_CONTROL_ERROR, "initial window too large")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for st in self.streams.values():
                    st.send_window += delta
                    if st.send_window > MAX_WINDOW:
                        raise H2ConnectionError(FLOW_CONTROL_ERROR, "a stream window grew past 2^31-1")
            elif key == S_MAX_FRAME_SIZE:
                if not 16384 <= value <= 16777215:
                    raise H2ConnectionError(PROTOCOL_ERROR, "invalid SETTINGS_MAX_FRAME_SIZE")
                self.peer_max_frame = value
            elif key == S_ENABLE_PUSH and value > 1:
                raise H2ConnectionError(PROTOCOL_ERROR, "invalid SETTINGS_ENABLE_PUSH")
        self.transport.write(frame(SETTINGS, ACK, 0))
        self._flush_blocked()

    def _ping(self, flags: int, sid: int, payload: memoryview) -> None:
        """Answer a PING; count the ones that come too often as grpcio's ping policy does (a strike each, and
        GOAWAY ENHANCE_YOUR_CALM "too_many_pings" beyond http2_max_ping_strikes)."""
        if sid:
            raise H2ConnectionError(PROTOCOL_ERROR, "PING on a stream")
        if len(payload) != 8:
            raise H2ConnectionError(FRAME_SIZE_ERROR, "PING payload must be 8 bytes")
        if flags & ACK:
            if payload == KEEPALIVE_PING:
                self.ping_sent_at = None
            elif payload == DRAIN_PING and self.drain_ping_at is not None:
                self.shutdown()  # the client has seen the first GOAWAY: now the real last stream id
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
                raise H2ConnectionError(ENHANCE_YOUR_CALM, "too_many_pings")
        self.last_ping_recv = now
        self.transport.write(frame(PING, ACK, 0, bytes(payload)))

    def _window_update(self, sid: int, payload: memoryview) -> None:
        if len(payload) != 4:
            raise H2ConnectionError(FRAME_SIZE_ERROR, "WINDOW_UPDATE payload must be 4 bytes")
        inc = struct.unpack_from(">I", payload)[0] & 0x7FFFFFFF
        if sid == 0:
            if not inc:
                raise H2ConnectionError(PROTOCOL_ERROR, "WINDOW_UPDATE with an increment of 0")
            self.send_window += inc
            if self.send_window > MAX_WINDOW:
                raise H2ConnectionError(FLOW_CONTROL_ERROR, "the connection window grew past 2^31-1")
            self._flush_blocked()
            return
        st = self.streams.get(sid)
        if st is None:
            if sid > self.last_sid:
                raise H2ConnectionError(PROTOCOL_ERROR, f"WINDOW_UPDATE on idle stream {sid}")
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
            raise H2ConnectionError(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        start, end = 0, len(payload)
        if flags & PADDED:
            if not end:
                raise H2ConnectionError(PROTOCOL_ERROR, "an empty PADDED HEADERS frame")
            start, end = 1, end - payload[0]
        if flags & PRIORITY_FLAG:
            if end - start >= 5 and int.from_bytes(payload[start : start + 4], "big") & 0x7FFFFFFF == sid:
                flags |= SELF_DEPENDENT
            start += 5
        if start > end:
            raise H2ConnectionError(PROTOCOL_ERROR, "HEADERS padding exceeds the frame")
        if end - start > MAX_HEADER_LIST:
            raise H2ConnectionError(ENHANCE_YOUR_CALM, "header block too large")
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
            raise H2ConnectionError(PROTOCOL_ERROR, f"HEADERS on closed stream {sid}")
        self.last_sid = sid
        if self.draining:
            self._reset_stream(sid, REFUSED_STREAM)
            return
        limit = self.settings.max_concurrent_streams
        if limit and len(self.streams) >= limit:
            self._reset_stream(sid, REFUSED_STREAM)
            self.resets += 1
            if self.resets > MAX_RESETS_PER_TICK:
                raise H2ConnectionError(ENHANCE_YOUR_CALM, "too many streams refused")
            return
        if flags & SELF_DEPENDENT or head.error:
            self._reset_stream(sid, PROTOCOL_ERROR)
            return
        st = self.stream_type(self, sid, self.peer_initial_window)
        self.streams[sid] = st
        st.metadata = head.metadata
        st.content_length = head.content_length
        end = bool(flags & END_STREAM)
        st.remote_closed = end  # an immediate error response must not reset a stream the client has ended
        self._start_call(st, head)
        if end:
            self._remote_end(st)

    def _decode_headers(self, block: bytes) -> RequestHead:
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
        headers = hpack_blocks.decode(self.decoder, block)
        head = self.head_type(headers)
        if (entries[0] if entries else None) is first and len(entries) == count and table.maxsize == size:
            if len(block) <= 1024 and sum(len(k) + len(v) for k, v in headers) <= 4096:
                if len(self.header_cache) >= 64:
                    self.header_cache.clear()
                self.header_cache[block] = head
        else:
            self.header_cache.clear()
        return head

    def _read_data(self, flags: int, sid: int, length: int, part: memoryview) -> bool:
        """A large DATA frame of a call whose message has a pooled buffer, of which `part` has come:
        the transport reads the rest of it into the buffer, in place, and hands it to `_data` then."""
        st = self.streams.get(sid)
        if (
            st is not None
            and st.msg is None
            and not st.body
            and st.method is not None
            and (st.queue is None or not st.inbuf)  # a unary call's, or a streaming call's next message
            and not st.remote_closed
            and len(part) >= 5
            and not flags & PADDED
        ):  # the call's first frame: its message's buffer is made now
            size = 5 + int.from_bytes(part[1:5], "big")
            if POOLED_MIN <= size <= self.max_message + 5 and length <= size:
                st.msg = POOL.view(size)
                st.msg_fill = 0
        if (
            st is None
            or st.msg is None
            or flags & PADDED
            or st.remote_closed
            or st.msg_fill + length > len(st.msg)
        ):
            return False
        have = len(part)
        st.msg[st.msg_fill : st.msg_fill + have] = part
        self.buf.clear()
        self.transport.set_protocol(DataReader(self, flags, st, length, have))
        return True

    def _data(self, flags: int, sid: int, payload: memoryview, in_place: bool = False) -> None:
        """A DATA frame (`in_place`: its payload already sits in its stream's message buffer)."""
        n = len(payload)
        st = self.streams.get(sid)
        if st is None or st.remote_closed:
            if sid > self.last_sid or sid == 0:
                raise H2ConnectionError(PROTOCOL_ERROR, f"DATA on idle stream {sid}")
            self._ack_conn(n)  # the bytes are dropped: the connection window is given back at once
            if st is not None:
                self._reset_stream(sid, STREAM_CLOSED)  # half-closed (remote)
            elif sid not in self.reset_sids:
                raise H2ConnectionError(STREAM_CLOSED, f"DATA on closed stream {sid}")
            return
        if flags & PADDED:
            if not n or payload[0] >= n:
                raise H2ConnectionError(PROTOCOL_ERROR, "DATA padding exceeds the frame")
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
                try:
                    self._stream_messages(st, payload, in_place)
                except MessageTooLarge as exc:
                    self._too_large(st, exc.length)
            elif st.received > self.max_message + 5:
                self._too_large(st, st.received - 5)
            elif st.msg is not None:
                fill = st.msg_fill
                if fill + len(payload) > len(st.msg):  # more than the message announced: _remote_end says so
                    st.body = [st.msg[:fill], bytes(payload)]
                    st.msg = None
                else:
                    if not in_place:
                        st.msg[fill : fill + len(payload)] = payload
                        self.filling = st
                    st.msg_fill = fill + len(payload)
            elif (
                not st.body
                and not flags & END_STREAM
                and len(payload) >= 5
                and self._pool_message(st, payload)
            ):
                pass  # (a message whole in one frame stays a view of that frame)
            else:
                st.body.append(payload)  # a view: the frame's bytes stay alive, uncopied, until parsed
        if flags & END_STREAM:
            self._remote_end(st)

    def _stream_messages(self, st: Stream, payload: memoryview, in_place: bool) -> None:
        """A streaming call's DATA: each complete message is queued as (compressed, payload). A large one is
        assembled in a pooled buffer, as a unary call's is, and queued as a view of it (its tensors are not
        copied again, nor written into fresh pages); a small one as bytes. `st.inbuf` holds the start of a small
        message (or of a prefix) that a frame cut short."""
        queue, inbuf, limit = st.queue, st.inbuf, self.max_message
        assert queue is not None and inbuf is not None
        while True:
            msg = st.msg
            if msg is not None:  # a large message being filled (`in_place`: DataReader read it in already)
                fill = st.msg_fill
                k = min(len(payload), len(msg) - fill)
                if not in_place:
                    msg[fill : fill + k] = payload[:k]
                in_place = False
                st.msg_fill = fill = fill + k
                if fill < len(msg):
                    return
                st.msg = None
                queue.put_nowait((msg[0], msg[5:].toreadonly()))
                payload = payload[k:]
            if inbuf:
                if len(inbuf) < 5:  # a prefix cut short
                    k = 5 - len(inbuf)
                    inbuf += payload[:k]
                    payload = payload[k:]
                    if len(inbuf) < 5:
                        return
                size = 5 + message_length(inbuf, 0, limit)
                if size >= POOLED_MIN:
                    st.msg = POOL.view(size)
                    st.msg[: len(inbuf)] = inbuf
                    st.msg_fill = len(inbuf)
                    inbuf.clear()
                    continue
                k = size - len(inbuf)
                inbuf += payload[:k]
                payload = payload[k:]
                if len(inbuf) < size:
                    return
                queue.put_nowait((inbuf[0], bytes(inbuf[5:])))
                inbuf.clear()
                continue
            if len(payload) < 5:
                inbuf += payload
                return
            size = 5 + message_length(payload, 0, limit)
            if size >= POOLED_MIN:
                st.msg = POOL.view(size)
                st.msg_fill = 0
            elif size <= len(payload):
                queue.put_nowait((payload[0], bytes(payload[5:size])))
                payload = payload[size:]
            else:
                inbuf += payload
                return

    def _pool_message(self, st: Stream, payload: memoryview) -> bool:
        """The first DATA of a unary call announces a large message: it is assembled in a pooled buffer
        (transport/receive_buffers.py), so its tensors are views of memory that is reused, not of fresh
        copies."""
        size = 5 + int.from_bytes(payload[1:5], "big")
        if size < POOLED_MIN or size > self.max_message + 5 or len(payload) > size:
            return False
        st.msg = POOL.view(size)
        st.msg[: len(payload)] = payload
        st.msg_fill = len(payload)
        self.filling = st
        return True

    # ---- supplied by the call layer (grpc/server.py's _Connection) ----
    @abc.abstractmethod
    def _start_call(self, st: Stream, head: Any) -> None:
        """A new stream's request headers arrived (`head`: a `head_type`): find its method and start the
        call, or set the stream's `http_status` if no call serves such a request."""

    @abc.abstractmethod
    def _remote_end(self, st: Stream) -> None:
        """The client ended its half of the stream: the request is complete."""

    @abc.abstractmethod
    def _too_large(self, st: Stream, length: int) -> None:
        """A request message of `length` bytes is past `max_message`: end the call with an error."""


class DataReader(ConnectionReader[H2Reader]):
    """The transport's protocol while the rest of a large DATA frame arrives: the kernel writes it into the
    call's message buffer, then the connection reads frames again."""

    __slots__ = ("fill", "flags", "size", "start", "stream", "view")

    def __init__(self, conn: H2Reader, flags: int, st: Stream, length: int, have: int):
        self.conn = conn
        self.flags = flags
        self.stream = st
        self.start = st.msg_fill
        self.size = length
        self.fill = have
        msg = st.msg
        assert msg is not None  # (_read_data made it)
        self.view = msg[self.start : self.start + length]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.fill :]  # never past this frame: what follows is the next frame's

    def buffer_updated(self, nbytes: int) -> None:
        self.fill += nbytes
        conn = self.conn
        conn.last_recv = conn.loop.time()
        if self.fill < self.size:
            return
        # The frame is in: this reader lets go of the message before handing back. uvloop keeps the bound
        # get_buffer/buffer_updated of a transport's last BufferedProtocol until the next one is set or the
        # connection closes, so a reader still holding its view kept the connection's last large message
        # (and its one-off receive buffer: 272 MiB for a 256 MiB message) alive after the call.
        view, sid = self.view, self.stream.sid
        del self.view, self.stream
        conn.transport.set_protocol(conn)
        if conn.closed:
            return
        try:
            conn._data(self.flags, sid, view, in_place=True)
        except H2ConnectionError as exc:
            conn._close_with(exc.code, str(exc))
