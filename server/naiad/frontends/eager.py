"""Start a request's coroutine in the callback that received it; a Task drives it only if it has to wait.

A unary request to a model that executes inline (backends/base.py: InlinePolicy) never waits: run as a Task it
costs a Task, a context copy, a `call_soon` and a loop-iteration hop for nothing. `Starter.start` runs the
coroutine at once, in a copy of the context as a Task would, and creates a Task only when the coroutine suspends
on a future (a queued request, an instance thread); that Task resumes the same coroutine, in the same context,
whenever the future it waits on is done. (Python 3.12's eager task factory does the same; this server runs on
3.11.)

Only the first request of a turn of the loop starts at once; the others that arrive in the same turn (other
connections' requests read by the same poll) are plain Tasks, as before. Started at once, every request of a
64-connection burst was answered from inside its own read callback, and the clients' next requests came back
spread over more, smaller turns: 7-8% fewer requests per second at c64 (HTTP and gRPC, bench/README.md).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any

from .busy_poll import BusyPoll


class Starter:
    """Starts one listener's request coroutines: the first of a turn of the loop at once, the others as Tasks."""

    __slots__ = ("burst", "poll")

    def __init__(self, poll: BusyPoll | None = None) -> None:
        self.burst = False  # a request was started at once in this turn of the loop
        self.poll = poll  # told of each turn that starts requests (busy_poll.py)

    def start(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> asyncio.Task | None:
        """Run `coro` until it first waits: None when it finished there, else the Task that runs the rest.

        An exception that ends the coroutine early goes to the loop's exception handler, as a failed Task's would."""
        if self.burst:
            return loop.create_task(coro)
        self.burst = True
        loop.call_soon(self._turned)
        if self.poll is not None:
            self.poll.kick()
        ctx = contextvars.copy_context()
        try:
            waiting = ctx.run(coro.send, None)
        except StopIteration:
            return None
        except Exception as exc:
            loop.call_exception_handler({"message": "request coroutine failed", "exception": exc})
            return None
        return loop.create_task(_resume(coro, waiting), context=ctx)

    def _turned(self) -> None:
        self.burst = False


async def _resume(coro: Coroutine[Any, Any, Any], waiting: Any) -> Any:
    """Drive `coro` on from where `Starter.start` left it, as its own Task would: wait for what it waits on, let
    it read the outcome, and pass a cancellation of this Task on into it."""
    while True:
        cancelled = None
        try:
            if waiting is None:  # a bare `yield` (asyncio.sleep(0)): give the loop one turn
                await asyncio.sleep(0)
            else:
                # the coroutine's own `await` marked the future as waited on; a Task clears the mark when it
                # takes a yielded future, and so does this driver before waiting on it in turn
                waiting._asyncio_future_blocking = False
                await waiting
        except asyncio.CancelledError as exc:
            if waiting is None or not waiting.cancelled():
                # this Task was cancelled, not the future: the coroutine gets it where it waits
                cancelled = exc
        except BaseException:  # the coroutine reads the future's error itself when it resumes
            pass
        try:
            waiting = coro.send(None) if cancelled is None else coro.throw(cancelled)
        except StopIteration as stop:
            return stop.value
