"""Responses from model threads to the event loop: one loop wakeup for every burst of them, not one per response.

A decoupled model (an LLM engine streaming tokens) sends its responses from its own thread. Each
`call_soon_threadsafe` writes the loop's wakeup file descriptor and queues one callback, so an engine step that
produces a token for each of 32 sequences woke the loop 32 times. `Handoff.post` queues the callback and wakes the
loop only when no wakeup is on its way yet; the loop runs everything posted up to then, in the order it was posted.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("naiad.scheduling")


class Handoff:
    """Callbacks posted from any thread, run on `loop` in order; one `call_soon_threadsafe` per burst."""

    __slots__ = ("_items", "_scheduled", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._items: collections.deque[tuple[Callable[[Any], None], Any]] = collections.deque()
        self._scheduled = False  # a _run is queued on the loop and has not started draining yet

    def post(self, fn: Callable[[Any], None], arg: Any) -> None:
        """Run `fn(arg)` on the loop soon (callable from any thread, the loop's own included)."""
        self._items.append((fn, arg))
        if not self._scheduled:
            # (two threads that both see False schedule two runs: the second finds less or nothing to do)
            self._scheduled = True
            self.loop.call_soon_threadsafe(self._run)

    def _run(self) -> None:
        # cleared before draining: an item appended after the drain's last look sees False and wakes the loop
        self._scheduled = False
        items = self._items
        while items:
            fn, arg = items.popleft()
            try:
                fn(arg)
            except Exception:
                log.exception("a response callback failed on the event loop")
