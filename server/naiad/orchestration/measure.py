"""Measured model memory: this process's resident set and each GPU's used memory around a load (after warm-up),
plus the resident set of the model's own worker processes (process-isolated python instances)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import psutil

from .memory_budget import HOST, gpu_device

log = logging.getLogger("naiad.orchestration")


@dataclass(frozen=True)
class MemorySnapshot:
    host: int
    gpu: dict[int, int] = field(default_factory=dict)  # device index -> used bytes


class MemoryProbe:
    """Reads RSS (psutil) and, with a GPU, each device's used memory (NVML). NVML is opened once."""

    def __init__(self, gpu_count: int):
        self._process = psutil.Process(os.getpid())
        self._nvml = None
        self._handles: list = []
        if gpu_count:
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
                self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(gpu_count)]
            except Exception as exc:  # measured host memory still works
                log.warning("GPU memory of models will not be measured: NVML is unavailable (%s)", exc)
                self._nvml, self._handles = None, []

    def snapshot(self) -> MemorySnapshot:
        gpu = {}
        for index, handle in enumerate(self._handles):
            try:
                gpu[index] = int(self._nvml.nvmlDeviceGetMemoryInfo(handle).used)
            except Exception as exc:
                log.debug("NVML memory info of GPU %d failed: %s", index, exc)
        return MemorySnapshot(self._process.memory_info().rss, gpu)

    def measure(self, before: MemorySnapshot, worker_pids: list[int]) -> dict[str, int]:
        """{'host': bytes, 'gpu<N>': bytes} the load added: the RSS delta plus each worker process's RSS, and
        each device's used-memory delta (which includes what worker processes allocated on it)."""
        after = self.snapshot()
        host = max(0, after.host - before.host)
        for pid in worker_pids:
            try:
                host += psutil.Process(pid).memory_info().rss
            except psutil.Error:
                pass
        out = {HOST: host}
        for index, used in after.gpu.items():
            if index in before.gpu:
                out[gpu_device(index)] = max(0, used - before.gpu[index])
        return out


def worker_pids(versions) -> list[int]:
    """The pids of the worker processes serving these model versions' instances."""
    pids = []
    for mv in versions:
        if mv.pool is None:
            continue
        for inst in mv.pool.instances:
            pid = getattr(inst, "pid", None)
            if isinstance(pid, int):
                pids.append(pid)
    return pids
