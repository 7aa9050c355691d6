"""Giving memory back to the system after a large request message is released: glibc's malloc_trim(0), off the
event loop and at most once per MIN_INTERVAL (a no-op where the C library has no malloc_trim).

Why: a large message lives in many allocations (the socket's reads, zlib's output steps, protobuf's copies).
Those under glibc's mmap threshold (which rises to 32 MiB once large blocks have been freed) come from the
heap arenas, and a freed block below a live one is kept by the process: after a 512 MiB message RSS stayed
hundreds of MB up. malloc_trim returns every free page of every arena."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time

log = logging.getLogger("naiad.grpc")

LARGE_MESSAGE = 16 << 20  # a released request at least this large schedules a trim
MIN_INTERVAL = (
    1.0  # seconds between two trims: a flood of large requests trims once a second, not per request
)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt parameters
MMAP_THRESHOLD = 1 << 20  # blocks of 1 MiB and more are mapped and unmapped: returned as soon as freed
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # the top of the heap is given back past this (the dynamic rule's ratio)


def _malloc_trim():
    """glibc's malloc_trim, after pinning its thresholds. By default each free of an mmapped block raises the
    mmap threshold to that block's size (up to 32 MiB) and the trim threshold to twice it, so how much memory a
    large message left behind depended on which messages came before it (after a refused gzip bomb, a 40 MiB
    ModelStreamInfer message peaked 60 MB higher and an HTTP bomb kept +45 MB). Pinned at 1 MiB, blocks of 1 MiB
    and more (tensor-sized) are mapped and unmapped, so freeing them returns them at once; smaller ones come
    from the heap, whose free pages the trims return."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None  # not glibc (musl, macOS): its allocator is left as it is
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrimmer:
    """Schedules malloc_trim(0) once large messages have been released (`released`), rate-limited."""

    def __init__(self, min_interval: float = MIN_INTERVAL):
        self.min_interval = min_interval
        self.trim = _malloc_trim()
        self.last = float("-inf")  # time.monotonic() of the last trim
        self.scheduled = False  # a trim is scheduled or running
        self.rounds = 0  # trims still to run for the releases noted so far
        self.trims = 0

    def released(self, loop: asyncio.AbstractEventLoop, nbytes: int) -> None:
        """A request message of `nbytes` was released (or is about to be, in this loop turn). Two trims follow:
        one at once (rate permitting), and one MIN_INTERVAL later, for memory that outlives the call a little
        (a reply's last window of bytes, views of the request, still in the transport's write queue)."""
        if nbytes < LARGE_MESSAGE or self.trim is None:
            return
        self.rounds = 2
        if not self.scheduled:
            self._schedule(loop)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        self.scheduled = True
        delay = max(0.0, self.last + self.min_interval - time.monotonic())
        loop.call_later(delay, self._start, loop)  # (later: after this turn has dropped the message)

    def _start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.rounds -= 1
        fut = loop.run_in_executor(None, self._run)
        fut.add_done_callback(lambda f: self._done(loop, f))

    def _run(self) -> None:
        self.trim(0)  # (ctypes releases the GIL for the call)

    def _done(self, loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
        self.scheduled = False
        self.last = time.monotonic()
        self.trims += 1
        if not fut.cancelled() and fut.exception() is not None:
            log.warning("malloc_trim failed: %s", fut.exception())
        if self.rounds > 0 and not loop.is_closed():
            self._schedule(loop)


TRIMMER = HeapTrimmer()  # one per process: the heap is the process's
