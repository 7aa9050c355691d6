"""`--load-on-demand`: a request for a model that a repository holds but that is not loaded starts its load and
waits for it. A burst of requests causes one load; the waiters are bounded per model and by a timeout; a failed
load answers every waiter with its error."""

from __future__ import annotations

import asyncio
import logging
import math
import time

from ..errors import NaiadError, TooManyRequests, Unavailable, as_naiad_error

log = logging.getLogger("naiad.orchestration")

# after a failed load, requests for the model get its error at once for this long instead of loading it again
FAILED_LOAD_BACKOFF_SECONDS = 5.0
LOAD_WAIT_HEADER = "X-Naiad-Load-Wait-Ms"  # HTTP response header of a request that waited for its model
# the same as a gRPC response parameter (Naiad's HTTP/2 server sends its OK trailers as one constant block)
LOAD_WAIT_PARAMETER = "naiad_load_wait_ms"


class OnDemandLoader:
    """Coalesces the requests for one unloaded model onto one load through the repository."""

    def __init__(self, repository, max_waiters: int, timeout: float):
        self.repository = repository
        self.orchestrator = repository.orchestrator
        self.max_waiters = max_waiters
        self.timeout = timeout
        self.loads: dict[str, asyncio.Future] = {}
        self.failures: dict[str, tuple[float, NaiadError]] = {}  # model -> (when, the error of its last load)

    def _retry_after(self, name: str) -> float:
        rec = self.repository.records.get(name)
        return float(max(1, math.ceil(rec.load_seconds))) if rec is not None and rec.load_seconds else 1.0

    async def ready_model(self, name: str, version: int, miss: NaiadError):
        """The ready version after loading `name` on demand; `miss` (the lookup's error) when the model is in no
        repository, or is loaded and only the version asked for is not. Returns (model version, ns waited)."""
        rec = self.repository.records.get(name)
        if (rec is not None and rec.versions) or not self.repository.listed(name):
            raise miss
        waiting = self.orchestrator.waiting
        metrics = self.orchestrator.metrics
        failed = self.failures.get(name)
        if failed is not None:
            if time.monotonic() - failed[0] < FAILED_LOAD_BACKOFF_SECONDS:
                metrics.wait_failed(name, "load_failed")
                err = type(failed[1])(failed[1].message)
                err.retry_after = FAILED_LOAD_BACKOFF_SECONDS
                raise err
            del self.failures[name]
        if waiting.get(name, 0) >= self.max_waiters:
            metrics.wait_failed(name, "too_many_waiters")
            raise TooManyRequests(
                f"model '{name}' is loading on demand and already has {self.max_waiters} requests waiting for it "
                "(--load-on-demand-max-waiters); retry later",
                self._retry_after(name),
            )
        started = time.monotonic_ns()
        waiting[name] = waiting.get(name, 0) + 1
        try:
            load = self.loads.get(name)
            if load is None:
                load = self.loads[name] = asyncio.get_running_loop().create_task(self._load(name))
                load.add_done_callback(_retrieve)  # every waiter may have timed out
            try:
                await asyncio.wait_for(asyncio.shield(load), self.timeout)
            except asyncio.TimeoutError:
                metrics.wait_failed(name, "timeout")
                exc = Unavailable(
                    f"model '{name}' is loading on demand and was not ready within {self.timeout:g} s "
                    "(--load-on-demand-timeout); retry later"
                )
                exc.retry_after = self._retry_after(name)
                raise exc from None
            except NaiadError as exc:
                metrics.wait_failed(name, "load_failed")
                raise type(exc)(exc.message) from None  # each waiter its own copy of the load's error
            mv = self.repository.get(name, version)
            waited = time.monotonic_ns() - started
            metrics.waited(name, waited / 1e9)
            return mv, waited
        finally:
            waiting[name] -= 1
            if not waiting[name]:
                del waiting[name]

    async def _load(self, name: str) -> None:
        try:
            log.info("loading model '%s' on demand", name)
            await self.repository.ensure_loaded(name, "on_demand")
        except BaseException as exc:
            err = as_naiad_error(exc)
            self.failures[name] = (time.monotonic(), err)
            raise err from None
        finally:
            self.loads.pop(name, None)


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()
