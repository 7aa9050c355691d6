"""A minimal HTTP/1.1 protocol for the one hot route, `POST /v2/models/{model}[/versions/{version}]/infer`.

Everything else a connection sends (other routes and methods, HTTP/1.0, an `Expect` other than 100-continue or
behind a request not yet answered, encoded request bodies or transfer codings other than chunked, Upgrade,
oversized bodies, odd URLs) is handed to the aiohttp app for the rest of that connection's life: the aiohttp
`Server` makes a `RequestHandler` protocol, the transport is switched over to it and it is fed every raw byte
from the start of the request that triggered the handoff. A chunked body is decoded here (chunked.py). Both
paths answer an infer request through the same function, `HttpFrontend.run_infer`, so results and errors are
identical.

Slow clients: a request head must arrive within NAIAD_HTTP_HEAD_TIMEOUT seconds (default 30) of its first
byte, and a body at NAIAD_HTTP_MIN_BODY_RATE bytes/s (default 16 KiB/s) on average once its first
NAIAD_HTTP_BODY_GRACE seconds (default 10) have passed; a connection that falls behind is closed. A head with
a field or request line over 8190 bytes or more than 128 header lines is handed to aiohttp, which refuses it
(its limits).

Requests on one connection are answered in order: one runs at a time, the ones pipelined behind it
wait in a queue (reading pauses when the queue is long), and a handoff, an error reply or a close
waits until every earlier response is written.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from http import HTTPStatus

import httptools
import orjson

from ...errors import NaiadError
from ..transport import eager
from ..transport.busy_poll import BusyPoll
from ..transport.receive_buffers import POOL, POOLED_MIN, ConnectionReader
from .chunked import ChunkedBodyReader, ChunkError
from .codec import compress_response, error_headers, error_payload, response_coding, restricted_message

log = logging.getLogger("naiad.http")

MAX_QUEUE = 16  # parsed requests waiting on one connection before reading pauses
MAX_HEAD = 64 * 1024  # header bytes before the fast path lets aiohttp judge the request
MAX_HANDOFF_BUFFER = 1 << 20  # raw bytes buffered for a pending handoff before reading pauses
ROUTE_CACHE_SIZE = 1024
KEEPALIVE_TIMEOUT = 75.0  # aiohttp's default: idle keep-alive connections are closed after it
MAX_FIELD = 8190  # aiohttp's max_line_size / max_field_size
MAX_HEADERS = 128  # aiohttp's max_headers (header lines)

# header names (lowercase) the fast path looks at; anything in _HANDOFF_HEADERS sends the request to aiohttp (but
# `Expect: 100-continue`, which the fast path answers, and `Transfer-Encoding: chunked`, which it decodes)
_CONTENT_LENGTH = b"content-length"
_HEADER_LENGTH = b"inference-header-content-length"
_ACCEPT_ENCODING = b"accept-encoding"
_EXPECT = b"expect"
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_TRANSFER_ENCODING = b"transfer-encoding"
_HANDOFF_HEADERS = frozenset((_TRANSFER_ENCODING, b"content-encoding", b"upgrade", _EXPECT))

# what happens once the queue of fast requests is empty
_HANDOFF = 1  # switch the connection to aiohttp, feeding it the buffered raw bytes
_CLOSE = 2  # close the connection (Connection: close, shutdown, EOF)
_BAD_REQUEST = 3  # answer 400 (malformed HTTP) and close


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


_STATUS_LINES: dict[int, bytes] = {}


def _status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, _reason(status))
    return line


_JSON = b"Content-Type: application/json\r\n"
_OK_JSON = _status_line(200) + _JSON
_OK_BINARY = (
    _status_line(200) + b"Content-Type: application/octet-stream\r\nInference-Header-Content-Length: "
)
_BINARY_HEADERS = ("Inference-Header-Content-Length", "Content-Type")


def response_bytes(status: int, chunks: list, headers: dict | None, keep_alive: bool) -> bytes | list[bytes]:
    """The whole response, as one bytes for transport.write or, for a large body, a list for writelines."""
    length = 0
    for c in chunks:
        length += len(c)
    content_type = headers.get("Content-Type") if headers else None
    if content_type is None or headers is None or (content_type == "application/json" and len(headers) == 1):
        head = (
            _OK_JSON if status == 200 else _status_line(status) + _JSON
        ) + b"Content-Length: %d\r\n" % length
    elif (
        status == 200
        and content_type == "application/octet-stream"
        and len(headers) == 2
        and _BINARY_HEADERS[0] in headers
    ):
        head = _OK_BINARY + b"%s\r\nContent-Length: %d\r\n" % (headers[_BINARY_HEADERS[0]].encode(), length)
    else:
        head = (
            _status_line(status)
            + b"".join(
                b"%s: %s\r\n" % (k.encode("latin-1"), str(v).encode("latin-1")) for k, v in headers.items()
            )
            + b"Content-Length: %d\r\n" % length
        )
    head += b"\r\n" if keep_alive else b"Connection: close\r\n\r\n"
    if length < 65536:
        return head + chunks[0] if len(chunks) == 1 else head + b"".join(chunks)
    return [head, *chunks]


def parse_route(url: bytes) -> tuple[str, str] | None:
    """(model, version) for an infer URL the fast path serves as aiohttp's router would; None: hand off."""
    if not url.isascii() or b"%" in url or b"#" in url:
        return None
    path = url.split(b"?", 1)[0]
    parts = path.split(b"/")
    if len(parts) == 5:
        _, v2, models, model, infer = parts
        version = b""
    elif len(parts) == 7:
        _, v2, models, model, versions, version, infer = parts
        if versions != b"versions" or not version or version in (b".", b".."):
            return None
    else:
        return None
    if (
        v2 != b"v2"
        or models != b"models"
        or infer != b"infer"
        or parts[0] != b""
        or not model
        or model in (b".", b"..")
    ):
        return None
    if b"{" in model or b"}" in model or b"{" in version or b"}" in version:
        return None
    return model.decode(), version.decode()


