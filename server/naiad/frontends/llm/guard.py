"""Every error an LLM route meets answered in its API's error object: the request's own errors (LLMError, a
NaiadError from the server or the model) with their status, aiohttp's HTTP errors, a client gone (499, nobody to read
it), and anything else as a 500 that is logged; and the same for a stream once it has started (`guard_stream`): the
error as the stream's last event, or nothing when the client is gone."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from ...errors import NaiadError
from ..http.sse import EventStream, StreamStalled
from .errors import LLMError
from .service import ClientGone

log = logging.getLogger("naiad.llm")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def guard(handler: Handler, answer: Callable[[BaseException], web.Response]) -> Handler:
    """`handler` with its errors answered by `answer` (the API's error object)."""

    async def run(request: web.Request) -> web.StreamResponse:
        try:
            return await handler(request)
        except (LLMError, NaiadError) as exc:
            return answer(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return answer(LLMError(exc.reason or "error", exc.status))
        except (ClientGone, StreamStalled, ConnectionResetError):
            return web.Response(status=499)  # nobody is left to read it
        except Exception as exc:
            log.exception("unhandled error on %s %s", request.method, request.path)
            return answer(LLMError(f"internal error: {type(exc).__name__}: {exc}", 500))

    return run


async def guard_stream(
    events: EventStream,
    stream: Awaitable[web.StreamResponse],
    fail: Callable[[BaseException], Awaitable[web.StreamResponse]],
    what: str,
) -> web.StreamResponse:
    """Run a stream's writer (`stream`). A client that went away or stopped reading ends it quietly; an error before
    the stream started is the route's to answer (raised); one after it is answered by `fail` (the API's error event
    and end), logged when it is not the request's own."""
    try:
        return await stream
    except (ClientGone, StreamStalled, ConnectionResetError):
        log.debug("%s ended early: the client went away or stopped reading", what)
        return events.response
    except asyncio.CancelledError:
        if not events.gone():  # cancelled for another reason than the client's leaving (the server stops)
            raise
        log.debug("%s ended early: the client went away", what)
        return events.response
    except Exception as exc:
        if not events.started:
            raise
        if not isinstance(exc, (LLMError, NaiadError)):
            log.exception("error in %s", what)
        try:
            return await fail(exc)
        except (StreamStalled, ConnectionResetError):
            return events.response
