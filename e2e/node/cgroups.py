"""The real node's cgroup subtree: created before the node starts, emptied (SIGKILL) and removed when it stops.

Everything the node runs -- containerd, its shims, the kubelet, kube-proxy, the device plugin and (through the
kubelet's ``cgroupRoot``) every pod -- lives under one cgroup per hierarchy, so stopping the node can find and kill
each process it left and remove every cgroup it made, on cgroup v1, hybrid or v2 alike.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

CGROUP_FS = Path("/sys/fs/cgroup")


def cgroup_version() -> int:
    """2 when /sys/fs/cgroup is the unified (v2) hierarchy, else 1 (v1 or hybrid: the kubelet sees v1)."""
    return 2 if (CGROUP_FS / "cgroup.controllers").exists() else 1


def hierarchies() -> list[Path]:
    """The mounted hierarchies: /sys/fs/cgroup itself on v2, each controller directory on v1/hybrid."""
    if cgroup_version() == 2:
        return [CGROUP_FS]
    out = []
    for p in sorted(CGROUP_FS.iterdir()):
        if p.is_symlink() or not p.is_dir() or not (p / "cgroup.procs").exists():
            continue
        out.append(p)
    return out


def _mkdir(path: Path) -> None:
    if path.exists():
        return
    _mkdir(path.parent)
    path.mkdir()
    for f in ("cpuset.cpus", "cpuset.mems"):  # v1 cpuset: a new cgroup starts empty and refuses tasks
        if (path / f).exists() and not (path / f).read_text().strip():
            (path / f).write_text((path.parent / f).read_text())


def create(name: str, child: str) -> list[Path]:
    """Make ``/<name>/<child>`` in every hierarchy; return the ``cgroup.procs`` files to put a process in."""
    procs = []
    for h in hierarchies():
        _mkdir(h / name / child)
        procs.append(h / name / child / "cgroup.procs")
    return procs


def pids(name: str) -> set[int]:
    """Every process in the subtree ``/<name>`` of any hierarchy."""
    found: set[int] = set()
    for h in hierarchies():
        root = h / name
        if not root.is_dir():
            continue
        for d, _, _ in os.walk(root):
            try:
                found.update(int(x) for x in (Path(d) / "cgroup.procs").read_text().split())
            except OSError:
                continue
    return found


def kill_all(name: str, timeout: float = 20.0) -> set[int]:
    """SIGKILL every process in the subtree until none is left; return the pids that were killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while True:
        left = pids(name) - {os.getpid()}
        if not left:
            return killed
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {sorted(left)} in cgroup /{name} survive SIGKILL")
        time.sleep(0.1)


def remove(name: str, timeout: float = 20.0) -> None:
    """Remove the subtree ``/<name>`` from every hierarchy (after kill_all), deepest cgroups first."""
    deadline = time.monotonic() + timeout
    for h in hierarchies():
        root = h / name
        if not root.is_dir():
            continue
        for d, _, _ in sorted(os.walk(root, topdown=False), key=lambda w: -len(Path(w[0]).parts)):
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)  # a killed process is still exiting