class FastHttpServer:
    """The protocol factory for the HTTP listener, and what its connections share."""

    def __init__(
        self,
        frontend,
        aiohttp_server,
        max_input_size: int,
        restricted: dict | None = None,
        busy_poll: BusyPoll | None = None,
    ):
        self.frontend = frontend
        self.aiohttp_server = aiohttp_server  # aiohttp's protocol factory (web_server.Server)
        self.max_input_size = max_input_size
        rule = (restricted or {}).get("inference")
        self.restrict_key = rule[0].lower().encode("latin-1") if rule else None
        self.restrict_value = rule[1] if rule else None
        self.error_payload = error_payload
        self.restricted_body = orjson.dumps({"error": restricted_message(rule[0])}) if rule else None
        self.routes: dict[bytes, tuple[str, str] | None] = {}
        self.chunked_sizes: dict[tuple[str, str], int] = {}  # the last chunked body's size by route
        self.connections: set[FastHttpProtocol] = set()
        self.accepted = 0  # connections made so far (transport/drain.py listens on while they still arrive)
        self.starter = eager.Starter(busy_poll)  # requests start in data_received (transport/eager.py)
        self.closing = False
        self.draining = (
            False  # transport/drain.py: answers carry Connection: close, then their connection closes
        )
        self._sweeper: asyncio.TimerHandle | None = None
        self.head_timeout = float(os.environ.get("NAIAD_HTTP_HEAD_TIMEOUT", "30"))
        self.min_body_rate = float(os.environ.get("NAIAD_HTTP_MIN_BODY_RATE", str(16 * 1024)))
        self.body_grace = float(os.environ.get("NAIAD_HTTP_BODY_GRACE", "10"))
        self.sweep_interval = min(
            KEEPALIVE_TIMEOUT / 5, max(0.1, min(self.head_timeout, self.body_grace) / 4)
        )

    def __call__(self) -> FastHttpProtocol:
        self.accepted += 1
        return FastHttpProtocol(self)

    def route(self, url: bytes) -> tuple[str, str] | None:
        try:
            return self.routes[url]
        except KeyError:
            pass
        if len(self.routes) >= ROUTE_CACHE_SIZE:
            self.routes.clear()
        route = self.routes[url] = parse_route(url)
        return route

    def start_sweeping(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close keep-alive connections idle for KEEPALIVE_TIMEOUT, as aiohttp does for its own."""
        self._sweeper = loop.call_later(self.sweep_interval, self._sweep, loop)

    def _sweep(self, loop) -> None:
        """Close idle keep-alive connections, and ones whose request head or body comes too slowly."""
        now = loop.time()
        deadline = now - KEEPALIVE_TIMEOUT
        for conn in list(self.connections):
            if conn.final is not None or conn.reading_paused:
                pass  # handing off or closing (aiohttp's own timers take over), or we stopped reading
            elif conn.in_head:
                if now - conn.started > self.head_timeout:
                    conn.close()
            elif conn.head_end >= 0:  # in a body
                elapsed = now - conn.started
                received = conn.reader.fill if conn.reader is not None else len(conn.raw) - conn.head_end
                if elapsed > self.body_grace and received < self.min_body_rate * elapsed:
                    conn.close()
            elif conn.task is None and not conn.queue and conn.last_active < deadline:
                conn.close()
        self.start_sweeping(loop)

    def close_idle(self) -> None:
        """Draining, after the idle grace: close the connections with no request under way (none being received,
        queued or answered)."""
        for conn in list(self.connections):
            if (
                conn.task is None
                and not conn.queue
                and not conn.in_head
                and conn.head_end < 0
                and conn.reader is None
                and conn.final is None
            ):
                conn.close()

    async def shutdown(self, timeout: float) -> None:
        """Close idle connections now; busy ones after their queued responses (or after `timeout`)."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        tasks = []
        for conn in list(self.connections):
            conn.stop()
            if conn.task is not None:
                tasks.append(conn.task)
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        for conn in list(self.connections):
            conn.close()


class _Stop(Exception):
    """Raised from a parser callback to stop httptools mid-buffer (it surfaces as HttpParserCallbackError)."""


class FastHttpProtocol(asyncio.Protocol):
    __slots__ = (
        "bad_status",
        "chunked",
        "coding",
        "content_length",
        "eof",
        "error",
        "expect",
        "feeding",
        "final",
        "handoff",
        "head_end",
        "header_count",
        "header_length",
        "in_head",
        "keep_alive",
        "last_active",
        "loop",
        "lost",
        "more",
        "parser",
        "queue",
        "raw",
        "reader",
        "reading_paused",
        "restricted_value",
        "route",
        "srv",
        "started",
        "task",
        "transport",
        "url",
        "writing_paused",
    )

    transport: asyncio.Transport  # from connection_made on, which comes before any other callback

    def __init__(self, srv: FastHttpServer):
        self.srv = srv
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        # raw bytes from the start of the message being parsed (a large body's, fed from its pooled buffer: a view)
        self.raw: bytes | bytearray | memoryview = b""
        self.queue: deque = deque()  # complete requests not yet answered
        self.task: asyncio.Task | None = None
        self.final: int | None = None  # _HANDOFF, _CLOSE or _BAD_REQUEST once parsing has stopped
        self.lost = False
        self.eof = False
        self.reading_paused = False
        self.writing_paused = False
        self.in_head = False
        self.started = 0.0  # when the request being received began (its head), then its body
        self.error = "malformed HTTP request"  # the message once final is _BAD_REQUEST
        self.bad_status = 400  # (413: a chunked body over the size limit)
        self.reader: BodyReader | ChunkedBodyReader | None = None  # a body being read into a pooled buffer
        self.feeding = False  # data_received is parsing the requests that followed a chunked body
        self.more = b""  # such bytes, handed up to that loop
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.content_length = 0
        self.header_length: str | None = None
        self.coding: str | None = None
        self.expect = False
        self.chunked = False
        self.keep_alive = True
        self.handoff = False
        self.restricted_value: str | None = None
        self.head_end = -1
        self.header_count = 0
        self.route: tuple[str, str] | None = None

    # ---- asyncio.Protocol ----
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.last_active = self.loop.time()
        if self.srv.closing:
            transport.close()
            return
        self.srv.connections.add(self)

    def connection_lost(self, exc) -> None:
        self.lost = True
        self.reader = None
        self.queue.clear()
        self.raw = b""
        del self.parser  # it holds our bound methods: break the cycle (nothing parses after this)
        self.srv.connections.discard(self)
        # an in-flight request runs to completion (aiohttp does not cancel handlers either); its write is skipped

    def eof_received(self):
        self.eof = True
        if self.task is not None or self.queue:
            return True  # answer what was received (and hand off what aiohttp should answer), then close
        return None  # nothing pending: let the transport close

    def pause_writing(self) -> None:
        self.writing_paused = True

    def resume_writing(self) -> None:
        self.writing_paused = False

    def data_received(self, data: bytes | memoryview) -> None:
        self.last_active = self.loop.time()
        if self.final is not None:
            # parsing stopped: only a pending handoff still wants the bytes, to pass them on to aiohttp
            if self.final == _HANDOFF:
                raw = self.raw
                if type(raw) is not bytearray:
                    raw = self.raw = bytearray(raw)
                raw += data
                if len(raw) > MAX_HANDOFF_BUFFER:
                    self._pause_reading()
            return
        raw = self.raw
        if raw:
            if type(raw) is not bytearray:
                raw = bytearray(raw)
            raw += data
            self.raw = raw
        else:
            self.raw = data
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if self.final is None and not self.chunked:  # not one of ours: a bug in a callback
                log.error("HTTP fast path: parser callback failed: %r", exc.__context__ or exc)
                self.final = _BAD_REQUEST
        except httptools.HttpParserUpgrade:
            # the headers asking for an upgrade send the request to aiohttp before this can happen
            self.final = _HANDOFF
        except httptools.HttpParserError as exc:
            if self.final is None:
                self.final = _BAD_REQUEST
                self.error = str(exc) or type(exc).__name__
        if self.final is None and self.in_head and len(self.raw) > MAX_HEAD:
            self.final = _HANDOFF  # aiohttp applies its own header size limits and answers them
        if self.final is None and self.head_end >= 0:
            if self.chunked:
                more = self._read_chunked()  # the bytes after a chunked body that came whole, if any
                if more:
                    if self.feeding:
                        self.more = more  # for the loop below, a call up: never one call deeper a request
                    else:
                        self.feeding = True
                        try:
                            while more:
                                self.data_received(more)
                                more, self.more = self.more, b""
                        finally:
                            self.feeding = False
                return
            if self.content_length >= POOLED_MIN:
                self._read_body()
        self._answer()

    def _answer(self) -> None:
        """Start answering queued requests, or finish once parsing has stopped and none are left."""
        if self.task is None:
            if self.queue:
                self.task = self.srv.starter.start(self.loop, self._run())
            elif self.final is not None:
                self._finish()
        elif len(self.queue) >= MAX_QUEUE:
            self._pause_reading()

    # ---- httptools callbacks ----
    def on_message_begin(self) -> None:
        self.in_head = True
        self.started = self.last_active

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_count += 1
        if len(name) + len(value) > MAX_FIELD or self.header_count > MAX_HEADERS:
            self.handoff = True  # aiohttp refuses it
        name = name.lower()
        if name == _CONTENT_LENGTH:
            try:
                self.content_length = int(value)
            except ValueError:  # llhttp checks it; whatever it let through, aiohttp may judge
                self.handoff = True
        elif name == _HEADER_LENGTH:
            if self.header_length is None:
                self.header_length = value.decode("utf-8", "surrogateescape")
        elif name == _ACCEPT_ENCODING:
            self.coding = response_coding(value.decode("latin-1"))
        elif name in _HANDOFF_HEADERS:
            # but `Expect: 100-continue` (curl's with a body over 1 MiB), which the fast path answers (another
            # expectation aiohttp refuses: 417), and a chunked body, which it decodes (other codings: aiohttp's)
            if name == _EXPECT and not self.expect and value.lower() == b"100-continue":
                self.expect = True
            elif name == _TRANSFER_ENCODING and not self.chunked and value.strip().lower() == b"chunked":
                self.chunked = True
            else:
                self.handoff = True
        elif name == b"traceparent" and self.srv.frontend.server.tracer.active:
            self.handoff = True  # (aiohttp's route reads the traceparent)
        elif name == self.srv.restrict_key and self.restricted_value is None:
            self.restricted_value = value.decode("utf-8", "surrogateescape")

    def on_headers_complete(self) -> None:
        self.in_head = False
        parser = self.parser
        route = None
        if (
            not self.handoff
            and parser.get_method() == b"POST"
            and parser.get_http_version() == "1.1"
            and self.content_length <= self.srv.max_input_size
            and len(self.url) <= MAX_FIELD
        ):
            route = self.srv.route(self.url)
        if self.expect and route is not None:
            if self.task is not None or self.queue:
                route = None  # (a 100 Continue may not go out before the responses to earlier requests)
            else:
                self.transport.write(_CONTINUE)  # the client waits for it before it sends the body
        if route is None:
            self.final = _HANDOFF
            raise _Stop
        self.route = route
        raw = self.raw
        assert not isinstance(raw, memoryview)  # (only a large body's bytes are: they come after the head)
        if raw[0] in (10, 13):  # empty lines before a request line are allowed and skipped (RFC 9112 2.2)
            raw = self.raw = raw.lstrip(b"\r\n")
        self.head_end = raw.find(b"\r\n\r\n") + 4  # llhttp (strict by default) requires CRLF line ends
        self.started = self.loop.time()
        if self.chunked:  # the body is decoded by a ChunkedBodyReader (data_received), not by this parser
            self.keep_alive = parser.should_keep_alive()
            raise _Stop

    def on_message_complete(self) -> None:
        raw = self.raw
        start = self.head_end
        end = start + self.content_length
        if self.reader is None and (
            start < 4 or end > len(raw)
        ):  # cannot happen with strict llhttp; never answer from a wrong offset
            log.error(
                "HTTP fast path: message bounds %d..%d outside the %d buffered bytes", start, end, len(raw)
            )
            self.final = _BAD_REQUEST
            self.error = "internal HTTP framing error"
            raise _Stop
        reader = self.reader
        body: bytes | memoryview
        if (
            reader is not None
        ):  # the body was read into a pooled buffer: the request's tensors are views of it
            assert type(reader) is BodyReader  # (a chunked body's reader is done before the parser reads on)
            body = reader.body
            self.reader = None
            self.raw = b""
        elif type(raw) is bytes:
            body = raw[start:end]
            self.raw = raw[end:] if end < len(raw) else b""
        else:  # a request that came in several reads: copy its body out once
            with memoryview(raw) as view:
                body = bytes(view[start:end])
            self.raw = raw[end:] if end < len(raw) else b""
        keep_alive = self.parser.should_keep_alive()
        srv = self.srv
        denied = srv.restrict_key is not None and self.restricted_value != srv.restrict_value
        self.queue.append((self.route, body, self.header_length, keep_alive, denied, self.coding))
        self._reset()
        if not keep_alive:  # (_queue_request, inline: this runs once a request)
            self.final = _CLOSE
            raise _Stop

    def _queue_request(self, body, keep_alive: bool) -> bool:
        """A whole request is in: queue it to be answered; False when the connection closes after it."""
        srv = self.srv
        denied = srv.restrict_key is not None and self.restricted_value != srv.restrict_value
        self.queue.append((self.route, body, self.header_length, keep_alive, denied, self.coding))
        self._reset()
        if not keep_alive:
            self.final = _CLOSE
        return keep_alive

    # ---- large bodies ----
    def _read_body(self) -> None:
        """The head of a large request is parsed and its body is still coming: the bytes already here go into
        a pooled buffer and the transport reads the rest straight into it (BodyReader)."""
        raw = self.raw
        have = len(raw) - self.head_end
        reader = self.reader = BodyReader(self, POOL.take(self.content_length), self.content_length)
        if have:
            with memoryview(raw) as view:
                reader.view[:have] = view[self.head_end :]
            reader.fill = reader.seeded = have
        self.raw = b""  # (the head is parsed; a handoff can no longer happen for this request)
        self.transport.set_protocol(reader)

    def body_received(self, reader: BodyReader) -> None:
        """The whole body is in the buffer: the parser skips over it (it keeps no body bytes) and completes
        the request."""
        self.transport.set_protocol(self)
        view = reader.view[reader.seeded : reader.size]
        try:
            self.data_received(view)
        finally:
            # uvloop keeps the bound methods of a transport's last BufferedProtocol until the next one is set
            # or the connection closes: the reader must not keep the body's buffer alive after its request
            del reader.view, reader.body

    def _read_chunked(self) -> bytes:
        """The head of a chunked request is parsed (its parser stopped there): the bytes already here and the rest
        of the body are decoded into a pooled buffer (chunked.py); a new parser takes the next request.
        Returns the bytes that followed the body when it came whole with its head (for data_received to parse)."""
        srv = self.srv
        route = self.route
        assert route is not None  # (the head of a request the fast path serves)
        reader = ChunkedBodyReader(self, srv.chunked_sizes.get(route, 0), srv.max_input_size)
        raw, self.raw = self.raw, b""
        self.parser = httptools.HttpRequestParser(self)
        try:
            with memoryview(raw) as view:
                done = reader.feed(view[self.head_end :])
        except ChunkError as exc:
            self.chunked_failed(reader, exc)
            return b""
        if done:
            more = self._chunked_done(reader)
            if more:
                return more
        else:
            self.reader = reader
            self.transport.set_protocol(reader)
        self._answer()
        return b""

    def chunked_received(self, reader: ChunkedBodyReader) -> None:
        """The reader has the last chunk and the trailer: queue the request, then parse what followed it."""
        more = self._chunked_done(reader)
        if more:
            self.data_received(more)
        else:
            self._answer()

    def _chunked_done(self, reader: ChunkedBodyReader) -> bytes:
        """Queue the request whose chunked body `reader` holds; the bytes read past it (none if the connection
        closes after it)."""
        self._take_back(reader)
        body, rest = reader.body(), reader.rest()
        reader.release()
        sizes = self.srv.chunked_sizes
        if len(sizes) >= ROUTE_CACHE_SIZE:
            sizes.clear()
        route = self.route
        assert route is not None  # (this request's, until _queue_request below)
        sizes[route] = len(body)  # the next chunked body to this route starts in a buffer of this size
        return rest if self._queue_request(body, self.keep_alive) else b""

    def _take_back(self, reader: ChunkedBodyReader) -> None:
        """This protocol reads the connection again (where `reader` had it)."""
        if self.reader is reader:
            self.reader = None
            self.transport.set_protocol(self)

    def chunked_failed(self, reader: ChunkedBodyReader, exc: ChunkError) -> None:
        """Bad chunked framing (400) or a body over the limit (413): answer it after the earlier requests, and close."""
        self._take_back(reader)
        reader.release()
        self.final = _BAD_REQUEST
        self.error, self.bad_status = str(exc), exc.status
        self._answer()

    # ---- answering ----
    async def _run(self) -> None:
        queue = self.queue
        srv = self.srv
        frontend = srv.frontend
        try:
            while queue and not self.lost:
                (model, version), body, header_length, keep_alive, denied, coding = queue.popleft()
                if self.reading_paused and len(queue) < MAX_QUEUE // 2 and self.final is None:
                    self.reading_paused = False
                    self.transport.resume_reading()
                headers = None
                if denied:
                    status, chunks = 403, [srv.restricted_body]
                else:
                    try:
                        chunks, headers = await frontend.run_infer(model, version, body, header_length)
                        status = 200
                        if coding is not None:
                            chunks, headers = await compress_response(self.loop, chunks, headers, coding)
                    except Exception as exc:
                        if not isinstance(exc, NaiadError):
                            log.exception("unhandled error on POST %s", _path(model, version))
                        status, payload = srv.error_payload(exc)
                        chunks = [payload]
                        headers = error_headers(exc)
                if self.lost or self.transport.is_closing():
                    break
                if not queue and (srv.closing or srv.draining or self.eof or self.final == _CLOSE):
                    keep_alive = False
                out = response_bytes(status, chunks, headers, keep_alive)
                if isinstance(out, bytes):
                    self.transport.write(out)
                else:
                    self.transport.writelines(out)
                if not keep_alive:
                    self.final = _CLOSE
                    queue.clear()
        finally:
            self.task = None
        if not self.lost:
            self.last_active = self.loop.time()
            if self.final is not None or self.eof:
                self._finish()
            elif self.reading_paused:
                self.reading_paused = False
                self.transport.resume_reading()

    def _finish(self) -> None:
        """The queue is empty and parsing has stopped: hand off, answer 400 or close."""
        final = self.final
        if self.lost:
            return
        if final == _HANDOFF and not self.srv.closing:
            self._handoff()
        elif final == _BAD_REQUEST:
            status = self.bad_status
            body = orjson.dumps({"error": f"{HTTPStatus(status).phrase}: {self.error}"})
            if not self.transport.is_closing():
                out = response_bytes(status, [body], None, False)  # (small: one bytes)
                self.transport.write(out if isinstance(out, bytes) else b"".join(out))
            self.close()
        else:
            self.close()

    def _handoff(self) -> None:
        transport = self.transport
        self.srv.connections.discard(self)
        raw, self.raw = self.raw, b""
        del self.parser  # (aiohttp parses the connection from here)
        proto = self.srv.aiohttp_server()
        proto.connection_made(transport)
        transport.set_protocol(proto)
        if self.writing_paused:
            proto.pause_writing()
        if self.reading_paused:
            self.reading_paused = False
            transport.resume_reading()
        if raw:
            proto.data_received(bytes(raw))
        if self.eof:
            proto.close()  # the client is done sending: aiohttp answers what it has, then closes

    def _pause_reading(self) -> None:
        if not self.reading_paused and not self.lost:
            self.reading_paused = True
            self.transport.pause_reading()

    def stop(self) -> None:
        """Server shutdown: idle -> close now; busy -> no more parsing, close after the queued responses."""
        if self.task is None and not self.queue:
            self.close()
        else:
            self.final = _CLOSE

    def close(self) -> None:
        self.srv.connections.discard(self)
        if not self.lost:  # (connected: only a connection made is in srv.connections, or closes itself)
            self.transport.close()


def _path(model: str, version: str) -> str:
    return f"/v2/models/{model}/versions/{version}/infer" if version else f"/v2/models/{model}/infer"


class BodyReader(ConnectionReader[FastHttpProtocol]):
    """The transport's protocol while a large request body arrives: the kernel writes it into a pooled
    buffer (transport/receive_buffers.py), then the connection's FastHttpProtocol takes over again."""

    __slots__ = ("body", "fill", "seeded", "size", "view")

    def __init__(self, conn: FastHttpProtocol, buf, size: int):
        self.conn = conn
        self.size = size
        self.view = memoryview(buf)
        self.body = self.view[:size].toreadonly()  # what the request decodes: its arrays are read-only views
        self.fill = 0
        self.seeded = 0  # bytes that came with the head (the parser has seen those already)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.view[self.fill : self.size]  # never past this body: what follows is the parser's

    def buffer_updated(self, nbytes: int) -> None:
        self.fill += nbytes
        self.conn.last_active = self.conn.loop.time()
        if self.fill >= self.size:
            self.conn.body_received(self)
