"""Instance pool: every model instance owns one thread; a free-list hands instances to the scheduler."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from ..backends.base import ModelInstance, Timing
from ..errors import as_naiad_error
from ..inference import InferenceRequest, InferenceResponse
from ..stats import ModelStats

log = logging.getLogger("naiad.execution")


class InstancePool:
    # executions on instance threads right now, in every pool of the process (changed on the event loop only);
    # frontends/transport/busy_poll.py does not poll while there are any
    running_off_loop = 0

    def __init__(self, instances: list[ModelInstance], stats: ModelStats, batched: bool, limiter=None):
        self.instances = instances
        self.limiter = limiter
        if limiter is not None:
            for inst in instances:
                limiter.register(inst)
        self.stats = stats
        self.batched = batched
        self.executors = {
            id(inst): ThreadPoolExecutor(1, thread_name_prefix=f"naiad-{inst.name}") for inst in instances
        }
        # Free list and waiters: a deque and futures rather than an asyncio.Queue, whose get/put cost
        # ~2 us each on every request (the fast path takes and returns an instance per request).
        self._free = collections.deque(instances)
        self._waiters: collections.deque[asyncio.Future] = collections.deque()

    def initialize(self) -> None:
        """Run each instance's per-thread set-up (python `initialize`) on its own thread; raise on failure."""
        futures = [self.executors[id(i)].submit(i.warmup_thread_init) for i in self.instances]
        for f in futures:
            f.result()

    async def _get(self) -> ModelInstance:
        if self._free and not self._waiters:
            return self._free.popleft()
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            return await fut
        except BaseException:
            if fut.done() and not fut.cancelled():
                self._put(fut.result())  # handed over just as the waiter was cancelled: pass it on
            else:
                try:
                    self._waiters.remove(fut)
                except ValueError:
                    pass
            raise

    def _put(self, inst: ModelInstance) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(inst)
                return
        self._free.append(inst)

    async def acquire(self) -> ModelInstance:
        """A free instance whose rate-limiter resources (if any) are also held for it."""
        inst = await self._get()
        if self.limiter is not None:
            try:
                await self.limiter.acquire(inst)
            except BaseException:
                self._put(inst)
                raise
        return inst

    def try_acquire(self) -> ModelInstance | None:
        """A free instance without waiting, or None (never with a rate limiter: that may have to wait)."""
        if self.limiter is not None or self._waiters or not self._free:
            return None
        return self._free.popleft()

    def release(self, inst: ModelInstance) -> None:
        if self.limiter is not None:
            self.limiter.release(inst)
        self._put(inst)

    def free_count(self) -> int:
        return len(self._free)

    async def run(
        self, inst: ModelInstance, requests: list[InferenceRequest], dispatch_ns: int
    ) -> list[InferenceResponse | BaseException]:
        """Execute a batch on `inst` (on its thread, on the loop when its policy allows, or awaited when it runs
        elsewhere: `execute_async`) and account for it. Never raises."""
        timing = Timing()
        if log.isEnabledFor(logging.DEBUG):  # --log-verbose >= 1: how the batcher composed this execution
            log.debug(
                "model %s, instance %s, executing %d requests (batch size %d)",
                self.stats.model,
                inst.name,
                len(requests),
                sum(r.batch_size(self.batched) for r in requests),
            )
        start = time.monotonic_ns()
        results: Sequence[InferenceResponse | None]
        try:
            if inst.inline.inline:
                results = inst.execute(requests, timing)
            else:
                pending = inst.execute_async(requests, timing)
                if pending is not None:
                    results = await pending
                else:
                    InstancePool.running_off_loop += 1
                    try:
                        results = await asyncio.get_running_loop().run_in_executor(
                            self.executors[id(inst)], inst.execute, requests, timing
                        )
                    finally:
                        InstancePool.running_off_loop -= 1
            outcome: list = list(results)
        except BaseException as exc:
            err = as_naiad_error(exc)
            outcome = [err] * len(requests)
        done = time.monotonic_ns()
        inst.inline.observe(timing.input_ns + timing.infer_ns + timing.output_ns or done - start)
        for req in requests:
            if req.trace is not None:
                req.trace.extend(
                    (
                        ("COMPUTE_START", start),
                        ("COMPUTE_INPUT_END", start + timing.input_ns),
                        ("COMPUTE_OUTPUT_START", start + timing.input_ns + timing.infer_ns),
                        ("COMPUTE_END", done),
                    )
                )
        batch = sum(r.batch_size(self.batched) for r in requests)
        finished = [
            (
                not isinstance(res, BaseException) and (res is None or res.error is None),
                done - req.arrival_ns,
                dispatch_ns - req.arrival_ns,
            )
            for req, res in zip(requests, outcome)
        ]
        self.stats.record_run(batch, timing.input_ns, timing.infer_ns, timing.output_ns, finished)
        return outcome

    def execute_on(self, inst: ModelInstance, fn, *args):
        """Run a function on an instance's thread (warmup, shutdown); returns a concurrent Future."""
        return self.executors[id(inst)].submit(fn, *args)

    def close(self) -> None:
        for inst in self.instances:
            ex = self.executors[id(inst)]
            try:
                ex.submit(inst.close).result()
            except Exception:
                pass
            ex.shutdown(wait=False)
