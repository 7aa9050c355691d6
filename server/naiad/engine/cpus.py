"""How many CPUs this pod may use: its cgroup CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us`), else the CPUs
this process may run on. The default of `--frontend-workers auto`."""

from __future__ import annotations

import argparse
import math
import os

CGROUP = "/sys/fs/cgroup"


def quota_cpus(root: str = CGROUP) -> float | None:
    """The cgroup's CPU limit in CPUs, or None when it has none."""
    try:
        with open(os.path.join(root, "cpu.max")) as f:
            quota, _, period = f.read().strip().partition(" ")
        if quota != "max":
            return int(quota) / int(period or 100000)
        return None
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us")) as f:
            quota_us = int(f.read().strip())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us")) as f:
            period_us = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def pod_cpus(root: str = CGROUP) -> int:
    """Whole CPUs: the quota rounded up, never more than the CPUs this process may run on, at least 1."""
    try:
        online = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        online = os.cpu_count() or 1
    quota = quota_cpus(root)
    n = online if quota is None else min(online, math.ceil(quota))
    return max(1, n)


def frontend_workers(value: str) -> int:
    """`--frontend-workers` (an argparse type): a positive number, or `auto`: the pod's CPUs less one for the
    engine process (on 2 CPUs, 2 workers beside the engine served 0.86x one process's small requests)."""
    if str(value).strip().lower() == "auto":
        return max(1, pod_cpus() - 1)
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'auto', got '{value}'") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n
