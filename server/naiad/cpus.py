"""How many CPUs this pod may use: its cgroup CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us`), never more than the
CPUs this process may run on; `--frontend-workers auto` (the default) is one worker per CPU less one for the engine."""

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


def pod_cpus(root: str = CGROUP) -> int | None:
    """Whole CPUs of the pod's quota, rounded up, never more than the CPUs this process may run on; None without
    a quota (a process with no CPU limit shares its host's CPUs)."""
    quota = quota_cpus(root)
    if quota is None:
        return None
    try:
        online = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        online = os.cpu_count() or 1
    return max(1, min(online, math.ceil(quota)))


def auto_workers(root: str = CGROUP) -> int:
    """`--frontend-workers auto`: the pod's CPUs less one for the engine process (on 2 CPUs that is one process:
    2 workers beside the engine serve 0.8x one process's small requests at 8 connections, 1.1-1.2x at 64); 1 without
    a CPU limit, where a worker per host CPU would take CPUs the pod was never given (the operator passes its own
    count from the pod's CPU request then)."""
    cpus = pod_cpus(root)
    return 1 if cpus is None else max(1, cpus - 1)


def frontend_workers(value: str) -> int:
    """`--frontend-workers` (an argparse type): a positive number, or `auto` (auto_workers)."""
    if str(value).strip().lower() == "auto":
        return auto_workers()
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'auto', got '{value}'") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n
