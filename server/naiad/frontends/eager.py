"""Eager coroutine start for the frontends (Python 3.12's eager task start, on 3.11 too): run now, Task if it waits."""

from __future__ import annotations

import asyncio
import contextvars
import logging

log = logging.getLogger(__name__)


class _Suspended:
    """Awaitable that continues a coroutine which has already run up to its first suspension: it hands the
    Task the future that coroutine is waiting on, and passes results, exceptions and cancellation through."""

    __slots__ = ("coro", "yielded")

    def __init__(self, coro, yielded):
        self.coro = coro
        self.yielded = yielded

    def __await__(self):
        coro, value = self.coro, self.yielded
        self.coro = self.yielded = None
        while True:
            try:
                sent = yield value
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # CancelledError from Task.cancel() included
                try:
                    value = coro.throw(exc)
                except StopIteration as stop:
                    return stop.value
            else:
                try:
                    value = coro.send(sent)
                except StopIteration as stop:
                    return stop.value


async def _resume(coro, yielded):
    return await _Suspended(coro, yielded)


def start(loop: asyncio.AbstractEventLoop, coro) -> asyncio.Task | None:
    """Run `coro` now, in a context of its own as a Task would, up to its first real suspension; the rest runs
    in a Task (returned). None when it finished at once: no Task, no later loop iteration. An exception it
    raises at once is logged, as a Task would log one nobody retrieved (the frontends' coroutines catch theirs)."""
    context = contextvars.copy_context()
    try:
        yielded = context.run(coro.send, None)
    except StopIteration:
        return None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:
        log.exception("%r failed", coro)
        return None
    return loop.create_task(_resume(coro, yielded), context=context)
