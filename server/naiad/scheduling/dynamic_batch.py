"""Triton's dynamic batch scheduler, and the default scheduler (one request per execution) as its degenerate case.

Both are one queue and one dispatcher: the dispatcher takes a free instance, then as many queued requests as
the policy allows (1 for the default scheduler; up to max_batch_size, preferring `preferred_batch_size`, waiting
at most `max_queue_delay_microseconds` for the dynamic batcher), and runs them as one execution.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2 as mc

from ..errors import InvalidArgument, Unavailable
from ..inference import InferenceRequest, InferenceResponse
from .pool import InstancePool

DRAIN_TURN = 256  # queued batches the dispatcher runs on the loop back to back before it lets the loop turn


@dataclass
class QueuePolicy:
    max_queue_size: int = 0  # 0: unbounded
    default_timeout_us: int = 0
    allow_timeout_override: bool = False
    delay_on_timeout: bool = False

    @classmethod
    def from_config(cls, p) -> QueuePolicy:
        return cls(
            max_queue_size=p.max_queue_size,
            default_timeout_us=p.default_timeout_microseconds,
            allow_timeout_override=p.allow_timeout_override,
            delay_on_timeout=p.timeout_action == mc.ModelQueuePolicy.DELAY,
        )


class _Entry:
    __slots__ = ("deadline_ns", "future", "level", "request", "shape_key", "size", "timer")

    def __init__(self, request, future, level, size, shape_key):
        self.request = request
        self.future = future
        self.level = level
        self.size = size
        self.shape_key = shape_key
        self.deadline_ns = 0
        self.timer = None


class DynamicBatchScheduler:
    """Queue + dispatcher in front of an InstancePool (a `scheduling.scheduler.Scheduler`)."""

    def __init__(self, pool: InstancePool, config: mc.ModelConfig):
        self.pool = pool
        self.stats = pool.stats
        self.config = config
        self.batched = config.max_batch_size > 0
        self.dynamic = config.HasField("dynamic_batching")
        db = config.dynamic_batching
        self.max_batch = config.max_batch_size if (self.dynamic and self.batched) else 0
        self.preferred = sorted(db.preferred_batch_size) if self.dynamic else []
        self.delay_ns = db.max_queue_delay_microseconds * 1000 if self.dynamic else 0
        self.levels = max(1, db.priority_levels) if self.dynamic else 1
        self.default_level = (db.default_priority_level or 1) if self.dynamic and db.priority_levels else 1
        default_policy = QueuePolicy.from_config(db.default_queue_policy) if self.dynamic else QueuePolicy()
        self.policies = {lvl: default_policy for lvl in range(1, self.levels + 1)}
        if self.dynamic:
            for lvl, p in db.priority_queue_policy.items():
                if 1 <= lvl <= self.levels:
                    self.policies[lvl] = QueuePolicy.from_config(p)
        self.ragged = {i.name for i in config.input if i.allow_ragged_batch}
        self.queues: list[collections.deque[_Entry]] = [collections.deque() for _ in range(self.levels + 1)]
        self.queued = 0
        self._wakeup = asyncio.Event()  # binds to the loop at its first wait (Python >= 3.10)
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()
        self._direct = 0  # executions started by the fast path, not yet finished
        self._closed = False

    # ---- submission ----
    async def submit(self, request: InferenceRequest) -> InferenceResponse | None:
        if self._closed:
            raise Unavailable(f"model '{self.config.name}' is unloading")
        if not self.dynamic and not self.queued:
            inst = self.pool.try_acquire()
            if inst is not None:
                return await self._run_now(inst, request)
        # (asked for after the direct path: on Python 3.11 asking makes a getpid system call)
        loop = asyncio.get_running_loop()
        if self._task is None:
            self._task = loop.create_task(self._dispatch_loop())
        level = self._level(request)
        policy = self.policies[level]
        queue = self.queues[level]
        if policy.max_queue_size and len(queue) >= policy.max_queue_size:
            self.pool.stats.record_request(
                False, time.monotonic_ns() - request.arrival_ns, 0, 0, 0, 0, reason="REJECTED"
            )
            raise Unavailable("Exceeds maximum queue size")
        size = request.batch_size(self.batched)
        entry = _Entry(request, loop.create_future(), level, size, self._shape_key(request))
        timeout_us = policy.default_timeout_us if self.dynamic else 0
        if self.dynamic and request.timeout_us and policy.allow_timeout_override:
            # A request may shorten the default timeout, never extend it (Triton's rule).
            timeout_us = min(timeout_us, request.timeout_us) if timeout_us else request.timeout_us
        if timeout_us:
            entry.deadline_ns = request.arrival_ns + timeout_us * 1000
            if not policy.delay_on_timeout:
                entry.timer = loop.call_later(timeout_us / 1e6, self._expire, entry)
        if request.trace is not None:
            request.trace.append(("QUEUE_START", time.monotonic_ns()))
        queue.append(entry)
        self.queued += 1
        self.pool.stats.pending += 1
        self._wakeup.set()
        try:
            return await entry.future
        finally:
            self.pool.stats.pending -= 1

    def _level(self, request: InferenceRequest) -> int:
        if self.levels == 1:
            return 1
        p = request.priority
        if p == 0:
            return self.default_level
        if p < 0 or p > self.levels:
            raise InvalidArgument(
                f"request priority {p} is out of range for model '{self.config.name}' "
                f"(priority_levels is {self.levels})"
            )
        return p

    def _shape_key(self, request: InferenceRequest):
        if not self.max_batch:
            return None
        return tuple((n, a.shape[1:]) for n, a in request.inputs.items() if n not in self.ragged)

    def _expire(self, entry: _Entry) -> None:
        queue = self.queues[entry.level]
        try:
            queue.remove(entry)
        except ValueError:
            return  # already dispatched
        self.queued -= 1
        if not entry.future.done():
            req = entry.request
            self.pool.stats.record_request(
                False, time.monotonic_ns() - req.arrival_ns, 0, 0, 0, 0, reason="REJECTED"
            )
            entry.future.set_exception(Unavailable("Request timeout expired"))

    async def _run_now(self, inst, request: InferenceRequest) -> InferenceResponse | None:
        """Default scheduler, free instance, empty queue: no dispatcher round trip."""
        if request.trace is not None:
            request.trace.append(("QUEUE_START", time.monotonic_ns()))
        self.pool.stats.pending += 1
        self._direct += 1
        if inst.inline.inline:  # no await inside: nothing can interrupt it
            try:
                results = await self.pool.run(inst, [request], time.monotonic_ns())
            finally:
                self._done_now(inst)
        else:
            # shielded: a client that goes away must not free an instance that is still executing
            task = asyncio.ensure_future(self.pool.run(inst, [request], time.monotonic_ns()))
            task.add_done_callback(lambda _: self._done_now(inst))
            results = await asyncio.shield(task)
        res = results[0]
        if isinstance(res, BaseException):
            raise res
        return res

    def _done_now(self, inst) -> None:
        self._direct -= 1
        self.pool.stats.pending -= 1
        self.pool.release(inst)
        if self.queued:
            self._wakeup.set()

    # ---- dispatch ----
    def _oldest(self) -> _Entry | None:
        for q in self.queues[1:]:
            if q:
                return q[0]
        return None

    async def _dispatch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        inline_run = 0  # batches run here since the loop last turned
        while not self._closed:
            while not self.queued:
                inline_run = 0
                self._wakeup.clear()
                await self._wakeup.wait()
                if self._closed:
                    return
            inst = await self.pool.acquire()
            if self.max_batch and self.delay_ns:
                await self._wait_for_batch()
            batch = self._take()
            if not batch:
                self.pool.release(inst)
                continue
            if inst.inline.inline:
                # It executes on the loop without suspending: run it here, and the next batch at once, so a
                # queue empties in one turn. One execution (and one Task) a turn let a closed-loop load refill
                # the queue as fast as it emptied: every request then met `queued` and took this path, 1.6x
                # the CPU of the direct one, for as long as the load lasted (bench/README.md, "Inline
                # executions under a CPU limit"). Other connections get a turn every DRAIN_TURN batches.
                await self._run(inst, batch)
                del batch, inst
                inline_run += 1
                if inline_run >= DRAIN_TURN:
                    inline_run = 0
                    await asyncio.sleep(0)
                continue
            inline_run = 0
            task = loop.create_task(self._run(inst, batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            # This coroutine's locals outlive the iteration while it waits for the next request: the batch's
            # requests (their tensors: views of the receive buffer) and futures (the responses) must not.
            del batch, task, inst

    async def _wait_for_batch(self) -> None:
        """Wait up to the queue delay (from the oldest request's arrival) for a full or preferred batch."""
        target = self.preferred[-1] if self.preferred else self.max_batch
        while True:
            oldest = self._oldest()
            if oldest is None:
                return
            total = sum(e.size for q in self.queues[1:] for e in q)
            if total >= target or (self.preferred and total in self.preferred and total == target):
                return
            remaining = oldest.request.arrival_ns + self.delay_ns - time.monotonic_ns()
            if remaining <= 0:
                return
            self._wakeup.clear()
            try:
                await asyncio.wait_for(self._wakeup.wait(), remaining / 1e9)
            except asyncio.TimeoutError:
                return

    def _take(self) -> list[_Entry]:
        """Pop the next batch: highest priority first, same shapes only, up to max_batch_size."""
        limit = self.max_batch or 1
        batch: list[_Entry] = []
        total = 0
        key = None
        now = time.monotonic_ns()
        for q in self.queues[1:]:
            skipped = []
            while q and total < limit:
                e = q.popleft()
                if e.future.done():  # cancelled by its client
                    self.queued -= 1
                    continue
                if e.deadline_ns and now > e.deadline_ns and e.timer is None:
                    # DELAY policy: an expired request yields to the others but is still run
                    skipped.append(e)
                    continue
                if batch and (e.shape_key != key or total + e.size > limit):
                    skipped.append(e)
                    if total + e.size > limit:
                        break
                    continue
                if not batch:
                    key = e.shape_key
                batch.append(e)
                total += e.size
                if not self.max_batch:
                    break
            for e in reversed(skipped):
                q.appendleft(e)
            if batch and not self.max_batch:
                break
        if self.preferred and total not in self.preferred and total > self.preferred[0]:
            # Trim to the largest preferred size reachable; the rest forms the next batch.
            fit = max(p for p in self.preferred if p <= total)
            while total > fit and len(batch) > 1:
                e = batch.pop()
                total -= e.size
                self.queues[e.level].appendleft(e)
        self.queued -= len(batch)
        if not batch:
            # Only DELAY-expired requests are left: they run now, oldest first.
            oldest = self._oldest()
            if oldest is not None:
                self.queues[oldest.level].popleft()
                self.queued -= 1
                batch.append(oldest)
        for e in batch:
            if e.timer is not None:
                e.timer.cancel()
        return batch

    async def _run(self, inst, batch: list[_Entry]) -> None:
        dispatch_ns = time.monotonic_ns()
        try:
            results = await self.pool.run(inst, [e.request for e in batch], dispatch_ns)
        finally:
            self.pool.release(inst)
            if self.queued:
                self._wakeup.set()
        for e, res in zip(batch, results):
            if e.future.done():
                continue
            if isinstance(res, BaseException):
                e.future.set_exception(res)
            else:
                e.future.set_result(res)

    async def close(self, timeout: float | None = None) -> None:
        """Stop accepting; let queued and running work finish (up to `timeout`)."""
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while (self.queued or self._running or self._direct) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._closed = True
        for q in self.queues[1:]:
            while q:
                e = q.popleft()
                if not e.future.done():
                    e.future.set_exception(Unavailable(f"model '{self.config.name}' was unloaded"))
        if self._task is not None:
            self._wakeup.set()
            self._task.cancel()
