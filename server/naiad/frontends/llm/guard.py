"""Every error an LLM route meets answered in its API's error object: the request's own errors (LLMError, a
NaiadError from the server or the model) with their status, aiohttp's HTTP errors, a client gone (499, nobody to read
it), and anything else as a 500 that is logged."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web

from ...errors import NaiadError
from ..http.sse import StreamStalled
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
