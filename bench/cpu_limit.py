"""A CPU limit for a benchmarked server, as a pod's `resources.limits.cpu` sets one: a cgroup with a CFS quota
(v2 `cpu.max`, or v1 `cpu.cfs_quota_us`) that a command joins before it starts, so the server and every process
it starts run under it, and how often the quota ran out (the cgroup's throttled periods). Needs root."""

from __future__ import annotations

import os
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
PERIOD_US = 100_000  # the kubelet's CFS period


class CpuLimit:
    """`CpuLimit(0.5)`: a new cgroup allowing half a CPU per period; `wrap(cmd)` runs cmd in it."""

    def __init__(self, cpus: float, name: str | None = None):
        name = name or f"naiad-bench-{os.getpid()}"
        quota = max(1000, round(cpus * PERIOD_US))
        if (CGROUP / "cgroup.controllers").exists():  # v2: the cpu controller is enabled for the children
            self.path = CGROUP / name
            controllers = (CGROUP / "cgroup.subtree_control").read_text().split()
            if "cpu" not in controllers:
                (CGROUP / "cgroup.subtree_control").write_text("+cpu")
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
        else:  # v1: the cpu hierarchy
            self.path = CGROUP / "cpu" / name
            self.path.mkdir(exist_ok=True)
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def wrap(self, cmd: list[str]) -> list[str]:
        """cmd, joining the cgroup first (so nothing it starts runs outside the limit)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.path / "cgroup.procs"), *cmd]

    def throttled(self) -> tuple[int, int]:
        """(periods, periods in which the quota ran out) so far."""
        stat = dict(
            line.split() for line in (self.path / "cpu.stat").read_text().splitlines() if line.strip()
        )
        return int(stat.get("nr_periods", 0)), int(stat.get("nr_throttled", 0))

    def remove(self) -> None:
        """The cgroup, once every process in it has exited."""
        try:
            self.path.rmdir()
        except OSError:
            pass
