"""Shared memory regions clients register (system and CUDA, one name space), and the manager a server gets.

`system` holds POSIX shm regions, `cuda` CUDA IPC regions; their HTTP and gRPC handlers are in
`naiad.frontends.triton.shm`.
"""

from __future__ import annotations

import logging

from .. import cuda_runtime, gpu
from .cuda import SharedMemoryManagerWithCuda
from .system import SharedMemoryManager

log = logging.getLogger("naiad.gpu")

EXTENSION = "cuda_shared_memory"


def shared_memory_manager(server=None, enabled: bool = True) -> SharedMemoryManager:
    """The frontends' shared memory manager. Without a GPU: today's system-only manager (CUDA endpoints keep
    answering `[]` and refusing registration). With one: CUDA regions too, and `cuda_shared_memory` is listed
    in the server's extensions only when cuda-python imports and sees the device."""
    if not enabled or gpu.device_count() == 0:
        return SharedMemoryManager(enabled=enabled)
    reason = cuda_runtime.cuda_unavailable_reason()
    if reason is not None:
        log.warning("GPU present but CUDA shared memory is unavailable: %s", reason)
    manager = SharedMemoryManagerWithCuda(enabled, reason)
    if reason is None and server is not None and EXTENSION not in server.extensions:
        exts = server.extensions
        at = exts.index("system_shared_memory") + 1 if "system_shared_memory" in exts else len(exts)
        exts.insert(at, EXTENSION)
    return manager
