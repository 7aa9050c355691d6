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
import collections.abc
import contextvars
import types
from collections.abc import Coroutine
from typing import Any, cast

from .busy_poll import BusyPoll


class Starter:
    """Starts one listener's request coroutines: the first of a turn of the loop at once, the others as Tasks."""

    __slots__ = ("burst", "poll")

    def __init__(self, poll: BusyPoll | None = None) -> None:
        self.burst = False  # a request was started at once in this turn of the loop
        self.poll = poll  # told of each turn that starts requests (busy_poll.py)

    def start(self, loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> asyncio.Task | None:
        """`start_now` for the first request of a turn of the loop; a Task for the others."""
        if self.burst:
            return loop.create_task(coro)
        self.burst = True
        loop.call_soon(self._turned)
        if self.poll is not None:
            self.poll.kick()
        return start_now(loop, coro)

    def _turned(self) -> None:
        self.burst = False


def start_now(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, Any]) -> asyncio.Task | None:
    """Run `coro` until it first waits, in a copy of the context as a Task would: None when it finished there, else
    the Task that runs the rest. An exception that ends it early goes to the loop's exception handler, as a failed
    Task's would."""
    ctx = contextvars.copy_context()
    try:
        waiting = ctx.run(coro.send, None)
    except StopIteration:
        return None
    except Exception as exc:
        loop.call_exception_handler({"message": "request coroutine failed", "exception": exc})
        return None
    # (Started is a Coroutine by registration, below, which a type checker does not see)
    return loop.create_task(cast("Coroutine[Any, Any, Any]", Started(coro, waiting)), context=ctx)


class Started:
    """A coroutine `Starter.start` began, for a Task to drive on exactly as if the Task had started it: the Task's
    first step gets what the coroutine already waits on; every later step goes into the coroutine, and so does
    a cancellation, even one that comes before the Task's first step (a connection lost in the same turn)."""

    __slots__ = ("coro", "waiting")

    def __init__(self, coro: Coroutine[Any, Any, Any], waiting: Any):
        self.coro = coro
        # a future the coroutine's own `await` marked as waited on, or None (a bare yield)
        self.waiting = waiting

    def send(self, value: Any) -> Any:
        waiting = self.waiting
        if waiting is not _TAKEN:
            self.waiting = _TAKEN
            return waiting
        return self.coro.send(value)

    def throw(self, *exc: Any) -> Any:
        waiting, self.waiting = self.waiting, _TAKEN
        if waiting is not _TAKEN and waiting is not None:
            waiting.cancel()  # a Task cancelled while it waits cancels what it waits on first
        return self.coro.throw(*exc)

    def close(self) -> None:
        self.coro.close()

    # what asyncio reads of a Task's coroutine for its repr and its stack: the started coroutine's own
    @property
    def __name__(self) -> str:
        return _native(self.coro).__name__

    @property
    def cr_code(self) -> Any:
        return _native(self.coro).cr_code

    @property
    def cr_frame(self) -> Any:
        return _native(self.coro).cr_frame

    @property
    def cr_running(self) -> bool:
        return _native(self.coro).cr_running


def _native(coro: Coroutine[Any, Any, Any]) -> types.CoroutineType[Any, Any, Any]:
    """A request's coroutine as what it is, an async function's (a native coroutine, with its code and frame), which
    its `Coroutine` type does not say."""
    return cast("types.CoroutineType[Any, Any, Any]", coro)


_TAKEN = object()
collections.abc.Coroutine.register(Started)  # what asyncio.Task asks of a coroutine: send, throw and close
