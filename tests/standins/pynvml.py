"""Stand-in for nvidia-ml-py's `pynvml`: NAIAD_STANDIN_CUDA_DEVICES (default 1) devices with 16 GiB each and
nothing else to report. Tests only (see tests/standins/README.md), with the stand-in `cuda` package."""

from __future__ import annotations

import os
from types import SimpleNamespace

_DEVICES = int(os.environ.get("NAIAD_STANDIN_CUDA_DEVICES", "1"))


class NVMLError(Exception):
    pass


def nvmlInit():
    return None


def nvmlShutdown():
    return None


def nvmlDeviceGetCount():
    return _DEVICES


def nvmlDeviceGetHandleByIndex(index):
    if not 0 <= index < _DEVICES:
        raise NVMLError(f"no device {index}")
    return index


def nvmlDeviceGetUUID(handle):
    return f"GPU-standin-{handle}"


def nvmlDeviceGetName(handle):
    return "Stand-in GPU"


def nvmlDeviceGetMemoryInfo(handle):
    return SimpleNamespace(total=16 << 30, used=0, free=16 << 30)


def __getattr__(name):  # utilisation, power, ...: not known here (the metrics leave them out)
    if name.startswith("nvml"):

        def unknown(*args):
            raise NVMLError(f"{name} is not known to the stand-in")

        return unknown
    raise AttributeError(name)
