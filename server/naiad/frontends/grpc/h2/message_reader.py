"""A large gRPC request message that comes in small DATA frames (16 KiB: h2load, grpc-go, grpc-java), read by the
kernel straight into its pooled buffer, the frames' 9-byte headers squeezed out in place, in one tight loop a read.

A frame loop would copy each read out of the event loop's buffer into a `bytes`, then each frame's payload into the
message, and spend a few microseconds of Python on each of the message's ~1,000 frames. Here the transport reads
into the message buffer at its end (asyncio.BufferedProtocol); each payload is moved down over the headers before
it while the read is still in the cache, and flow control is counted once a read. Anything but the next small DATA
frame of the same call (a PING, another stream's frame, the call's last frame, a padded one) hands what is left of
the read back to the connection's frame loop, which goes on as if it had read it itself.

While the reader has the transport the socket wakes the loop once READ_LOWAT bytes are queued (low_mark.py): at least
that much of the message is still to come, and the client may send it (the stream's window keeps more than half of
its 16 MiB open).
"""

from __future__ import annotations

import asyncio
import struct

from ...transport.receive_buffers import POOLED_MIN, ConnectionReader
from .connection import RECV_STREAM_WINDOW, H2Connection, Stream
from .framing import DATA, END_STREAM, FRAME_HEAD, PADDED, WINDOW_UPDATE, frame
from .low_mark import LowMark

_FRAME = FRAME_HEAD
READ_MAX = 1 << 20  # at most this much a read: the squeeze stays in the cache
MESSAGE_READER_MIN = 256 * 1024  # a message with less than this still to come is read frame by frame
_NOT_OURS = PADDED | END_STREAM


class MessageReader(ConnectionReader[H2Connection]):
    """The transport's protocol while a call's message arrives in small DATA frames. The message buffer holds the
    payload received so far (`[0, fill)`), then the read bytes not yet squeezed (`[fill, end)`): at most a
    frame header cut short by the read; `left` payload bytes of the current frame are still to come."""

    __slots__ = (
        "buf",
        "end",
        "fill",
        "left",
        "low",
        "size",
        "stream",
        "taken",
        "transport",
    )

    def __init__(self, conn: H2Connection, st: Stream, transport: asyncio.Transport):
        self.conn = conn
        self.transport = transport  # the connection's
        self.stream: Stream | None = st  # None once the reader handed the connection back
        msg = st.msg
        assert msg is not None
        self.buf = memoryview(msg.obj)  # the whole pooled buffer: room past the message for the last headers
        self.size = len(msg)
        self.fill = self.end = st.msg_fill
        self.left = 0
        self.taken = 0  # payload bytes read since the reader took over
        self.low = LowMark(transport, conn.loop)

    @classmethod
    def start(cls, conn: H2Connection, st: Stream, rest: memoryview) -> bool:
        """Take over the transport for `st`'s message, beginning with `rest` (the read's unfinished frame): False
        when the message has too little left to be worth it or `rest` is not the start of its next frame."""
        msg = st.msg
        transport = conn.transport
        if (
            msg is None
            or transport is None
            or st.remote_closed
            or st.queue is not None
            or (st.content_length is not None and st.content_length - st.received < len(msg) - st.msg_fill)
            or st.interleaved
            or conn.headers_sid
            or conn.closed
            or len(msg) - st.msg_fill < MESSAGE_READER_MIN
            or len(rest) >= POOLED_MIN
            or conn.streams.get(st.sid) is not st
        ):
            return False
        if len(rest) >= 9:
            lt, flags, sid = _FRAME.unpack_from(rest)
            if not cls._ours(lt, flags, sid, st.sid, len(msg) - st.msg_fill):
                return False
        reader = cls(conn, st, transport)
        reader.buf[reader.end : reader.end + len(rest)] = rest
        transport.set_protocol(reader)
        reader.low.expect(len(msg) - st.msg_fill - MESSAGE_READER_MIN)
        reader.buffer_updated(len(rest))
        return True

    @staticmethod
    def _ours(lt: int, flags: int, sid: int, our_sid: int, room: int) -> bool:
        """A frame the squeeze takes: a small unpadded DATA frame of the call, not its last, that fits the message
        (`buffer_updated` asks the same inline, once a frame)."""
        length = lt >> 8
        return (
            lt & 0xFF == DATA
            and sid & 0x7FFFFFFF == our_sid
            and not flags & _NOT_OURS
            and length < POOLED_MIN
            and length <= room
        )

    def get_buffer(self, sizehint: int) -> memoryview:
        end = self.end
        return self.buf[end : min(len(self.buf), end + READ_MAX)]

    def buffer_updated(self, nbytes: int) -> None:
        conn, st = self.conn, self.stream
        if conn.closed or st is None:
            return
        buf, size, sid = self.buf, self.size, st.sid
        self.low.got(nbytes)
        fill, end, left = self.fill, self.end + nbytes, self.left
        pos = fill  # the first byte not yet looked at; [fill, pos) is what the squeeze removed
        if left:  # the current frame's payload, already where it belongs
            k = min(left, end - pos)
            pos += k
            fill += k
            left -= k
        back = -1  # where a frame the squeeze does not take begins
        while not left:
            if size - fill < MESSAGE_READER_MIN:
                back = pos  # the rest of the message is read frame by frame
                break
            if end - pos < 9:
                break
            lt, flags, fsid = _FRAME.unpack_from(buf, pos)
            length = lt >> 8
            if (
                lt & 0xFF != DATA
                or fsid & 0x7FFFFFFF != sid
                or flags & _NOT_OURS
                or length >= POOLED_MIN
                or length > size - fill
            ):
                back = pos
                break
            pos += 9
            k = min(length, end - pos)
            buf[fill : fill + k] = buf[pos : pos + k]
            pos += k
            fill += k
            left = length - k
        got = fill - self.fill
        self.fill, self.left = fill, left
        self._account(st, got)
        if back >= 0:
            self._hand_back(st, buf[back:end].tobytes())
            return
        tail = end - pos  # a header cut short by the read (no payload: `left` is 0 then)
        if tail:
            buf[fill : fill + tail] = buf[pos:end]
        self.end = fill + tail

    def _account(self, st: Stream, n: int) -> None:
        """`n` payload bytes of `st` received: the message's fill, the stream's and the connection's flow control."""
        conn = self.conn
        conn.last_recv = conn.loop.time()
        if not n:
            return
        self.taken += n
        st.msg_fill = self.fill
        st.received += n
        st.last_data = conn.last_recv
        conn._ack_conn(n)
        st.unacked += n
        if st.unacked >= RECV_STREAM_WINDOW // 2:
            self.transport.write(frame(WINDOW_UPDATE, 0, st.sid, struct.pack(">I", st.unacked)))
            st.unacked = 0

    def _hand_back(self, st: Stream, rest: bytes) -> None:
        """The connection's frame loop reads again, from `rest` (a frame this reader does not take, and what
        followed it in the read); `st` is the call it read for. A reader lets go of its buffer first (see
        DataReader.buffer_updated)."""
        conn = self.conn
        self.low.clear()
        self.stream = None
        del self.buf
        self.transport.set_protocol(conn)
        if self.taken < MESSAGE_READER_MIN:
            st.interleaved = True  # other frames between this call's: the rest is read frame by frame
        if rest:
            conn.data_received(rest)
