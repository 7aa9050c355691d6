"""The HTTP response of a Server-Sent Events stream: its headers go out with its first event, in one write.

aiohttp's StreamResponse writes its headers as soon as it is prepared, so a stream's first event cost two writes
(two loopback sends, two wakeups of the client) before the client had its first token. Prepared only when the
first event is ready (generate_stream, the OpenAI streams), the headers wait for it a few microseconds at most.
"""

from __future__ import annotations

from aiohttp import web


class EventResponse(web.StreamResponse):
    """A `text/event-stream` response; `prepare()` buffers the headers until the first `write()` (or the end)."""

    _send_headers_immediately = False  # aiohttp's own switch (web.Response turns it off the same way)

    def __init__(self) -> None:
        super().__init__(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
