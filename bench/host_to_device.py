#!/usr/bin/env python3
"""Host-to-device copy speed of a request-sized tensor on a GPU machine: from pageable memory (what a receive
buffer is), from the same memory once page-locked with cudaHostRegister, and from torch's own pinned memory; and
what registering costs. Says whether page-locking the receive buffers would pay.

    python bench/host_to_device.py --mib 0.6,4.6,18.4
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import time

import numpy as np


def copy_ms(torch, host, repeat: int) -> float:
    """Median milliseconds of copying `host` to the device (synchronised) over `repeat` copies after two warm-ups."""
    times = []
    for i in range(repeat + 2):
        t = time.perf_counter()
        host.to("cuda:0")
        torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def measure(torch, n: int, repeat: int) -> str:
    """One table row for a tensor of `n` bytes."""
    cudart = torch.cuda.cudart()
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)  # a receive buffer: anonymous, pageable
    arr = np.frombuffer(buf, dtype=np.float32)
    arr[:] = 1.0
    host = torch.from_numpy(arr)
    pageable = copy_ms(torch, host, repeat)
    t0 = time.perf_counter()
    err = cudart.cudaHostRegister(host.data_ptr(), n, 0)
    register = 1000 * (time.perf_counter() - t0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")
    registered = copy_ms(torch, host, repeat)
    t0 = time.perf_counter()
    cudart.cudaHostUnregister(host.data_ptr())
    unregister = 1000 * (time.perf_counter() - t0)
    pinned = copy_ms(torch, torch.empty(n // 4, dtype=torch.float32).pin_memory(), repeat)
    del host, arr  # every view of the mapping, so that it can be closed
    buf.close()

    def rate(ms: float) -> str:
        return f"{ms:.3f} ({n / ms / 1e6:.1f})"

    return f"| {n / 2**20:.1f} | {rate(pageable)} | {rate(registered)} | {rate(pinned)} | {register:.3f} | {unregister:.3f} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", default="0.6,4.6,18.4", help="tensor sizes in MiB (ResNet-50 batch 1, 8, 32)")
    ap.add_argument("--repeat", type=int, default=30)
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("host_to_device: no CUDA device visible to torch", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}")
    print(
        "| MiB | pageable ms (GB/s) | registered ms (GB/s) | torch pinned ms (GB/s) | register ms | unregister ms |"
    )
    print("|---|---|---|---|---|---|")
    for mib in (float(v) for v in a.mib.split(",")):
        print(measure(torch, int(mib * 2**20) // 4 * 4, a.repeat), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
