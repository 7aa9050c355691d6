"""GPU device discovery (NVML): how many CUDA devices this process may use, and what they are.

Nothing here needs a GPU to import: `device_count()` is 0 when there is no driver, no `nvidia-ml-py` or no
device, never an error. The CUDA runtime is `naiad.cuda_runtime`, CUDA shared memory `naiad.shared_memory`.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("naiad.gpu")


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
