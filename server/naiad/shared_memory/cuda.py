"""CUDA shared memory (Triton's `cuda_shared_memory` extension): registered CUDA IPC regions and their tensors.

CUDA shared memory follows Triton's protocol: a client allocates device memory, exports it with
`cudaIpcGetMemHandle`, and registers the 64-byte raw handle (base64 in HTTP's `{"raw_handle": {"b64": ...}}`,
bytes over gRPC) with its device id and byte size. The server maps it with `cudaIpcOpenMemHandle`; an input
in a region is checked when the request is decoded and copied once when the model is known: device->host for
every model but those that take GPU inputs (a python model with `FORCE_CPU_ONLY_INPUT_TENSORS: "no"`, an ensemble),
device->device into a tensor of the server's own for those (`CudaInput`). An output is copied host->device once
when the response is encoded. Regions share one name space with system shared memory regions, as in Triton.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass, field

import numpy as np

from .. import cuda_runtime, tensors
from ..errors import AlreadyExists, InvalidArgument, NotFound
from .system import SharedMemoryManager, check_span

log = logging.getLogger("naiad.gpu")

IPC_HANDLE_SIZE = 64  # sizeof(cudaIpcMemHandle_t)


@dataclass
class CudaRegion:
    name: str
    device_id: int
    byte_size: int
    pointer: int  # base of the mapping cudaIpcOpenMemHandle returned
    lock: threading.Lock = field(default_factory=threading.Lock)
    closed: bool = False

    def status(self) -> dict:
        return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}


class CudaSharedMemoryManager:
    """Registered CUDA IPC regions. `reason` (why CUDA is not usable here) keeps the no-GPU behaviour:
    status lists nothing, registration is refused with that reason, unregistering is a no-op."""

    def __init__(self, enabled: bool = True, reason: str | None = None, taken=None):
        self.enabled = enabled
        self.reason = reason
        self._taken = taken or (lambda name: False)  # is `name` a system shared memory region?
        self._regions: dict[str, CudaRegion] = {}
        self._lock = threading.Lock()
        self._streams: dict[int, object] = {}

    @property
    def available(self) -> bool:
        return self.enabled and self.reason is None

    def check_enabled(self) -> None:
        if not self.enabled:
            raise InvalidArgument("shared memory support is disabled on this server (--allow-client-shm)")

    def has(self, name) -> bool:
        with self._lock:
            return name in self._regions

    # ---- registration ----
    def register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self.check_enabled()
        if self.reason is not None:
            raise InvalidArgument(self.reason)
        if not name:
            raise InvalidArgument("cuda shared memory region name must not be empty")
        for key, value in (("device_id", device_id), ("byte_size", byte_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"cuda shared memory '{key}' must be a non-negative integer")
        if byte_size == 0:
            raise InvalidArgument("cuda shared memory 'byte_size' must be greater than zero")
        if not isinstance(raw_handle, (bytes, bytearray)) or len(raw_handle) != IPC_HANDLE_SIZE:
            got = len(raw_handle) if isinstance(raw_handle, (bytes, bytearray)) else type(raw_handle).__name__
            raise InvalidArgument(
                f"cuda shared memory region '{name}': 'raw_handle' must be a {IPC_HANDLE_SIZE}-byte "
                f"cudaIpcMemHandle_t (got {got})"
            )
        with self._lock:
            if name in self._regions or self._taken(name):
                raise AlreadyExists(f"shared memory region '{name}' already in manager")
        rt = cuda_runtime.cudart()
        count = cuda_runtime.check(rt.cudaGetDeviceCount(), "cudaGetDeviceCount")
        if device_id >= count:
            raise InvalidArgument(
                f"cuda shared memory region '{name}': device {device_id} does not exist "
                f"({count} CUDA device(s) visible)"
            )
        handle = rt.cudaIpcMemHandle_t()
        ctypes.memmove(int(handle.getPtr()), bytes(raw_handle), IPC_HANDLE_SIZE)
        cuda_runtime.set_device(device_id)
        err, *rest = rt.cudaIpcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess)
        if err != rt.cudaError_t.cudaSuccess:
            raise InvalidArgument(
                f"failed to register CUDA shared memory region '{name}': cudaIpcOpenMemHandle on device "
                f"{device_id} failed ({getattr(err, 'name', err)}); the handle must come from "
                "cudaIpcGetMemHandle in another process on this machine"
            )
        pointer = int(rest[0])
        mapped = cuda_runtime.allocation_size(pointer)
        if mapped is not None and byte_size > mapped:
            rt.cudaIpcCloseMemHandle(pointer)
            raise InvalidArgument(
                f"cuda shared memory region '{name}': byte_size {byte_size} exceeds the {mapped}-byte "
                "allocation the handle refers to"
            )
        with self._lock:
            if name in self._regions or self._taken(name):
                rt.cudaIpcCloseMemHandle(pointer)
                raise AlreadyExists(f"shared memory region '{name}' already in manager")
            self._regions[name] = CudaRegion(name, device_id, byte_size, pointer)

    def unregister(self, name: str = "") -> None:
        """Forget one region (all with an empty name) and close its IPC mapping once no copy uses it."""
        self.check_enabled()
        with self._lock:
            if name:
                gone = [self._regions.pop(name)] if name in self._regions else []
            else:
                gone, self._regions = list(self._regions.values()), {}
        for region in gone:
            self._close(region)

    def _close(self, region: CudaRegion) -> None:
        with region.lock:
            if region.closed:
                return
            region.closed = True
            try:
                rt = cuda_runtime.cudart()
                cuda_runtime.set_device(region.device_id)
                cuda_runtime.check(rt.cudaIpcCloseMemHandle(region.pointer), "cudaIpcCloseMemHandle")
            except Exception as exc:
                log.warning("closing CUDA shared memory region '%s': %s", region.name, exc)

    def close(self) -> None:
        if self.enabled:
            self.unregister("")

    def status(self, name: str = "") -> list[dict]:
        self.check_enabled()
        with self._lock:
            if name:
                region = self._regions.get(name)
                if region is None:
                    raise NotFound(f"Unable to find cuda shared memory region: '{name}'")
                return [region.status()]
            return [r.status() for r in self._regions.values()]

    # ---- tensors ----
    def _span(self, params: dict, needed: int | None) -> tuple[CudaRegion, int, int]:
        name = params.get("shared_memory_region")
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise InvalidArgument(f"Unable to find shared memory region: '{name}'")
        offset, size = check_span(region.name, region.byte_size, params, needed)
        return region, offset, size

    def _stream(self, device_id: int):
        """One non-blocking stream per device for the copies (the current device is `device_id`)."""
        with self._lock:
            stream = self._streams.get(device_id)
            if stream is None:
                rt = cuda_runtime.cudart()
                stream = cuda_runtime.check(
                    rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags"
                )
                self._streams[device_id] = stream
            return stream

    def _copy(self, region: CudaRegion, dst: int, src: int, size: int, kind_name: str) -> None:
        rt = cuda_runtime.cudart()
        with region.lock:
            if region.closed:
                raise InvalidArgument(f"cuda shared memory region '{region.name}' was unregistered")
            cuda_runtime.set_device(region.device_id)
            stream = self._stream(region.device_id)
            kind = getattr(rt.cudaMemcpyKind, kind_name)
            cuda_runtime.check(rt.cudaMemcpyAsync(dst, src, size, kind, stream), "cudaMemcpyAsync")
            cuda_runtime.check(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def read_input(self, name: str, datatype: str, shape: list[int], params: dict) -> np.ndarray | CudaInput:
        """BYTES: the tensor, copied device->host now. Other types: checked now, copied when the model is known."""
        self.check_enabled()
        region, offset, size = self._span(params, None)
        count = tensors.element_count(shape)
        if datatype != "BYTES":
            dt = tensors.numpy_dtype(datatype)
            if size != count * dt.itemsize:
                raise InvalidArgument(
                    f"input '{name}': shared memory byte size {size} does not match the tensor's "
                    f"{count * dt.itemsize} bytes ({count} {datatype} elements)"
                )
            return CudaInput(self, region, offset, size, datatype, tuple(shape))
        host = np.empty(size, dtype=np.uint8)
        if size:
            self._copy(region, host.ctypes.data, region.pointer + offset, size, "cudaMemcpyDeviceToHost")
        return tensors.deserialize_bytes(host.tobytes(), count).reshape(shape)

    def write_output(self, out, params: dict) -> dict:
        """Copy an output host->device into its region; returns the response parameters describing it."""
        self.check_enabled()
        data = np.frombuffer(tensors.to_bytes(out.data, out.datatype), dtype=np.uint8)
        region, offset, _ = self._span(params, data.nbytes)
        if data.nbytes:
            data = np.ascontiguousarray(data)
            self._copy(
                region, region.pointer + offset, data.ctypes.data, data.nbytes, "cudaMemcpyHostToDevice"
            )
        result = {"shared_memory_region": region.name, "shared_memory_byte_size": int(data.nbytes)}
        if params.get("shared_memory_offset"):
            result["shared_memory_offset"] = params["shared_memory_offset"]
        return result


@dataclass
class CudaInput:
    """An input tensor in a CUDA shared-memory region, not read yet (request.device_inputs says one is there):
    `Server.infer` turns it into host memory or into a device tensor once it knows the model."""

    manager: CudaSharedMemoryManager
    region: CudaRegion
    offset: int
    size: int
    datatype: str
    shape: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> np.dtype:
        return tensors.numpy_dtype(self.datatype)

    @property
    def nbytes(self) -> int:
        return self.size

    def to_host(self) -> np.ndarray:
        """Device->host, once (what every model that does not take GPU inputs gets)."""
        host = np.empty(self.size, dtype=np.uint8)
        if self.size:
            src = self.region.pointer + self.offset
            self.manager._copy(self.region, host.ctypes.data, src, self.size, "cudaMemcpyDeviceToHost")
        return host.view(self.dtype).reshape(self.shape)

    def to_device(self):
        """Device->device into a tensor the server owns on the region's GPU (the client may reuse its region as
        soon as the response is back; the model may keep its input longer)."""
        import torch

        from ..device_tensors import DeviceTensor

        data = torch.empty(self.size, dtype=torch.uint8, device=f"cuda:{self.region.device_id}")
        if self.size:
            src = self.region.pointer + self.offset
            self.manager._copy(self.region, data.data_ptr(), src, self.size, "cudaMemcpyDeviceToDevice")
        dtype = torch.bfloat16 if self.datatype == "BF16" else torch.from_numpy(np.empty(0, self.dtype)).dtype
        return DeviceTensor(data.view(dtype).reshape(self.shape))


class SharedMemoryManagerWithCuda(SharedMemoryManager):
    """System shared memory plus `.cuda`: tensors in CUDA regions go to the CUDA manager."""

    def __init__(self, enabled: bool = True, reason: str | None = None):
        super().__init__(enabled=enabled)
        self.cuda = CudaSharedMemoryManager(enabled, reason, taken=self._system_has)

    def _system_has(self, name) -> bool:
        with self._lock:
            return name in self._regions

    def register(self, name, key, offset, byte_size):
        if self.cuda.has(name):
            raise AlreadyExists(f"shared memory region '{name}' already in manager")
        return super().register(name, key, offset, byte_size)

    def read_input(self, name, datatype, shape, params):
        if self.cuda.has(params.get("shared_memory_region")):
            return self.cuda.read_input(name, datatype, shape, params)
        return super().read_input(name, datatype, shape, params)

    def write_output(self, out, params):
        if self.cuda.has(params.get("shared_memory_region")):
            return self.cuda.write_output(out, params)
        return super().write_output(out, params)
