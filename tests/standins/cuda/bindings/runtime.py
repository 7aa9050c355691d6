"""Stand-in for `cuda.bindings.runtime` whose "device memory" is POSIX shared memory, so CUDA IPC works between
processes: `cudaMalloc` creates a segment, `cudaIpcGetMemHandle` names it in the 64-byte handle, and
`cudaIpcOpenMemHandle` in another process maps it. Every call answers `(error, *values)` as cuda-python does.
Tests only (see tests/standins/README.md): it lets a server's CUDA shared memory paths run between real processes
on a machine without a GPU; the real runtime is exercised by the tests marked `gpu`."""

from __future__ import annotations

import ctypes
import enum
import itertools
import mmap
import os

_DIR = "/dev/shm"
_MAGIC = b"naiad-standin-cuda:"


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorInvalidDevicePointer = 17
    cudaErrorInvalidResourceHandle = 400


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


class cudaMemPoolAttr(enum.IntEnum):
    cudaMemPoolAttrReleaseThreshold = 4


class cuuint64_t(int):
    pass


cudaStreamNonBlocking = 1
cudaIpcMemLazyEnablePeerAccess = 1
cudaHostRegisterPortable = 1


class cudaIpcMemHandle_t:
    def __init__(self):
        self._buf = ctypes.create_string_buffer(64)

    def getPtr(self):
        return ctypes.addressof(self._buf)


_DEVICES = int(os.environ.get("NAIAD_STANDIN_CUDA_DEVICES", "1"))
_ids = itertools.count()
_segments: dict[int, tuple[str, mmap.mmap, ctypes.Array, bool]] = {}  # address -> (name, map, view, owned)
_streams = itertools.count(1)


def _ok(*values):
    return (cudaError_t.cudaSuccess, *values)


def _map(name: str, size: int | None) -> int:
    path = os.path.join(_DIR, name)
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if size is not None else 0), 0o600)
    try:
        if size is not None:
            os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size or os.fstat(fd).st_size)
    finally:
        os.close(fd)
    view = (ctypes.c_char * len(mm)).from_buffer(mm)
    _segments[ctypes.addressof(view)] = (name, mm, view, size is not None)
    return ctypes.addressof(view)


def _unmap(ptr: int) -> bool:
    entry = _segments.pop(int(ptr), None)
    if entry is None:
        return False
    name, mm, owned = entry[0], entry[1], entry[3]
    del entry  # the last reference to the ctypes view, which keeps the map from closing
    mm.close()
    if owned:
        os.unlink(os.path.join(_DIR, name))
    return True


def cudaGetErrorString(err):
    return _ok(cudaError_t(err).name.encode())


def cudaGetDeviceCount():
    return _ok(_DEVICES)


def cudaSetDevice(device):
    return _ok() if 0 <= device < _DEVICES else (cudaError_t.cudaErrorInvalidValue,)


_thresholds: dict[int, int] = {}  # device -> its default memory pool's release threshold


def cudaDeviceGetDefaultMemPool(device):
    return _ok(device) if 0 <= device < _DEVICES else (cudaError_t.cudaErrorInvalidValue, None)


def cudaMemPoolSetAttribute(pool, attr, value):
    _thresholds[int(pool)] = int(value)
    return _ok()


def cudaMemPoolGetAttribute(pool, attr):
    return _ok(_thresholds.get(int(pool), 0))


def cudaMalloc(size):
    return _ok(_map(f"naiad-standin-cuda-{os.getpid()}-{next(_ids)}", max(1, int(size))))


def cudaFree(ptr):
    return _ok() if _unmap(ptr) else (cudaError_t.cudaErrorInvalidDevicePointer,)


def cudaMemcpy(dst, src, size, kind):
    ctypes.memmove(int(dst), int(src), int(size))
    return _ok()


def cudaMemcpyAsync(dst, src, size, kind, stream):
    return cudaMemcpy(dst, src, size, kind)


def cudaStreamCreateWithFlags(flags):
    return _ok(next(_streams))


def cudaStreamSynchronize(stream):
    return _ok()


def cudaStreamDestroy(stream):
    return _ok()


def cudaHostRegister(ptr, size, flags):
    return _ok()


def cudaHostUnregister(ptr):
    return _ok()


def cudaIpcGetMemHandle(ptr):
    entry = _segments.get(int(ptr))
    if entry is None or not entry[3]:
        return (cudaError_t.cudaErrorInvalidDevicePointer, None)
    handle = cudaIpcMemHandle_t()
    raw = (_MAGIC + entry[0].encode()).ljust(64, b"\0")
    ctypes.memmove(handle.getPtr(), raw, 64)
    return _ok(handle)


def cudaIpcOpenMemHandle(handle, flags):
    raw = ctypes.string_at(handle.getPtr(), 64).rstrip(b"\0")
    if not raw.startswith(_MAGIC):
        return (cudaError_t.cudaErrorInvalidResourceHandle, None)
    try:
        return _ok(_map(raw[len(_MAGIC) :].decode(), None))
    except (OSError, UnicodeDecodeError):
        return (cudaError_t.cudaErrorInvalidResourceHandle, None)


def cudaIpcCloseMemHandle(ptr):
    return _ok() if _unmap(ptr) else (cudaError_t.cudaErrorInvalidDevicePointer,)
