"""gRPC over HTTP/2 (cleartext h2c, or h2 over TLS), written for the inference hot path.

Why not grpc.aio: on one core, a grpc.aio server that only echoes its request answers ~2,100-2,400 unary
calls/s (the `h2` library, pure Python, the same), a fraction of a real Triton's C++ frontend. Most of that
time is the hand-off between grpcio's completion-queue thread and the event loop, not HTTP/2 itself. These
modules speak the subset of HTTP/2 that gRPC clients use (RFC 9113 framing, flow control, PING, SETTINGS,
GOAWAY, RST_STREAM) directly on an asyncio transport, with the `hpack` library for header compression, and
calls the same servicer coroutines as the grpc.aio server (`naiad serve --grpc-implementation grpcio` still
selects that one).

What is served: unary-unary, stream-stream and unary-stream methods given as a path table; gRPC message
compression gzip/deflate on requests (responses are sent uncompressed, which every client accepts), inflated
in bounded steps off the event loop and refused past the message size or the decompression ratio;
trailers-only error responses with percent-encoded `grpc-message`; `grpc-timeout` deadlines
(DEADLINE_EXCEEDED, the call's work cancelled); TLS with ALPN "h2" when started with an SSL context. A unary
call starts in the frame handler that completes its request (transport/eager.py). Not served: server push.

Limits (GrpcSettings, from `naiad serve`'s --grpc-* flags): SETTINGS_MAX_CONCURRENT_STREAMS, a per-message
size limit, header blocks capped at MAX_HEADER_LIST, flow-control window granted to a streaming call as it
takes its messages, reading paused while the client does not read our writes, keepalive PINGs and grpcio's
ping-abuse policy (GOAWAY ENHANCE_YOUR_CALM "too_many_pings"), and handshake, idle and stall deadlines. The
RFC 9113 checks h2spec makes are applied (docs/security.md).

The layers: h2/framing.py (the wire), h2/connection.py (a connection's state, sending, flow control,
keepalive), h2/reader.py (frames in), messages.py (gRPC messages, status), compression.py (inflating
compressed messages) and this module: the calls (dispatch, request messages, responses and trailers) and the
listening server.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from ..transport import eager
from ..transport.busy_poll import BusyPoll
from ..transport.heap_trim import TRIMMER
from .compression import DEFAULT_MAX_RATIO, decompress
from .h2.connection import H2Settings, Stream
from .h2.framing import DATA, END_HEADERS, END_STREAM, FRAME_HEAD, HEADERS, PROTOCOL_ERROR, frame, hpack_int
from .h2.reader import H2Reader
from .messages import (
    MSG_PREFIX,
    OK_TRAILERS,
    RESPONSE_HEADERS,
    Abort,
    GrpcRequestHead,
    Method,
    WireMessage,
    status_block,
    status_code,
)

log = logging.getLogger("naiad.grpc")

# Bound here, not imported: CPython 3.11 compiles `imported_name.method(...)` without LOAD_METHOD, which
# would build a bound-method object at every call in these hot paths.
_FRAME = FRAME_HEAD
_MSG_PREFIX = MSG_PREFIX

_PLAIN_TEXT = hpack_int(31, 4) + hpack_int(10, 7) + b"text/plain"
_NOT_GRPC = b"this is a gRPC server: requests are POST with content-type application/grpc\n"


@dataclass(frozen=True)
class GrpcSettings(H2Settings):
    """The HTTP/2 server's limits and timers (H2Settings) and the gRPC layer's own."""

    max_decompression_ratio: int = (
        DEFAULT_MAX_RATIO  # a compressed message may inflate to this many times its size
    )


class Call(Stream):
    """A gRPC call's stream, also the `context` handed to servicer methods (the subset of grpc.aio's they
    use)."""

    __slots__ = ()

    # -- the grpc.aio ServicerContext subset --
    async def abort(self, code, details: str = "", trailing_metadata=()):
        raise Abort(code, details, trailing_metadata)

    def invocation_metadata(self):
        return tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in self.metadata)

    def peer(self) -> str:
        peer = self.conn.transport.get_extra_info("peername")
        return f"ipv4:{peer[0]}:{peer[1]}" if peer else ""

    def cancelled(self) -> bool:
        return self.done

    def time_remaining(self):
        if self.deadline is None:
            return None
        return max(0.0, self.deadline.when() - self.conn.loop.time())


class _Connection(H2Reader):
    """A connection serving gRPC calls: each stream's request is dispatched to its Method, the response and
    trailers sent back."""

    stream_type = Call
    head_type = GrpcRequestHead

    def _start_call(self, st: Stream, head: GrpcRequestHead) -> None:
        st.encoding = head.encoding
        if head.method != b"POST" or not head.ctype.startswith(b"application/grpc"):
            st.http_status = b"415" if head.method == b"POST" else b"405"
            return
        server = self.server
        method = server.methods.get(head.path)
        if method is None:
            self._finish_error(st, grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
            return
        if server.authorize is not None:
            denial = server.authorize(method, st.metadata)
            if denial:
                self._finish_error(st, grpc.StatusCode.PERMISSION_DENIED, denial)
                return
        st.method = method
        if head.timeout is not None:
            st.deadline = self.loop.call_later(head.timeout, self._deadline_exceeded, st)
        if method.client_streaming:
            st.queue = asyncio.Queue()
            st.inbuf = bytearray()
            st.task = self.loop.create_task(self._run(st, self._request_iterator(st)))

    def _too_large(self, st: Stream, length: int) -> None:
        self._finish_error(
            st,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"Received message larger than max ({length} vs. {self.max_message})",
        )

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
            if st.inbuf or st.msg is not None:
                st.msg = None
                self._finish_error(
                    st, grpc.StatusCode.INTERNAL, "incomplete message at the end of the stream"
                )
            st.queue.put_nowait(None)
        elif st.method is not None and st.task is None and not st.done:
            # one frame: a view of it; more: joined once, and the message is a view of that (no second copy)
            if st.msg is not None:  # a large message, assembled in a pooled buffer: parsed in place
                body = st.msg[: st.msg_fill].toreadonly()
                st.msg = None
            else:
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
                else:  # started here; a Task only if the call has to wait (transport/eager.py)
                    st.task = self.server.starter.start(self.loop, self._run(st, request))
        if st.done and not st.pending:  # (a reply still waiting for window is forgotten once it is sent)
            self._forget(st)

    async def _run_compressed(self, st: Stream, payload) -> None:
        error = None
        size = 0
        try:
            try:
                payload = await decompress(
                    self.loop,
                    st.encoding,
                    payload,
                    self.max_message,
                    self.settings.max_decompression_ratio,
                    lambda: st.done or self.closed,
                )
                size = len(payload)
                request = st.method.request_type.FromString(payload)
            except Abort as exc:
                error = (exc.code, exc.details)
                size = exc.inflated
            except Exception as exc:
                error = (status_code(grpc.StatusCode.INTERNAL), f"failed to parse the request: {exc}")
            del payload
            if error is not None:
                self._finish_error(st, *error)
            else:
                await self._run(st, request)
        finally:
            st.task = None  # (see _run)
            TRIMMER.released(self.loop, size)

    async def _request_iterator(self, st: Stream):
        request_type = st.method.request_type
        queue = st.queue
        assert queue is not None  # (a streaming call's)
        while True:
            item = await queue.get()
            if item is None:
                return
            if st.held and queue.empty():
                self._release(st)
            compressed, msg = item
            del item
            if compressed:
                try:
                    msg = await decompress(
                        self.loop,
                        st.encoding,
                        msg,
                        self.max_message,
                        self.settings.max_decompression_ratio,
                        lambda: st.done or self.closed,
                    )
                except Abort as exc:  # refused: what it had inflated to is freed
                    TRIMMER.released(self.loop, exc.inflated)
                    raise
            size = len(msg)
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
            TRIMMER.released(self.loop, size)

    async def _run(self, st: Stream, request) -> None:
        method = st.method
        try:
            if method.server_streaming:
                async for response in method.call(request, st):  # a reset stream cancels this task
                    if isinstance(response, WireMessage):  # its buffers, not joined (as in _reply)
                        self._send_message(st, response.wire_chunks())
                    else:
                        self._send_message(st, response.SerializeToString())
                self._finish(st, OK_TRAILERS)
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
            self._finish_error(st, exc.code, exc.details, exc.trailing_metadata)
        except asyncio.CancelledError:
            if not st.done:
                self._finish_error(st, grpc.StatusCode.CANCELLED, "the call was cancelled")
            raise
        except Exception as exc:
            log.exception("gRPC call %s failed", st.sid)
            exc.__traceback__ = None
            self._finish_error(st, grpc.StatusCode.UNKNOWN, f"Unexpected error: {exc}")
        finally:
            # a cancelled Task keeps its CancelledError, whose traceback holds this frame and so `st`: were
            # st.task still the Task, that would be a reference cycle keeping the stream's buffers (and the
            # request, through the servicer's frames) until a full garbage collection
            st.task = None

    # ---- sending ----
    def _reply(self, st: Stream, msg) -> None:
        """A unary call's whole response (headers, message, trailers) in one write when the windows allow;
        `msg`: the serialized message, or a list of buffers that make it up (sent without joining them)."""
        if type(msg) is list:
            total = 5
            for chunk in msg:
                total += len(chunk)
            if total < 16384:  # (a large one stays in its buffers: joining it copied it into fresh pages)
                msg = b"".join(msg)
        else:
            total = len(msg) + 5
        if st.pending or st.headers_sent or st.done or self.closed:
            self._send_message(st, msg, total - 5)
            self._finish(st, OK_TRAILERS)
            return
        if total > self.peer_max_frame or total > st.send_window or total > self.send_window:
            # headers, the message in as many full DATA frames as the windows allow, and the trailers when
            # all of it went: one writelines (the rest goes as WINDOW_UPDATEs come in)
            st.headers_sent = True
            st.done = True
            st.trailers = OK_TRAILERS
            pending = st.pending = collections.deque()
            pending.append(memoryview(_MSG_PREFIX.pack(0, total - 5)))
            if type(msg) is list:
                pending.extend(memoryview(c) for c in msg if len(c))
            elif msg:
                pending.append(memoryview(msg))
            self._sent_data()
            self._flush(
                st,
                [
                    _FRAME.pack(len(RESPONSE_HEADERS) << 8 | HEADERS, END_HEADERS, st.sid),
                    RESPONSE_HEADERS,
                ],
            )
            return
        st.send_window -= total
        self.send_window -= total
        st.headers_sent = True
        sid = st.sid
        out = [
            _FRAME.pack(len(RESPONSE_HEADERS) << 8 | HEADERS, END_HEADERS, sid),
            RESPONSE_HEADERS,
            _FRAME.pack(total << 8 | DATA, 0, sid),
            _MSG_PREFIX.pack(0, total - 5),
            *(msg if type(msg) is list else (msg,)),
            _FRAME.pack(len(OK_TRAILERS) << 8 | HEADERS, END_STREAM | END_HEADERS, sid),
            OK_TRAILERS,
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
            out.append(frame(HEADERS, END_HEADERS, st.sid, RESPONSE_HEADERS))
        chunks = None
        if type(msg) is list:
            if n is None:
                n = sum(len(c) for c in msg)
            if n < 16384:  # (a large one stays in its buffers, as in _reply)
                msg = b"".join(msg)
            else:
                chunks = msg
        else:
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
            if chunks is None:
                out.append(msg)
            else:
                out.extend(chunks)
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
        if chunks is None:
            st.pending.append(memoryview(msg))
        else:
            st.pending.extend(memoryview(c) for c in chunks if len(c))
        self._flush(st)

    def _finish(self, st: Stream, block: bytes) -> None:
        """End the call with a trailer block (after any queued DATA)."""
        if st.done or self.closed:
            return
        if st.pending:
            if not st.headers_sent:
                st.headers_sent = True
                self.transport.write(frame(HEADERS, END_HEADERS, st.sid, RESPONSE_HEADERS))
            st.trailers = block
            st.done = True
            self._flush(st)
            return
        st.done = True
        if not st.headers_sent:  # trailers-only response
            st.headers_sent = True
            block = RESPONSE_HEADERS + block
        out = [_FRAME.pack(len(block) << 8 | HEADERS, END_STREAM | END_HEADERS, st.sid), block]
        self._closed_local(st, out)
        self.transport.writelines(out)

    def _finish_error(self, st: Stream, code, message: str, metadata=()) -> None:
        if st.task is not None and st.task is not asyncio.current_task() and not st.task.done():
            st.task.cancel()
        self._finish(st, status_block(status_code(code), message, metadata))

    def _respond_http(self, st: Stream) -> None:
        """Not a gRPC request: an HTTP status and a line of text saying what this server is (flow-controlled
        DATA, then an empty DATA frame ending the stream)."""
        status = st.http_status
        block = b"\x08" + hpack_int(len(status), 7) + status + _PLAIN_TEXT  # :status (name 8), no indexing
        st.headers_sent = True
        self.transport.write(frame(HEADERS, END_HEADERS, st.sid, block))
        st.pending = collections.deque([memoryview(_NOT_GRPC)])
        st.trailers = b""  # (empty: end with DATA, not with a trailer block)
        st.done = True
        self._flush(st)


class H2GrpcServer:
    """Listens on host:port and serves `methods` ({b"/package.Service/Method": Method})."""

    loop: asyncio.AbstractEventLoop  # the one it serves on, from `start` on

    def __init__(
        self,
        methods: dict[bytes, Method],
        authorize: Callable | None = None,
        settings: GrpcSettings | None = None,
        busy_poll: BusyPoll | None = None,
    ):
        self.methods = methods
        self.authorize = authorize  # (method, metadata) -> denial message or None
        self.settings = settings or GrpcSettings()
        self.connections: set[_Connection] = set()
        self.accepted = 0  # connections made so far (transport/drain.py listens on while they still arrive)
        self.starter = eager.Starter(busy_poll)  # unary calls start in the frame handler (transport/eager.py)
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

    def protocol_factory(self) -> _Connection:
        """A connection's protocol, for sockets accepted here or elsewhere (`loop.connect_accepted_socket`)."""
        self.accepted += 1
        return _Connection(self)

    async def start(
        self, host: str, port: int, ssl=None, reuse_port: bool = False, listen: bool = True
    ) -> None:
        """`ssl`: an ssl.SSLContext (ALPN "h2") to serve h2 over TLS instead of cleartext h2c. `reuse_port`:
        SO_REUSEPORT, so that every frontend worker process listens on the port. `listen=False`: bind nothing;
        the engine's acceptor hands this worker its connections (`protocol_factory`)."""
        self.loop = asyncio.get_running_loop()
        if not listen:
            self._sweeper = self.loop.call_later(self.tick_interval, self._sweep)
            return
        self._server = await self.loop.create_server(
            self.protocol_factory,
            host.strip("[]") or None,
            port,
            reuse_address=True,
            reuse_port=reuse_port or None,
            backlog=1024,
            ssl=ssl,
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

    async def drain(self, timeout: float) -> None:
        """SIGTERM: stop listening, GOAWAY every connection gracefully (H2Connection.drain) and wait up to
        `timeout` for their calls to finish and the connections to close."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.drain()
        deadline = self.loop.time() + timeout
        while self.connections and self.loop.time() < deadline:
            await asyncio.sleep(0.02)

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
