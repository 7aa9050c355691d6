"""GPU support: device discovery (NVML), the CUDA runtime (cuda-python), and the CUDA shared memory extension.

Nothing here needs a GPU to import. `device_count()` is 0 when there is no driver, no `nvidia-ml-py` or no
device; the CUDA runtime is imported only when something asks for it, and a missing package is reported as
an `Unavailable` error that says what to install.

CUDA shared memory follows Triton's protocol: a client allocates device memory, exports it with
`cudaIpcGetMemHandle`, and registers the 64-byte raw handle (base64 in HTTP's `{"raw_handle": {"b64": ...}}`,
bytes over gRPC) with its device id and byte size. The server maps it with `cudaIpcOpenMemHandle`; an input
in a region is copied device->host once when the request is decoded, an output is copied host->device once
when the response is encoded. Regions share one name space with system shared memory regions, as in Triton.
"""

from __future__ import annotations

import base64
import binascii
import ctypes
import logging
import os
import threading
from dataclasses import dataclass, field

import numpy as np

from . import tensors
from .errors import AlreadyExists, Internal, InvalidArgument, NotFound, Unavailable
from .frontends.shm import SharedMemoryManager, _int_param

log = logging.getLogger("naiad.gpu")

IPC_HANDLE_SIZE = 64  # sizeof(cudaIpcMemHandle_t)
EXTENSION = "cuda_shared_memory"
NO_DEVICE = "CUDA shared memory is not supported by this server: it needs a CUDA device"


# ---- device discovery ----


def _visible_devices(physical: int) -> int:
    """How many of `physical` devices CUDA_VISIBLE_DEVICES leaves visible (CUDA's rules: the list stops at
    the first entry that names no device; an empty value hides them all)."""
    value = os.environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return physical
    seen: list[str] = []
    for entry in value.split(","):
        entry = entry.strip()
        if entry.isdigit() and int(entry) < physical:
            key = str(int(entry))
        elif entry.startswith(("GPU-", "MIG-")):
            key = entry
        else:
            break
        if key in seen:
            break
        seen.append(key)
    return min(len(seen), physical)


def _nvml():
    import pynvml  # from nvidia-ml-py

    pynvml.nvmlInit()
    return pynvml


def _shutdown(nvml) -> None:
    try:
        nvml.nvmlShutdown()
    except Exception as exc:
        log.debug("nvmlShutdown: %s", exc)


def device_count() -> int:
    """Number of CUDA devices this process may use (NVML's count limited by CUDA_VISIBLE_DEVICES); 0 when
    NVML is missing or fails, never an exception."""
    try:
        nvml = _nvml()
    except Exception as exc:
        log.debug("NVML unavailable, assuming no GPU: %s", exc)
        return 0
    try:
        return _visible_devices(int(nvml.nvmlDeviceGetCount()))
    except Exception as exc:
        log.debug("NVML device count failed, assuming no GPU: %s", exc)
        return 0
    finally:
        _shutdown(nvml)


def devices() -> list[dict]:
    """NVML's view of the physical devices: index, uuid, name and total memory; [] without NVML."""
    try:
        nvml = _nvml()
    except Exception:
        return []
    out = []
    try:
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid, name = nvml.nvmlDeviceGetUUID(h), nvml.nvmlDeviceGetName(h)
            out.append(
                {
                    "index": i,
                    "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                    "name": name.decode() if isinstance(name, bytes) else name,
                    "memory_total_bytes": int(nvml.nvmlDeviceGetMemoryInfo(h).total),
                }
            )
    except Exception as exc:
        log.debug("NVML query failed: %s", exc)
    finally:
        _shutdown(nvml)
    return out


# ---- CUDA runtime (cuda-python) ----


def cudart():
    """The CUDA runtime bindings: `cuda.bindings.runtime` (cuda-python >= 12.6) or the older `cuda.cudart`."""
    try:
        from cuda.bindings import runtime

        return runtime
    except ImportError:
        pass
    try:
        from cuda import cudart as runtime

        return runtime
    except ImportError:
        raise Unavailable(
            "CUDA support needs the 'cuda-python' package: pip install 'naiad[tensorrt]' (or cuda-python>=12)"
        ) from None


