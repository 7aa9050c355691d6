"""Page-locked request buffers: on a GPU machine the server's long-lived receive buffers (and, under frontend
workers, the engine's mappings of the workers' segments) are registered with cudaHostRegister, within half of
`--pinned-memory-pool-byte-size`, so that a GPU model's copy of a request's tensor to the device is DMA.

Measured on an H100 (bench/host_to_device.py): 18.4 MiB from pageable memory 1.35 ms, from the same memory once
registered 0.37 ms; registering it once costs 1.4 ms, so only buffers that are reused are registered. A buffer that
cannot be registered (the pool's bytes used up, a refusing driver) stays pageable: slower copies, never a failed
request, as Triton falls back when its pinned pool is exhausted.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from . import cuda_runtime, memory

log = logging.getLogger("naiad.memory")


def address_of(buf) -> tuple[int, int]:
    """The address and length of a buffer's memory (a mapping, bytes-like, or numpy array)."""
    arr = np.frombuffer(buf, np.uint8)
    return arr.ctypes.data, arr.nbytes


class HostPinning:
    """Registers buffers with the CUDA runtime once each, drawing their bytes from the pinned memory pool, and
    unregisters them before their memory goes."""

    def __init__(self, runtime, pools: memory.MemoryPools):
        self.rt = runtime  # cuda.bindings.runtime (or cuda.cudart)
        self.pools = pools
        # request buffers take at most half of the pinned pool: the rest stays for the GPU backends' staging
        # buffers (TensorRT's), which would otherwise find it taken by whichever requests came first
        self.limit = pools.pinned_bytes // 2
        self.pinned: dict[int, int] = {}  # address -> bytes
        self.pinned_bytes = 0  # their sum
        self._lock = threading.Lock()
        self._refused = False  # the driver refused once: said once, not tried again
        self._told_full = False  # the budget ran short once: said once

    def pin(self, buf) -> bool:
        """Page-lock `buf` (idempotent); False when it stays pageable."""
        addr, n = address_of(buf)
        with self._lock:
            if addr in self.pinned:
                return True
            if self._refused:
                return False
            if self.pinned_bytes + n > self.limit or not self.pools.reserve_pinned(n):
                if not self._told_full:
                    self._told_full = True
                    log.info(
                        "request buffers past %d MiB stay pageable (half of --pinned-memory-pool-byte-size is "
                        "theirs); a larger pool page-locks more of them",
                        self.limit >> 20,
                    )
                return False
            err = self.rt.cudaHostRegister(addr, n, getattr(self.rt, "cudaHostRegisterPortable", 1))
            err = err[0] if isinstance(err, tuple) else err
            if err != self.rt.cudaError_t.cudaSuccess:
                self.pools.release_pinned(n)
                self._refused = True
                log.warning(
                    "request buffers stay pageable: cudaHostRegister failed (%s)", getattr(err, "name", err)
                )
                return False
            self.pinned[addr] = n
            self.pinned_bytes += n
            log.debug("page-locked a request buffer of %d bytes for copies to the GPU", n)
            return True

    @property
    def refused(self) -> bool:
        """The driver refused a registration: nothing more is page-locked."""
        return self._refused

    def fits(self, n: int) -> bool:
        """Whether `n` more bytes are within the budget and the pool now."""
        with self._lock:
            return self.pinned_bytes + n <= self.limit and self.pools.pinned_fits(n)

    def unpin(self, buf) -> None:
        """Undo `pin` (nothing when `buf` was not pinned); before the buffer's memory is unmapped."""
        addr, _ = address_of(buf)
        with self._lock:
            n = self.pinned.pop(addr, None)
            if n is None:
                return
            self.pinned_bytes -= n
            self.rt.cudaHostUnregister(addr)
            self.pools.release_pinned(n)


def for_gpus(gpu_count: int) -> HostPinning | None:
    """Pinning for this process when it serves GPUs (NVML saw some), the CUDA runtime works and the pinned pool
    has bytes; else None (nothing is registered, nothing changes)."""
    if gpu_count <= 0 or memory.pools.pinned_bytes <= 0:
        return None
    reason = cuda_runtime.cuda_unavailable_reason()
    if reason is not None:
        log.info("request buffers stay pageable: %s", reason)
        return None
    return HostPinning(cuda_runtime.cudart(), memory.pools)
