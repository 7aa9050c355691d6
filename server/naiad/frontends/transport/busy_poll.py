"""Busy polling: after it serves a request the event loop keeps polling its sockets a while before it sleeps.

A CPU that goes idle between two requests takes time to wake for the next one's interrupt. On a virtual machine
that is an exit to the hypervisor and an inter-processor interrupt back: on the bench machine (a KVM guest whose
`guest_halt_poll_ns` is 0) a do-nothing uvloop server answered wrk at concurrency 1 in a p50 of 88 µs sleeping
between requests and 26 µs polling (bench/c1_floor.py). The kernel's own answer is halt polling (cpuidle-haltpoll
in a guest, `halt_poll_ns` in KVM, both 200 µs by default), where the host allows it; servers built for latency
(Seastar, DPDK) poll all the time. This module polls only after requests, and only as long as polling has been
catching the next one.

While polling, a callback re-queues itself with `call_soon`, so each turn of the loop polls its sockets with a
zero timeout instead of blocking, and a request that arrives is read at once. Polling ends `limit` after the last
turn that started a request. The limit adapts as the haltpoll governor's does (drivers/cpuidle/governors/
haltpoll.c): when the loop slept and the next request came within `max`, polling that long would have caught it,
so the limit grows (to 50 µs, then doubling, up to `max`); when the loop slept for longer than `max`, polling is
no use for this traffic and the limit halves (to 0 below 50 µs). Sparse traffic therefore costs nothing after a
few requests, and the CPU spent polling is at most the gaps between requests that come closer than `max`.

The loop does not poll while a model executes on an instance thread (a model too slow to execute on the loop,
backends/base.py: InlinePolicy). Each poll takes the GIL, and a loop that takes and drops it thousands of times a
millisecond starves a thread that releases it (numpy copies, ONNX Runtime) of getting it back: CPython's convoy
effect. Without this rule the bench's ONNX Runtime `mlp` over gRPC at c64 (executions on a thread) read 0.95-0.96x
of the same server not polling; with it, 0.98-1.00x. After a threaded execution the loop sleeps, as before.

Polled time is CPU time the process is charged (unlike the kernel's halt polling): a pod with a tight CPU limit
and requests spread just under `max` apart spends up to that much more; `--busy-poll-us 0` turns it off.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ...scheduling.pool import InstancePool

GROW_START_NS = 50_000  # the first non-zero limit, as haltpoll's guest_halt_poll_grow_start


class BusyPoll:
    """Keeps one event loop polling after requests; the listeners `kick` it when a turn starts a request."""

    __slots__ = ("_clock", "_idle_since", "_kicks", "_seen", "limit_ns", "loop", "max_ns", "polling")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        max_us: int,
        clock: Callable[[], int] = time.perf_counter_ns,
    ):
        if max_us < 0:
            raise ValueError(f"busy poll time must be >= 0 µs, got {max_us}")
        self.loop = loop
        self.max_ns = max_us * 1000
        self.limit_ns = 0  # how long polling goes on after the last request; adapts between 0 and max_ns
        self.polling = False
        self._kicks = 0  # turns that started a request, counted by kick
        self._seen = 0  # ... up to the last poll
        self._idle_since = 0  # when the loop last found no new request (0: never served one)
        self._clock = clock

    def kick(self) -> None:
        """A request starts in this turn of the loop: poll on after it."""
        self._kicks += 1
        if self.polling or not self.max_ns or InstancePool.running_off_loop:
            return
        if self._idle_since:  # the loop slept since its last request: learn from how long
            self._adapt(self._clock() - self._idle_since)
        self.polling = True
        self.loop.call_soon(self._poll)

    def _adapt(self, idle_ns: int) -> None:
        if idle_ns <= self.limit_ns:
            return
        if idle_ns <= self.max_ns:  # polling longer would have caught it
            self.limit_ns = min(self.max_ns, max(GROW_START_NS, self.limit_ns * 2))
        else:  # the gap was longer than polling may last
            limit = self.limit_ns // 2
            self.limit_ns = limit if limit >= GROW_START_NS else 0

    def _poll(self) -> None:
        if InstancePool.running_off_loop:
            self.polling = False  # see the module's docstring: instance threads and the GIL
            return
        now = self._clock()
        if self._kicks != self._seen:  # a request started since the last poll: the wait starts again
            self._seen = self._kicks
            self._idle_since = now
        elif now - self._idle_since >= self.limit_ns:
            self.polling = False  # the loop may sleep now
            return
        self.loop.call_soon(self._poll)