def check(result, what: str):
    """Unpack a cuda-python call's `(error, *values)`; raise Internal naming the call on failure."""
    rt = cudart()
    if isinstance(result, tuple):
        err, values = result[0], result[1:]
    else:
        err, values = result, ()
    if err != rt.cudaError_t.cudaSuccess:
        try:
            _, text = rt.cudaGetErrorString(err)
            text = text.decode() if isinstance(text, bytes) else str(text)
        except Exception:
            text = str(err)
        raise Internal(f"{what} failed: {text} ({getattr(err, 'name', err)})")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def cuda_unavailable_reason() -> str | None:
    """None when CUDA really works here (cuda-python imports and sees a device), else why not."""
    try:
        rt = cudart()
    except Unavailable as exc:
        return exc.message
    try:
        n = check(rt.cudaGetDeviceCount(), "cudaGetDeviceCount")
    except Exception as exc:
        return f"CUDA shared memory is not supported by this server: the CUDA runtime reports {exc}"
    if not n:
        return NO_DEVICE
    return None


def set_device(device_id: int) -> None:
    rt = cudart()
    check(rt.cudaSetDevice(device_id), f"cudaSetDevice({device_id})")


# ---- CUDA shared memory ----


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

    def _check_enabled(self) -> None:
        if not self.enabled:
            raise InvalidArgument("shared memory support is disabled on this server (--allow-client-shm)")

    def has(self, name) -> bool:
        with self._lock:
            return name in self._regions

    # ---- registration ----
    def register(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> None:
        self._check_enabled()
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
        rt = cudart()
        count = check(rt.cudaGetDeviceCount(), "cudaGetDeviceCount")
        if device_id >= count:
            raise InvalidArgument(
                f"cuda shared memory region '{name}': device {device_id} does not exist "
                f"({count} CUDA device(s) visible)"
            )
        handle = rt.cudaIpcMemHandle_t()
        ctypes.memmove(int(handle.getPtr()), bytes(raw_handle), IPC_HANDLE_SIZE)
        set_device(device_id)
        err, *rest = rt.cudaIpcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess)
        if err != rt.cudaError_t.cudaSuccess:
            raise InvalidArgument(
                f"failed to register CUDA shared memory region '{name}': cudaIpcOpenMemHandle on device "
                f"{device_id} failed ({getattr(err, 'name', err)}); the handle must come from "
                "cudaIpcGetMemHandle in another process on this machine"
            )
        pointer = int(rest[0])
        mapped = _allocation_size(pointer)
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
        self._check_enabled()
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
                rt = cudart()
                set_device(region.device_id)
                check(rt.cudaIpcCloseMemHandle(region.pointer), "cudaIpcCloseMemHandle")
            except Exception as exc:
                log.warning("closing CUDA shared memory region '%s': %s", region.name, exc)

    def close(self) -> None:
        if self.enabled:
            self.unregister("")

    def status(self, name: str = "") -> list[dict]:
        self._check_enabled()
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
        size = _int_param(params, "shared_memory_byte_size")
        offset = _int_param(params, "shared_memory_offset", 0)
        if offset + size > region.byte_size:
            raise InvalidArgument(
                f"shared memory region '{region.name}': offset {offset} + byte size {size} is past the end "
                f"of the registered region ({region.byte_size} bytes)"
            )
        if needed is not None and size < needed:
            raise InvalidArgument(
                f"shared memory region '{region.name}' holds {size} bytes, the tensor needs {needed}"
            )
        return region, offset, size

    def _stream(self, device_id: int):
        """One non-blocking stream per device for the copies (the current device is `device_id`)."""
        with self._lock:
            stream = self._streams.get(device_id)
            if stream is None:
                rt = cudart()
                stream = check(
                    rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags"
                )
                self._streams[device_id] = stream
            return stream

    def _copy(self, region: CudaRegion, dst: int, src: int, size: int, kind_name: str) -> None:
        rt = cudart()
        with region.lock:
            if region.closed:
                raise InvalidArgument(f"cuda shared memory region '{region.name}' was unregistered")
            set_device(region.device_id)
            stream = self._stream(region.device_id)
            kind = getattr(rt.cudaMemcpyKind, kind_name)
            check(rt.cudaMemcpyAsync(dst, src, size, kind, stream), "cudaMemcpyAsync")
            check(rt.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def read_input(self, name: str, datatype: str, shape: list[int], params: dict) -> np.ndarray:
        """The tensor's bytes, copied device->host once."""
        self._check_enabled()
        region, offset, size = self._span(params, None)
        count = tensors.element_count(shape)
        if datatype != "BYTES":
            dt = tensors.numpy_dtype(datatype)
            if size != count * dt.itemsize:
                raise InvalidArgument(
                    f"input '{name}': shared memory byte size {size} does not match the tensor's "
                    f"{count * dt.itemsize} bytes ({count} {datatype} elements)"
                )
        host = np.empty(size, dtype=np.uint8)
        if size:
            self._copy(region, host.ctypes.data, region.pointer + offset, size, "cudaMemcpyDeviceToHost")
        if datatype == "BYTES":
            return tensors.deserialize_bytes(host.tobytes(), count).reshape(shape)
        return host.view(dt).reshape(shape)

    def write_output(self, out, params: dict) -> dict:
        """Copy an output host->device into its region; returns the response parameters describing it."""
        self._check_enabled()
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

    # ---- HTTP: /v2/cudasharedmemory/... ----
    async def handle_http(self, request):
        import orjson
        from aiohttp import web

        region = request.match_info.get("region", "")
        if request.method == "GET":
            if not self.available:
                self._check_enabled()
                if region:
                    raise NotFound(f"Unable to find cuda shared memory region: '{region}'")
                return web.Response(body=b"[]", content_type="application/json")
            return web.Response(body=orjson.dumps(self.status(region)), content_type="application/json")
        self._check_enabled()
        if self.reason is not None:  # as without a GPU: every POST is refused with the reason
            raise InvalidArgument(self.reason)
        if request.path.endswith("/register"):
            body = await request.read()
            try:
                doc = orjson.loads(body) if body else {}
            except orjson.JSONDecodeError as exc:
                raise InvalidArgument(f"failed to parse the request JSON buffer: {exc}") from None
            if not isinstance(doc, dict):
                raise InvalidArgument("the request body must be a JSON object")
            self.register(
                region, _b64_handle(doc.get("raw_handle")), doc.get("device_id", 0), doc.get("byte_size", 0)
            )
            return web.Response(status=200)
        self.unregister(region)
        return web.Response(status=200)

    # ---- gRPC adapters ----
    def status_grpc(self, request):
        from tritonclient.grpc import service_pb2 as pb

        resp = pb.CudaSharedMemoryStatusResponse()
        if not self.available:
            self._check_enabled()
            if request.name:
                raise NotFound(f"Unable to find cuda shared memory region: '{request.name}'")
            return resp
        for s in self.status(request.name):
            r = resp.regions[s["name"]]
            r.name, r.device_id, r.byte_size = s["name"], s["device_id"], s["byte_size"]
        return resp

    def register_grpc(self, request):
        from tritonclient.grpc import service_pb2 as pb

        self.register(request.name, bytes(request.raw_handle), request.device_id, request.byte_size)
        return pb.CudaSharedMemoryRegisterResponse()

    def unregister_grpc(self, request):
        from tritonclient.grpc import service_pb2 as pb

        if self.available:
            self.unregister(request.name)
        else:
            self._check_enabled()
        return pb.CudaSharedMemoryUnregisterResponse()


def _b64_handle(raw) -> bytes:
    """HTTP's `"raw_handle": {"b64": "<base64 of the 64-byte cudaIpcMemHandle_t>"}`."""
    if not isinstance(raw, dict) or not isinstance(raw.get("b64"), str):
        raise InvalidArgument(
            "cuda shared memory registration needs 'raw_handle': {\"b64\": <base64 handle>}"
        )
    try:
        return base64.b64decode(raw["b64"], validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument("cuda shared memory 'raw_handle.b64' is not valid base64") from None


def _allocation_size(pointer: int) -> int | None:
    """Size of the device allocation `pointer` starts in (driver API), or None when that cannot be asked."""
    try:
        try:
            from cuda.bindings import driver
        except ImportError:
            from cuda import cuda as driver
        err, base, size = driver.cuMemGetAddressRange(pointer)
        if err != driver.CUresult.CUDA_SUCCESS:
            return None
        return int(size) - (pointer - int(base))
    except Exception:
        return None


# ---- wiring: one shared memory manager for both kinds ----


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


def shared_memory_manager(server=None, enabled: bool = True):
    """The frontends' shared memory manager. Without a GPU: today's system-only manager (CUDA endpoints keep
    answering `[]` and refusing registration). With one: CUDA regions too, and `cuda_shared_memory` is listed
    in the server's extensions only when cuda-python imports and sees the device."""
    if not enabled or device_count() == 0:
        return SharedMemoryManager(enabled=enabled)
    reason = cuda_unavailable_reason()
    if reason is not None:
        log.warning("GPU present but CUDA shared memory is unavailable: %s", reason)
    manager = SharedMemoryManagerWithCuda(enabled, reason)
    if reason is None and server is not None and EXTENSION not in server.extensions:
        exts = server.extensions
        at = exts.index("system_shared_memory") + 1 if "system_shared_memory" in exts else len(exts)
        exts.insert(at, EXTENSION)
    return manager
