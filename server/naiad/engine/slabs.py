"""Shared-memory slabs for tensor bytes between a frontend worker and the engine: a pool of pre-faulted segments
the sender owns and reuses, and the receiver's cache of mappings it reads in place."""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
MIN_SLAB = 256 * 1024  # the smallest size class; tensors below the inline limit never use a slab
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _size_class(nbytes: int) -> int:
    size = MIN_SLAB
    while size < nbytes:
        size *= 2
    return size


class Slab:
    """One segment of a pool: its name (how the peer maps it) and the writable mapping."""

    __slots__ = ("array", "map", "name", "size")

    def __init__(self, name: str, size: int):
        self.name = name
        self.size = size
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size, mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self.map, np.uint8)
        self.array[::4096] = 0  # touch every page now, not on the first request that lands here


class SlabPool:
    """Segments named `<prefix>-<n>` in size classes of powers of two; `free` returns one for reuse. Bounded by
    the largest number of bytes ever in flight at once (connections x the largest request)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._free: dict[int, list[Slab]] = {}
        self._all: dict[str, Slab] = {}
        self._refs: dict[str, int] = {}  # users of an allocated slab: the peer, and views of it here
        self._lock = threading.Lock()  # `free` may run in a finalizer on any thread

    def alloc(self, nbytes: int) -> Slab:
        size = _size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            if free:
                slab = free.pop()
                self._refs[slab.name] = 1
                return slab
            name = f"{self.prefix}-{len(self._all)}"
        slab = Slab(name, size)
        with self._lock:
            self._all[name] = slab
            self._refs[name] = 1
        return slab

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
            else:
                del self._refs[name]
                self._free.setdefault(slab.size, []).append(slab)

    def close(self) -> None:
        """Unlink every segment (the mappings stay valid until the process exits)."""
        for name in list(self._all):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass


class SlabMaps:
    """The receiver's mappings of a peer's segments, made on first sight and kept (the pool reuses names)."""

    def __init__(self) -> None:
        self._maps: dict[str, np.ndarray] = {}

    def view(self, name: str) -> np.ndarray:
        arr = self._maps.get(name)
        if arr is None:
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                mm = mmap.mmap(fd, size, mmap.MAP_SHARED | _POPULATE, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
            arr = self._maps[name] = np.frombuffer(mm, np.uint8)
        return arr

    def forget(self, prefix: str) -> None:
        """Drop the mappings of a peer that is gone, and unlink what it left behind."""
        for name in [n for n in self._maps if n.startswith(prefix + "-")]:
            del self._maps[name]
        for entry in os.listdir(SHM_DIR):
            if entry.startswith(prefix + "-"):
                try:
                    os.unlink(os.path.join(SHM_DIR, entry))
                except OSError:
                    pass
