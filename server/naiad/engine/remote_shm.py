"""A frontend worker's shared memory managers: registrations (system and CUDA) live in the engine, so every worker
answers the same; a worker maps a system region itself when a request names it, and passes a CUDA region's spans
to the engine, which holds the CUDA IPC mappings (a worker never creates a CUDA context)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ..errors import InvalidArgument
from ..shared_memory.system import Region, SharedMemoryManager
from .calls import EngineCalls
from .wire import CudaSpan


class Control(Protocol):
    """The engine's blocking control calls (`client.ControlChannel`), each named by its `EngineCalls` method."""

    def call(self, method: Callable[..., object], *args: Any) -> Any: ...


class RemoteSharedMemory(SharedMemoryManager):
    """System shared memory through the engine's registrations; `.cuda` is there when the engine serves CUDA
    shared memory (it has a GPU), as on a single-process server. Every mapping and every region's kind is
    forgotten when the engine's registrations change (`drop`, on a new `shm_generation`)."""

    def __init__(self, control: Control, enabled: bool = True):
        super().__init__(enabled)
        self._control = control
        self.generation = 0
        self._cuda_regions: set[str] = set()  # names the engine said are CUDA regions
        cuda = control.call(EngineCalls.cuda_shm_state)  # None, or [enabled, reason] of the engine's manager
        self.cuda = RemoteCudaSharedMemory(self, *cuda) if cuda is not None else None

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.check_enabled()
        self._control.call(EngineCalls.shm_register, name, key, offset, byte_size)
        self.drop()

    def unregister(self, name: str = "") -> None:
        self.check_enabled()
        self._control.call(EngineCalls.shm_unregister, name)
        self.drop()

    def status(self, name: str = "") -> list[dict]:
        self.check_enabled()
        return self._control.call(EngineCalls.shm_status, name)

    def drop(self) -> None:
        with self._lock:
            self._regions.clear()
            self._cuda_regions.clear()

    def _lookup(self, name: Any) -> Region | None:
        """The system region `name` (mapped here), or None when it is a CUDA region; InvalidArgument when the
        engine has neither."""
        with self._lock:
            region = self._regions.get(name)
            if region is not None or name in self._cuda_regions:
                return region
        kind, *where = self._control.call(EngineCalls.shm_lookup, name)
        if kind == "cuda":
            with self._lock:
                self._cuda_regions.add(name)
            return None
        try:
            super().register(name, *where)
        except Exception:
            pass  # registered here meanwhile: use that mapping
        return super()._region(name)

    def _region(self, name: str) -> Region:
        region = self._lookup(name)
        if region is None:  # a CUDA region where only a system one will do
            raise InvalidArgument(f"Unable to find system shared memory region: '{name}'")
        return region

    def read_input(self, name: str, datatype: str, shape: list[int], params: dict) -> Any:
        self.check_enabled()
        if self.cuda is not None and self._lookup(params.get("shared_memory_region")) is None:
            return CudaSpan(datatype, shape, params)  # the engine reads it, checking the span as it does
        return super().read_input(name, datatype, shape, params)

    def write_output(self, out, params: dict) -> None:
        if type(out.data) is CudaSpan:  # the engine wrote it into its CUDA region before replying
            return
        super().write_output(out, params)


class RemoteCudaSharedMemory:
    """The engine's CUDA shared memory registrations (`naiad.shared_memory.cuda`'s interface, as the frontends'
    handlers call it): register, unregister and status are forwarded; `reason` (the engine's, when its CUDA
    runtime is unusable) refuses registration as a single process does."""

    def __init__(self, shm: RemoteSharedMemory, enabled: bool, reason: str | None):
        self._shm = shm
        self._control = shm._control
        self.enabled = enabled
        self.reason = reason

    @property
    def available(self) -> bool:
        return self.enabled and self.reason is None

    def check_enabled(self) -> None:
        self._shm.check_enabled()

    def register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self.check_enabled()
        self._control.call(EngineCalls.cuda_shm_register, name, bytes(raw_handle), device_id, byte_size)
        self._shm.drop()

    def unregister(self, name: str = "") -> None:
        self.check_enabled()
        self._control.call(EngineCalls.cuda_shm_unregister, name)
        self._shm.drop()

    def status(self, name: str = "") -> list[dict]:
        self.check_enabled()
        return self._control.call(EngineCalls.cuda_shm_status, name)
