"""System shared memory (Triton's `system_shared_memory` extension): registered POSIX shm regions, tensors in place.

A region key must name a POSIX shared-memory object (what `shm_open` takes, e.g. "/input0"), never a file path.
Unregistering while a request still reads a region is safe: the mapping stays alive until the last numpy view
over it is gone.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import threading
from dataclasses import dataclass

import numpy as np

from .. import tensors
from ..errors import AlreadyExists, InvalidArgument, NotFound
from ..inference import OutputTensor

SHM_DIR = "/dev/shm"
_KEY = re.compile(r"^/?[A-Za-z0-9_.\-]{1,250}$")


@dataclass
class Region:
    name: str
    key: str
    offset: int
    byte_size: int
    buffer: mmap.mmap

    def status(self) -> dict:
        return {"name": self.name, "key": self.key, "offset": self.offset, "byte_size": self.byte_size}


def int_param(params: dict, key: str, default: int | None = None) -> int:
    """A tensor's `shared_memory_*` parameter as a non-negative integer."""
    value = params.get(key, default)
    if value is None:
        raise InvalidArgument(f"shared memory parameter '{key}' is required")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(f"shared memory parameter '{key}' must be a non-negative integer")
    return value


def check_span(region: str, byte_size: int, params: dict, needed: int | None) -> tuple[int, int]:
    """(offset, size) of a tensor's span in a region of `byte_size` bytes, from its `shared_memory_*`
    parameters; the span must lie inside the region and hold `needed` bytes when that is given."""
    size = int_param(params, "shared_memory_byte_size")
    offset = int_param(params, "shared_memory_offset", 0)
    if offset + size > byte_size:
        raise InvalidArgument(
            f"shared memory region '{region}': offset {offset} + byte size {size} is past the end of "
            f"the registered region ({byte_size} bytes)"
        )
    if needed is not None and size < needed:
        raise InvalidArgument(
            f"shared memory region '{region}' holds {size} bytes, the tensor needs {needed}"
        )
    return offset, size


class SharedMemoryManager:
    """Registered system shared memory regions, and tensors read from and written to them."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    def check_enabled(self) -> None:
        if not self.enabled:
            raise InvalidArgument("shared memory support is disabled on this server (--allow-client-shm)")

    # ---- registration ----
    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.check_enabled()
        if not name:
            raise InvalidArgument("shared memory region name must not be empty")
        if not isinstance(key, str) or not _KEY.match(key) or key.strip("/") in (".", ".."):
            raise InvalidArgument(
                f"invalid shared memory key '{key}': it must name a POSIX shared memory "
                "object such as '/my_region' (letters, digits, '_', '-', '.')"
            )
        for field, value in (("offset", offset), ("byte_size", byte_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidArgument(f"shared memory '{field}' must be a non-negative integer")
        if byte_size == 0:
            raise InvalidArgument("shared memory 'byte_size' must be greater than zero")
        with self._lock:
            if name in self._regions:
                raise AlreadyExists(f"shared memory region '{name}' already in manager")
        path = os.path.join(SHM_DIR, key.lstrip("/"))
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise InvalidArgument(f"Unable to open shared memory region: '{key}'") from None
        except OSError as exc:
            raise InvalidArgument(f"Unable to open shared memory region '{key}': {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidArgument(f"shared memory key '{key}' is not a shared memory object")
            if offset + byte_size > st.st_size:
                raise InvalidArgument(
                    f"shared memory region '{name}': offset {offset} + byte_size {byte_size} exceeds the "
                    f"size of '{key}' ({st.st_size} bytes)"
                )
            buf = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        with self._lock:
            if name in self._regions:
                buf.close()
                raise AlreadyExists(f"shared memory region '{name}' already in manager")
            self._regions[name] = Region(name, key, offset, byte_size, buf)

    def unregister(self, name: str = "") -> None:
        """Forget one region (or all with an empty name). Mappings close when no request uses them."""
        self.check_enabled()
        with self._lock:
            if name:
                self._regions.pop(name, None)
            else:
                self._regions.clear()

    def status(self, name: str = "") -> list[dict]:
        self.check_enabled()
        with self._lock:
            if name:
                region = self._regions.get(name)
                if region is None:
                    raise NotFound(f"Unable to find system shared memory region: '{name}'")
                return [region.status()]
            return [r.status() for r in self._regions.values()]

    def _region(self, name: str) -> Region:
        with self._lock:
            region = self._regions.get(name)
        if region is None:
            raise InvalidArgument(f"Unable to find shared memory region: '{name}'")
        return region

    def _span(self, params: dict, needed: int | None) -> tuple[Region, int, int]:
        region = self._region(params.get("shared_memory_region"))
        offset, size = check_span(region.name, region.byte_size, params, needed)
        return region, region.offset + offset, size

    # ---- tensors ----
    def read_input(self, name: str, datatype: str, shape: list[int], params: dict) -> np.ndarray:
        """A numpy view over the registered region (no copy) for fixed-size types."""
        self.check_enabled()
        region, start, size = self._span(params, None)
        count = tensors.element_count(shape)
        if datatype == "BYTES":
            return tensors.deserialize_bytes(region.buffer[start : start + size], count).reshape(shape)
        dt = tensors.numpy_dtype(datatype)
        if size != count * dt.itemsize:
            raise InvalidArgument(
                f"input '{name}': shared memory byte size {size} does not match the tensor's "
                f"{count * dt.itemsize} bytes ({count} {datatype} elements)"
            )
        return np.frombuffer(region.buffer, dtype=dt, count=count, offset=start).reshape(shape)

    def write_output(self, out: OutputTensor, params: dict) -> None:
        """Copy an output into its region (the response then describes it by name, datatype and shape only)."""
        self.check_enabled()
        data = tensors.to_bytes(out.data, out.datatype)
        region, start, _size = self._span(params, len(data))
        region.buffer[start : start + len(data)] = data
