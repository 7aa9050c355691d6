"""Host and device memory pools (`--pinned-memory-pool-byte-size`, `--cuda-memory-pool-byte-size`): Triton's
flags, parsed and validated once, and a byte budget the GPU backends draw their pinned staging buffers from."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from . import cuda_runtime

DEFAULT_PINNED_BYTES = 268_435_456  # Triton's default: 256 MiB
DEFAULT_CUDA_BYTES = 67_108_864  # Triton's default per GPU: 64 MiB


def parse_cuda_pool(items: list[str], gpu_count: int) -> dict[int, int]:
    """`<gpu>:<bytes>` (repeatable) -> {gpu: bytes}; every present GPU gets Triton's default otherwise."""
    pools = dict.fromkeys(range(gpu_count), DEFAULT_CUDA_BYTES)
    for item in items:
        dev, sep, size = item.partition(":")
        try:
            device, nbytes = int(dev), int(size)
        except ValueError:
            raise ValueError(
                f"invalid --cuda-memory-pool-byte-size '{item}': expected <integer gpu>:<integer bytes>"
            ) from None
        if not sep or device < 0 or nbytes < 0:
            raise ValueError(
                f"invalid --cuda-memory-pool-byte-size '{item}': expected <gpu>:<bytes>, both non-negative"
            )
        pools[device] = nbytes
    return pools


@dataclass
class MemoryPools:
    """Byte budgets. A backend that wants page-locked host memory reserves it here first; when the pool is
    exhausted it falls back to pageable memory (slower copies, never a failed request), as Triton does."""

    pinned_bytes: int = DEFAULT_PINNED_BYTES
    cuda_bytes: dict[int, int] = field(default_factory=dict)
    pinned_used: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if self.pinned_bytes < 0:
            raise ValueError("--pinned-memory-pool-byte-size must be non-negative")

    def pinned_fits(self, nbytes: int) -> bool:
        """Whether `nbytes` more of the pinned pool are free now."""
        return self.pinned_used + nbytes <= self.pinned_bytes

    def reserve_pinned(self, nbytes: int) -> bool:
        with self._lock:
            if not self.pinned_fits(nbytes):
                return False
            self.pinned_used += nbytes
            return True

    def release_pinned(self, nbytes: int) -> None:
        with self._lock:
            self.pinned_used = max(0, self.pinned_used - nbytes)


# The process's pools; the CLI replaces them from its flags before any model loads.
pools = MemoryPools()


def configure(pinned_bytes: int, cuda_bytes: dict[int, int]) -> MemoryPools:
    global pools
    pools = MemoryPools(pinned_bytes, dict(cuda_bytes))
    return pools


def apply_cuda_pools(cuda_bytes: dict[int, int]) -> dict[int, str]:
    """Set each device's default CUDA memory pool to keep up to its byte size cached between stream-ordered
    allocations (cudaMemPoolAttrReleaseThreshold), as Triton sizes its CUDA pool. Returns {gpu: error} for the
    devices where that failed (none without a CUDA runtime: there is nothing to set)."""
    errors: dict[int, str] = {}
    if not cuda_bytes or cuda_runtime.cuda_unavailable_reason() is not None:
        return errors
    rt = cuda_runtime.cudart()
    for device, nbytes in cuda_bytes.items():
        try:
            pool = cuda_runtime.check(
                rt.cudaDeviceGetDefaultMemPool(device), f"cudaDeviceGetDefaultMemPool({device})"
            )
            threshold = _cuuint64(rt, nbytes)
            attr = rt.cudaMemPoolAttr.cudaMemPoolAttrReleaseThreshold
            cuda_runtime.check(rt.cudaMemPoolSetAttribute(pool, attr, threshold), "cudaMemPoolSetAttribute")
        except Exception as exc:  # reported, never fatal: the pool size is a tuning knob
            errors[device] = str(exc)
    return errors


def _cuuint64(rt, value: int):
    """cuda-python 12 has `cuuint64_t` in its runtime module; cuda-bindings 13 only in its driver module."""
    if hasattr(rt, "cuuint64_t"):
        return rt.cuuint64_t(value)
    from cuda.bindings import driver

    return driver.cuuint64_t(value)


def cuda_pool_threshold(device: int) -> int:
    """The release threshold of `device`'s default CUDA memory pool (what apply_cuda_pools set)."""
    rt = cuda_runtime.cudart()
    pool = cuda_runtime.check(
        rt.cudaDeviceGetDefaultMemPool(device), f"cudaDeviceGetDefaultMemPool({device})"
    )
    attr = rt.cudaMemPoolAttr.cudaMemPoolAttrReleaseThreshold
    return int(cuda_runtime.check(rt.cudaMemPoolGetAttribute(pool, attr), "cudaMemPoolGetAttribute"))
