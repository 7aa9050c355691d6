"""Runs placement passes one at a time per pool and coalesces requests: everyone who asks while a pass is
running shares the single pass that starts after it, so bursts of pod events cost one extra pass, not many. A pass
whose result asks for a follow-up (work left pending, e.g. an unload waiting for the endpoints) gets one later."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
Key = tuple[str, str]  # (namespace, pool)
T = TypeVar("T")


class PassRunner(Generic[T]):
    def __init__(
        self, run: Callable[[str, str], Awaitable[T]], again: Callable[[T], float | None] | None = None
    ):
        self._run = run
        self._again = again  # seconds after which a pass's result wants another pass (None: no follow-up)
        self._timers: dict[Key, asyncio.TimerHandle] = {}
        self._locks: dict[Key, asyncio.Lock] = {}
        self._queued: dict[Key, asyncio.Future[T]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def _schedule(self, key: Key) -> asyncio.Future[T]:
        future = self._queued.get(key)
        if future is None:
            future = asyncio.get_running_loop().create_future()
            self._queued[key] = future
            task = asyncio.create_task(self._drive(key, future), name=f"naiad-pass-{key[0]}/{key[1]}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return future

    async def _drive(self, key: Key, future: asyncio.Future[T]) -> None:
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            # From here on, new requests queue the pass after this one: this one may already have read state.
            if self._queued.get(key) is future:
                del self._queued[key]
            try:
                result = await self._run(*key)
            except asyncio.CancelledError:
                future.cancel()
                raise
            except Exception as error:
                future.set_exception(error)
            else:
                future.set_result(result)
                delay = self._again(result) if self._again is not None else None
                if delay is not None:
                    self._follow_up(key, delay)

    def _follow_up(self, key: Key, delay: float) -> None:
        loop = asyncio.get_running_loop()
        timer = self._timers.get(key)
        if timer is not None and not timer.cancelled() and timer.when() <= loop.time() + delay:
            return  # an earlier follow-up is already set
        if timer is not None:
            timer.cancel()

        def fire() -> None:
            self._timers.pop(key, None)
            self.request(*key)

        self._timers[key] = loop.call_later(delay, fire)

    async def run(self, namespace: str, pool: str) -> T:
        """Wait for a pass that starts after this call; its exception, if any, is raised here."""
        return await asyncio.shield(self._schedule((namespace, pool)))

    def request(self, namespace: str, pool: str) -> None:
        """Ask for a pass without waiting; failures are logged (the resync timer tries again)."""
        future = self._schedule((namespace, pool))
        future.add_done_callback(lambda f: self._log_failure(namespace, pool, f))

    @staticmethod
    def _log_failure(namespace: str, pool: str, future: asyncio.Future[T]) -> None:
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            log.warning("placement pass for %s/%s failed: %s", namespace, pool, error)

    async def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
