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


def timed(fn, repeat: int) -> float:
    """Median milliseconds of `fn()` over `repeat` calls after two warm-ups."""
    fn(), fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", default="0.6,4.6,18.4", help="tensor sizes in MiB (ResNet-50 batch 1, 8, 32)")
    ap.add_argument("--repeat", type=int, default=30)
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("host_to_device: no CUDA device visible to torch", file=sys.stderr)
        return 2
    cudart = torch.cuda.cudart()
    print(f"device: {torch.cuda.get_device_name(0)}")
    print(
        "| MiB | pageable ms (GB/s) | registered ms (GB/s) | torch pinned ms (GB/s) | register ms | unregister ms |"
    )
    print("|---|---|---|---|---|---|")
    for mib in (float(v) for v in a.mib.split(",")):
        n = int(mib * 2**20) // 4 * 4
        buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)  # a receive buffer: anonymous, pageable
        arr = np.frombuffer(buf, dtype=np.float32)
        arr[:] = 1.0
        host = torch.from_numpy(arr)

        def copy(t=host):
            t.to("cuda:0")
            torch.cuda.synchronize()

        pageable = timed(copy, a.repeat)
        ptr = host.data_ptr()
        t0 = time.perf_counter()
        err = cudart.cudaHostRegister(ptr, n, 0)
        register = 1000 * (time.perf_counter() - t0)
        if int(err) != 0:
            print(f"cudaHostRegister failed: {err}", file=sys.stderr)
            return 1
        registered = timed(copy, a.repeat)
        t0 = time.perf_counter()
        cudart.cudaHostUnregister(ptr)
        unregister = 1000 * (time.perf_counter() - t0)
        pinned = timed(lambda t=torch.empty(n // 4, dtype=torch.float32).pin_memory(): copy(t), a.repeat)
        del host, arr, copy  # every view of the mapping, so that it can be closed
        buf.close()

        def rate(ms: float, n: int = n) -> str:
            return f"{ms:.3f} ({n / ms / 1e6:.1f})"

        print(
            f"| {mib} | {rate(pageable)} | {rate(registered)} | {rate(pinned)} | {register:.3f} | {unregister:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
