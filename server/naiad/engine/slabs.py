"""Shared-memory slabs for tensor bytes between a frontend worker and the engine: a pool of pre-faulted segments
the sender owns and reuses (and lends the peer the worker's shared receive buffers), and the receiver's cache of
mappings it reads in place."""

from __future__ import annotations

import mmap
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import numpy as np

from . import leftovers

if TYPE_CHECKING:
    from ..host_pinning import HostPinning

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
MIN_SLAB = 256 * 1024  # the smallest size class; tensors below the inline limit never use a slab
# slabs a pool keeps for reuse, in use or idle (as the receive pool's buffers); past this a slab is unlinked once its
# users are done, and so are idle ones that stand in the way of a new one, and the peer is told to unmap it
POOL_BYTES = int(os.environ.get("NAIAD_SLAB_POOL_BYTES", str(256 << 20)))
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_UNVIEWED_REFS = 3  # a mapping's array no view refers to: its container's, a local name's, getrefcount's own
# A page-locked mapping unused this long with no view left gives its bytes to a new mapping when the budget for
# request buffers is used up (with many workers their idle segments would otherwise hold it: measured on an H200,
# ResNet-50 over HTTP with 8 workers executed in 8.3 ms instead of 6.0 after gRPC's segments took the budget);
# a mapping left pageable tries again this often. Mappings in use within it are never unpinned, so a working set
# larger than the budget does not register and unregister buffers by turns.
PIN_IDLE_S = 1.0


def _size_class(nbytes: int) -> int:
    size = MIN_SLAB
    while size < nbytes:
        size *= 2
    return size


def create_segment(name: str, size: int, populate: bool) -> mmap.mmap:
    """A new segment `name` of `size` bytes, mapped shared. Its memory is reserved now (posix_fallocate): a full
    /dev/shm is an OSError here, not a SIGBUS on the first write into the mapping."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(
            fd, size, mmap.MAP_SHARED | (_POPULATE if populate else 0), mmap.PROT_READ | mmap.PROT_WRITE
        )
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except OSError:
        pass


class Slab:
    """One segment of a pool: its name (how the peer maps it) and the writable mapping."""

    __slots__ = ("array", "map", "name", "size")

    def __init__(self, name: str, size: int):
        self.name = name
        self.size = size
        self.map = create_segment(name, size, populate=True)
        self.array = np.frombuffer(self.map, np.uint8)
        self.array[::4096] = 0  # touch every page now, not on the first request that lands here


class _Lent:
    """A buffer the pool does not own (a shared receive buffer) while the peer reads it: its bytes."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array = array


def _exporter(arr: np.ndarray) -> object:
    """The object whose memory `arr` views (the end of its chain of bases, through a memoryview)."""
    obj: object = arr
    while isinstance(obj, np.ndarray) and obj.base is not None:
        obj = obj.base
    return obj.obj if isinstance(obj, memoryview) else obj


