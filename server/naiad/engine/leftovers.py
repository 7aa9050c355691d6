"""What an engine or worker killed without a chance to clean up leaves behind (its pool's /dev/shm segments, the
engine's socket directory), told apart from a live process's by an owner lock the kernel frees at death, and
removed by the next engine to start."""

from __future__ import annotations

import fcntl
import os
import re
import shutil

# a pool's owner lock, `<prefix>.lock` beside its segments `<prefix>-…` (slabs.SlabPool: naiad-e<pid>, naiad-w<pid>)
_POOL_LOCK = re.compile(r"(naiad-[ew]\d+)\.lock")
SOCKET_DIR_PREFIX = "naiad-engine-"
SOCKET_NAME = "engine.sock"  # the workers' connections to the engine
ACCEPT_NAME = "accept.sock"  # the acceptor's (acceptor.py), beside it: all an engine puts in its directory


def hold(path: str, directory: bool = False) -> int:
    """Take a shared lock on `path` (a file made if missing, or a directory) for as long as the returned
    descriptor stays open: while it is held, `sweep_*` leaves what it guards. A sweep that found the path
    unlocked an instant before it was locked here removes it; this notices (no link left) and makes it again."""
    flags = (os.O_RDONLY | os.O_DIRECTORY) if directory else (os.O_RDWR | os.O_CREAT)
    while True:
        try:
            fd = os.open(path, flags | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            if not directory:
                raise
            os.mkdir(path, 0o700)  # swept before it was opened
            continue
        fcntl.flock(fd, fcntl.LOCK_SH)
        if os.fstat(fd).st_nlink > 0:
            return fd
        os.close(fd)  # swept between the open and the lock: made again by the next turn


def _gone(path: str, directory: bool = False) -> int | None:
    """A descriptor holding `path`'s lock exclusively when no process holds it (its owner is gone), else None."""
    try:
        fd = os.open(path, (os.O_RDONLY | os.O_DIRECTORY) if directory else os.O_RDWR)
    except OSError:  # removed meanwhile, or another user's
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def sweep_segments(shm_dir: str) -> list[str]:
    """Unlink the segments of every pool whose owner is gone, with its lock, and return their names. A process
    killed with SIGKILL (the kernel's OOM killer) unlinks nothing, and a pod's /dev/shm (an emptyDir in memory)
    outlives the container it restarts: each crash would leave up to a pool's worth of memory charged to the pod.
    Segments with no lock file are left (whose they are cannot be told)."""
    gone: list[str] = []
    for entry in os.listdir(shm_dir):
        match = _POOL_LOCK.fullmatch(entry)
        if match is None:
            continue
        lock = os.path.join(shm_dir, entry)
        fd = _gone(lock)
        if fd is None:
            continue
        try:
            gone += unlink_segments(shm_dir, match.group(1))
            _remove(lock)  # last, still locked: a pool starting under this name makes a new one
        finally:
            os.close(fd)
    return gone


def unlink_segments(shm_dir: str, prefix: str) -> list[str]:
    """Unlink a pool's segments (`<prefix>-…`, not its lock) and return their names."""
    names = [name for name in os.listdir(shm_dir) if name.startswith(prefix + "-")]
    for name in names:
        _remove(os.path.join(shm_dir, name))
    return names


def sweep_socket_dirs(tmp_dir: str) -> list[str]:
    """Remove the socket directories of engines that are gone (their lock is free), and return their paths. A
    directory under the same prefix that holds anything but the socket is somebody else's and stays."""
    gone: list[str] = []
    for entry in os.listdir(tmp_dir):
        if not entry.startswith(SOCKET_DIR_PREFIX):
            continue
        path = os.path.join(tmp_dir, entry)
        fd = _gone(path, directory=True)
        if fd is None:
            continue
        try:
            if not set(os.listdir(path)) <= {SOCKET_NAME, ACCEPT_NAME}:
                continue
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
        finally:
            os.close(fd)
    return gone


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
