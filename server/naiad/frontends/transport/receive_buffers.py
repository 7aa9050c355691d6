"""Pooled receive buffers for large request bodies and gRPC messages.

The kernel copies a large tensor straight into one of these (asyncio.BufferedProtocol) and the request's
numpy arrays are read-only views of it. A buffer is an anonymous private mapping, reused by later requests
of about the same size: once its pages have been written they stay mapped, so a large request neither
copies its bytes around in user space nor faults in fresh pages. A new mapping takes memory only as the
client's bytes arrive (a Content-Length or gRPC message length alone allocates nothing), and one the pool
does not keep goes back to the system as soon as its request is done.

A buffer is reused only when nothing refers to it any more: every view of it (memoryview, numpy array, a
write the transport has not finished) holds a reference to the mapping, so its reference count says when
the request, its response and any tensor a model kept are done with it. There is no release call to forget.

In a frontend worker (`--frontend-workers`) the buffers the pool keeps are shared-memory segments (`share`), so
the engine process maps the request's tensors where the kernel put them instead of the worker copying them. On a GPU
machine the buffers a single-process server keeps are page-locked (`pinning`, host_pinning.py), so that a GPU
model's copy of a tensor from them is DMA.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import sys
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from ...host_pinning import HostPinning

POOLED_MIN = 64 * 1024  # smaller bodies are read as before (the parser's own buffers)
# buffers the pool keeps, in use or idle; past this a large request gets a buffer of its own, freed after it
POOL_BYTES = int(os.environ.get("NAIAD_RECEIVE_POOL_BYTES", str(256 << 20)))
_FREE_REFS = 3  # a buffer nothing else refers to: the pool's list, the loop variable, getrefcount's argument


def size_class(n: int) -> int:
    """`n` rounded up to a sixteenth of its power of two (at most ~6% more), so that requests of about
    the same size share buffers."""
    step = 1 << max(12, n.bit_length() - 5)
    return (n + step - 1) // step * step


class SegmentSource(Protocol):
    """Named shared-memory segments for receive buffers (engine.slabs.SlabPool)."""

    def receive_segment(self, size: int) -> mmap.mmap | None:
        """A new segment of `size` bytes; None when shared memory is full."""

    def drop_segment(self, buf: mmap.mmap) -> None:
        """A segment from `receive_segment` is being let go."""


class ReceivePool:
    """Receive buffers by size class; a buffer is handed out again once no request refers to it."""

    def __init__(self, limit: int = POOL_BYTES):
        self.limit = limit
        self.classes: dict[int, list[mmap.mmap]] = {}
        self.bytes = 0  # what the pool's buffers take, in use or idle
        self.segments: SegmentSource | None = None  # where kept buffers come from once shared (`share`)
        self.pinning: HostPinning | None = None  # page-locks kept buffers (a GPU server, one process)

    def share(self, segments: SegmentSource) -> None:
        """Buffers the pool keeps from now on are shared-memory segments of `segments` (a frontend worker's
        engine.slabs.SlabPool), which another process can map by name."""
        self.segments = segments

    def take(self, n: int) -> mmap.mmap:
        """A buffer of at least `n` bytes that no request is using."""
        cap = size_class(n)
        bufs = self.classes.get(cap)
        if bufs is None:
            bufs = self.classes[cap] = []
        for buf in bufs:
            if sys.getrefcount(buf) == _FREE_REFS:
                return buf
        if self.bytes + cap > self.limit:
            self._evict(cap)
        keep = self.bytes + cap <= self.limit  # else a buffer of its own, freed after its request
        segment = self.segments.receive_segment(cap) if keep and self.segments is not None else None
        buf = segment if segment is not None else mmap.mmap(-1, cap, flags=mmap.MAP_PRIVATE)
        if not keep:
            return buf
        if self.pinning is not None:
            self.pinning.pin(buf)
        bufs.append(buf)
        self.bytes += cap
        return buf

    def view(self, n: int) -> memoryview:
        """`take(n)` as a writable view of exactly `n` bytes (a message or body being assembled)."""
        return memoryview(self.take(n))[:n]

    def _evict(self, need: int) -> None:
        """Drop idle buffers (largest classes first) until `need` more bytes fit under the limit."""
        for cap in sorted(self.classes, reverse=True):
            bufs = self.classes[cap]
            keep = []
            for buf in bufs:
                if self.bytes + need > self.limit and sys.getrefcount(buf) == _FREE_REFS:
                    self.bytes -= cap  # dropped: freed once the last reference goes
                    if self.pinning is not None:
                        self.pinning.unpin(buf)  # nothing refers to it: no copy can be reading it
                    if self.segments is not None:
                        self.segments.drop_segment(buf)
                else:
                    keep.append(buf)
            bufs[:] = keep
            if self.bytes + need <= self.limit:
                return

    def idle_bytes(self) -> int:
        """Bytes in buffers no request is using (for tests and diagnostics)."""
        total = 0
        for cap, bufs in self.classes.items():
            for buf in bufs:
                if sys.getrefcount(buf) == _FREE_REFS:
                    total += cap
        return total


POOL = ReceivePool()  # one per process: the HTTP and gRPC frontends share it (one event loop)


class Connection(Protocol):
    """The callbacks a `ConnectionReader` passes on to the connection it reads for."""

    def connection_lost(self, exc: Exception | None, /) -> None: ...
    def eof_received(self) -> bool | None: ...
    def pause_writing(self) -> None: ...
    def resume_writing(self) -> None: ...


C = TypeVar("C", bound=Connection)


class ConnectionReader(asyncio.BufferedProtocol, Generic[C]):
    """The transport's protocol while one large body or frame is read into a receive buffer: a subclass fills
    `get_buffer`/`buffer_updated`; the connection's other callbacks go to the connection (`conn`, a `C`) it
    stands in for, which takes the transport back once the bytes are in."""

    __slots__ = ("conn",)

    conn: C

    def connection_lost(self, exc: Exception | None) -> None:
        self.conn.connection_lost(exc)

    def eof_received(self) -> bool | None:
        return self.conn.eof_received()

    def pause_writing(self) -> None:
        self.conn.pause_writing()

    def resume_writing(self) -> None:
        self.conn.resume_writing()