class SlabPool:
    """Segments named `<prefix>-<n>` in size classes of powers of two; `free` returns one for reuse. The pool keeps
    at most `limit` bytes of slabs: a new slab first evicts idle ones (largest first), and one that still does not
    fit, or is larger than half the limit, is unlinked when freed. Whatever is unlinked is reported to
    `on_drop(name)` (any thread), so that the peer unmaps it too: an unlinked segment's memory returns only once
    every process has unmapped it."""

    def __init__(self, prefix: str, limit: int = POOL_BYTES):
        self.prefix = prefix
        self.limit = limit
        self.bytes = 0  # what the pool's own slabs take, in use or idle
        self.on_drop: Callable[[str], None] | None = None
        self._free: dict[int, list[Slab]] = {}
        self._all: dict[str, Slab | _Lent] = {}
        self._refs: dict[str, int] = {}  # users of an allocated slab: the peer, and views of it here
        self._transient: set[str] = set()  # slabs past the limit: unlinked when freed
        self._lock = threading.Lock()  # `free` may run in a finalizer on any thread
        self._segments: dict[int, str] = {}  # id() of a live shared receive buffer -> its segment's name
        self._made = 0  # segments made for receive buffers (their names' numbers)
        self._named = 0  # slabs made (their names' numbers: a name is never reused once unlinked)
        self._owner: int | None = None  # the lock on `<prefix>.lock`, taken with the first segment

    def alloc(self, nbytes: int) -> Slab:
        size = _size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                slab = free.pop()
                self._refs[slab.name] = 1
                return slab
            # a slab of more than half the limit is never kept: such tensors are one-offs (as malloc's mmap
            # threshold serves huge blocks with fresh memory that goes back), the pool is for the sizes that recur
            transient = size > self.limit // 2
            dropped = self._evict(size) if not transient and self.bytes + size > self.limit else []
            transient = transient or self.bytes + size > self.limit
            self._hold()
            name = f"{self.prefix}-{self._named}"
            self._named += 1
            self.bytes += size
        self._dropped(dropped)
        try:
            slab = Slab(name, size)
        except BaseException:
            with self._lock:
                self.bytes -= size
            raise
        with self._lock:
            self._all[name] = slab
            self._refs[name] = 1
            if transient:
                self._transient.add(name)
        return slab

    def _evict(self, need: int) -> list[str]:
        """Idle slabs, largest first, taken out until `need` more bytes fit under the limit (lock held); their
        names, to unlink."""
        names = []
        for size in sorted(self._free, reverse=True):
            idle = self._free[size]
            while idle and self.bytes + need > self.limit:
                slab = idle.pop()
                del self._all[slab.name]
                self.bytes -= slab.size
                names.append(slab.name)
        return names

    def _dropped(self, names: list[str]) -> None:
        """Unlink slabs the pool let go and tell the peer (outside the lock: `on_drop` may send a message)."""
        for name in names:
            _unlink(name)
            if self.on_drop is not None:
                self.on_drop(name)

    def receive_segment(self, size: int) -> mmap.mmap | None:
        """A new segment for a receive buffer the frontends manage (frontends.transport.receive_buffers.ReceivePool.share): the
        kernel writes a request's bytes there and `lend` describes them to the peer in place. None when
        shared memory is full (the receive pool then maps private memory, and tensors are copied into slabs).
        The buffer's owner calls `drop_segment` before letting it go."""
        try:
            fs = os.statvfs(SHM_DIR)
        except OSError:
            return None
        if (fs.f_bavail - fs.f_blocks // 4) * fs.f_frsize < size:
            return None  # a quarter of /dev/shm stays for slabs (the copies) and clients' regions
        with self._lock:
            self._hold()
            name = f"{self.prefix}-r{self._made}"
            self._made += 1
        try:
            buf = create_segment(name, size, populate=False)
        except OSError:
            return None
        self._segments[id(buf)] = name
        return buf

    def drop_segment(self, buf: mmap.mmap) -> None:
        """A receive buffer from `receive_segment` is being let go (its memory returns once the peer unmaps it)."""
        name = self._segments.pop(id(buf), None)
        if name is not None:
            self._dropped([name])

    def lend(self, arrays: list[np.ndarray]) -> tuple[str, int] | None:
        """When every array lies in one shared receive buffer: that buffer's name and address, lent to the peer
        (one user until its Free, like an allocated slab), so the arrays need no copy; otherwise None."""
        if not self._segments:
            return None
        buf = _exporter(arrays[0])
        name = self._segments.get(id(buf))
        if name is None:
            return None
        # one of this pool's receive segments, which are mmaps (`_exporter` cannot say which kind of object it finds)
        whole = np.frombuffer(cast(mmap.mmap, buf), np.uint8)
        lo = whole.__array_interface__["data"][0]
        hi = lo + whole.nbytes
        for arr in arrays:
            at = arr.__array_interface__["data"][0]
            if not (lo <= at and at + arr.nbytes <= hi):
                return None
        with self._lock:
            if name in self._refs:
                self._refs[name] += 1
            else:
                self._all[name] = _Lent(whole)
                self._refs[name] = 1
        return name, lo

    def retain(self, name: str) -> np.ndarray:
        """One more user of an allocated slab (views of it in a response); its bytes."""
        with self._lock:
            self._refs[name] += 1
            return self._all[name].array

    def free(self, name: str) -> None:
        """One user is done; the last one returns the slab for reuse."""
        with self._lock:
            slab = self._all.get(name)
            refs = self._refs.get(name, 0) - 1
            if slab is None or refs < 0:
                return
            if refs:
                self._refs[name] = refs
                return
            del self._refs[name]
            if isinstance(slab, _Lent):  # the receive pool's again
                del self._all[name]
                return
            if name not in self._transient:
                self._free.setdefault(slab.size, []).append(slab)
                return
            self._transient.discard(name)
            del self._all[name]
            self.bytes -= slab.size
        self._dropped([name])

    def _hold(self) -> None:
        """Own this pool's segments before making the first (under `_lock`): while this process lives its lock on
        `<prefix>.lock` keeps them from the sweep an engine makes when it starts (leftovers.sweep_segments).
        Segments already under this prefix are a gone predecessor's with the same pid (a restarted container's
        processes often have their old pids): unlinked, or this pool's names would collide with them."""
        if self._owner is None:
            self._owner = leftovers.hold(os.path.join(SHM_DIR, self.prefix + ".lock"))
            leftovers.unlink_segments(SHM_DIR, self.prefix)

    def close(self) -> None:
        """Unlink every segment (the mappings stay valid until the process exits), then the owner lock."""
        for name in [*self._all, *self._segments.values()]:
            _unlink(name)
        if self._owner is not None:
            _unlink(self.prefix + ".lock")
            os.close(self._owner)
            self._owner = None


class SlabMaps:
    """The receiver's mappings of a peer's segments, made on first sight and kept (the pool reuses names)."""

    def __init__(self, pinning: HostPinning | None = None) -> None:
        self._maps: dict[str, np.ndarray] = {}
        self._sweep_at = 64  # mappings past which the next new one first drops those of removed segments
        self._pinning = pinning  # page-locks each mapping (the engine of a GPU server)
        self._retired: list[np.ndarray] = []  # page-locked mappings dropped while views of them were in use
        self._used: dict[str, float] = {}  # with pinning: each mapping's last use (time.monotonic)
        self._pageable: dict[str, float] = {}  # with pinning: mappings not page-locked -> when to try again

    def view(self, name: str) -> np.ndarray:
        arr = self._maps.get(name)
        if arr is not None:
            if self._pinning is not None:
                now = self._used[name] = time.monotonic()
                retry = self._pageable.get(name)
                if retry is not None and now >= retry:
                    self._pin(name, arr, now)
            return arr
        if self._retired:
            self._unpin_retired()
        if len(self._maps) >= self._sweep_at:
            self._sweep()
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        arr = self._maps[name] = np.frombuffer(mm, np.uint8)
        if self._pinning is not None:
            self._pin(name, arr, time.monotonic())
        return arr

    def _pin(self, name: str, arr: np.ndarray, now: float) -> None:
        """Page-lock a mapping; when the budget is used up, first unpin mappings idle for PIN_IDLE_S with no
        view (least recently used first) until it fits. Left pageable, it tries again after PIN_IDLE_S."""
        pinning = self._pinning
        assert pinning is not None
        self._used[name] = now
        pinned = pinning.pin(arr)
        if not pinned and not pinning.refused:  # (then the budget is what is short)
            for other in sorted(self._used, key=self._used.__getitem__):
                if now - self._used[other] < PIN_IDLE_S or pinning.fits(arr.nbytes):
                    break
                held = self._maps.get(other)
                if other in self._pageable or held is None or sys.getrefcount(held) > _UNVIEWED_REFS:
                    continue  # (not pinned, or a view of it is being read)
                pinning.unpin(held)
                self._pageable[other] = now
            pinned = pinning.pin(arr)
        if pinned:
            self._pageable.pop(name, None)
        else:
            self._pageable[name] = now + PIN_IDLE_S

    def _drop(self, name: str) -> None:
        arr = self._maps.pop(name)
        self._used.pop(name, None)
        self._pageable.pop(name, None)
        if self._pinning is not None:
            self._retired.append(arr)  # unregistered by _unpin_retired once no view is left

    def _unpin_retired(self) -> None:
        """Unregister the dropped mappings no view refers to any more (views are numpy views of the mapping's
        array): their memory must not be unmapped while still registered, nor unregistered under a copy."""
        pinning, keep = self._pinning, []
        assert pinning is not None  # only mappings it pinned are retired
        for arr in self._retired:
            if sys.getrefcount(arr) > _UNVIEWED_REFS:
                keep.append(arr)
            else:
                pinning.unpin(arr)
        self._retired = keep

    def _sweep(self) -> None:
        """Drop the mappings of segments their owner has removed (a worker's receive buffer it let go: names
        are never reused), so that their memory goes back; views still in use keep theirs until they go."""
        for name in [n for n in self._maps if not os.path.exists(os.path.join(SHM_DIR, n))]:
            self._drop(name)
        if self._retired:
            self._unpin_retired()
        self._sweep_at = max(64, 2 * len(self._maps))

    def unmap(self, names: list[str]) -> None:
        """The peer unlinked these segments: drop their mappings now (views still in use keep theirs until they
        go), so that their memory returns."""
        for name in names:
            if name in self._maps:
                self._drop(name)
        if self._retired:
            self._unpin_retired()

    def forget(self, prefix: str) -> None:
        """Drop the mappings of a peer that is gone, and unlink what it left behind."""
        for name in [n for n in self._maps if n.startswith(prefix + "-")]:
            self._drop(name)
        if self._retired:
            self._unpin_retired()
        leftovers.unlink_segments(SHM_DIR, prefix)
        _unlink(prefix + ".lock")
