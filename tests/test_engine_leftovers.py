"""What an engine or worker killed with SIGKILL leaves (its pool's /dev/shm segments, the engine's socket directory)
is removed by the next engine to start, and what a live process owns never is (naiad.engine.leftovers)."""

from __future__ import annotations

import os
import signal
import tempfile
import time

import numpy as np
import psutil
import tritonclient.http as httpclient
from helpers import NaiadProcess
from test_frontend_workers import identity_inputs, make_repo, wait_for, worker_pids

from naiad.engine import leftovers
from naiad.engine.slabs import SHM_DIR, SlabPool


def _touch(path) -> None:
    with open(path, "wb") as f:
        f.write(b"x" * 16)


def test_a_pool_whose_owner_is_gone_is_swept_and_a_held_one_is_not(tmp_path):
    for name in ("naiad-e101.lock", "naiad-e101-0", "naiad-e101-r3", "naiad-e1010-0", "naiad-w7-0", "other"):
        _touch(tmp_path / name)
    held = leftovers.hold(str(tmp_path / "naiad-w7.lock"))  # a live owner: a lock on another open file
    try:
        assert sorted(leftovers.sweep_segments(str(tmp_path))) == ["naiad-e101-0", "naiad-e101-r3"]
        # the gone owner's lock went last; a prefix that merely starts alike (e1010: no lock file, whose it is
        # cannot be told) and the held pool stay
        assert sorted(os.listdir(tmp_path)) == ["naiad-e1010-0", "naiad-w7-0", "naiad-w7.lock", "other"]
    finally:
        os.close(held)
    assert leftovers.sweep_segments(str(tmp_path)) == ["naiad-w7-0"]  # its owner let go


def test_a_socket_directory_is_swept_once_its_engine_lets_go(tmp_path):
    live = tmp_path / (leftovers.SOCKET_DIR_PREFIX + "live")
    dead = tmp_path / (leftovers.SOCKET_DIR_PREFIX + "dead")
    for d in (live, dead):
        d.mkdir()
        _touch(d / "engine.sock")
        _touch(d / "accept.sock")
    (tmp_path / "unrelated").mkdir()
    fd = leftovers.hold(str(live), directory=True)
    try:
        assert leftovers.sweep_socket_dirs(str(tmp_path)) == [str(dead)]
        assert sorted(os.listdir(tmp_path)) == [live.name, "unrelated"]
    finally:
        os.close(fd)
    assert leftovers.sweep_socket_dirs(str(tmp_path)) == [str(live)]


def test_a_directory_under_the_prefix_that_holds_more_than_a_socket_is_left(tmp_path):
    # e.g. a tool's own `tempfile.mkdtemp(prefix="naiad-engine-bench-")` with its model repository in it
    other = tmp_path / (leftovers.SOCKET_DIR_PREFIX + "bench-x")
    (other / "repo").mkdir(parents=True)
    _touch(other / "server.log")
    assert leftovers.sweep_socket_dirs(str(tmp_path)) == []
    assert sorted(os.listdir(other)) == ["repo", "server.log"]


def test_hold_makes_again_what_a_sweep_removed_before_it_was_locked(tmp_path, monkeypatch):
    path = tmp_path / (leftovers.SOCKET_DIR_PREFIX + "new")
    path.mkdir()
    real_flock = leftovers.fcntl.flock
    swept = []

    def flock(fd, op):  # a sweep runs between the owner's open and its lock
        if op == leftovers.fcntl.LOCK_SH and not swept:
            swept.append(None)
            swept[0] = leftovers.sweep_socket_dirs(str(tmp_path))
        return real_flock(fd, op)

    monkeypatch.setattr(leftovers.fcntl, "flock", flock)
    fd = leftovers.hold(str(path), directory=True)
    monkeypatch.undo()
    try:
        assert swept == [[str(path)]] and path.is_dir()
        assert leftovers.sweep_socket_dirs(str(tmp_path)) == []  # the directory made again is held
    finally:
        os.close(fd)


def test_hold_makes_again_a_directory_swept_before_it_was_opened(tmp_path):
    path = tmp_path / (leftovers.SOCKET_DIR_PREFIX + "gone")  # made by mkdtemp, removed by a sweep at once
    fd = leftovers.hold(str(path), directory=True)
    try:
        assert path.is_dir() and oct(path.stat().st_mode & 0o777) == "0o700"
        assert leftovers.sweep_socket_dirs(str(tmp_path)) == []
    finally:
        os.close(fd)


def test_a_pool_owns_its_segments_from_the_first_and_lets_go_at_close():
    pool = SlabPool(f"naiad-w{os.getpid()}9")  # (a prefix no server of this process uses)
    lock = os.path.join(SHM_DIR, pool.prefix + ".lock")
    predecessor = os.path.join(SHM_DIR, pool.prefix + "-0")  # a gone process's with the same pid
    _touch(predecessor)
    assert not os.path.exists(lock)  # a pool that never makes a segment leaves nothing
    slab = pool.alloc(1 << 20)  # its first name is the predecessor's: made anew, not refused
    assert slab.name == pool.prefix + "-0" and os.path.getsize(predecessor) == 1 << 20
    assert os.path.exists(lock)
    assert slab.name not in leftovers.sweep_segments(SHM_DIR)
    pool.close()
    assert not os.path.exists(lock) and not os.path.exists(os.path.join(SHM_DIR, slab.name))


def _leftovers_of(pids: list[int]) -> list[str]:
    prefixes = tuple(f"naiad-{kind}{pid}{sep}" for pid in pids for kind in "ew" for sep in "-.")
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(prefixes))


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _engine_socket_dir(worker: int) -> str:
    """The socket directory of the engine a worker serves (its command line names the engine's socket): this
    server's own, whatever other servers of the machine (another test run's) keep beside it."""
    cmdline = psutil.Process(worker).cmdline()
    sockets = [arg for arg in cmdline if arg.endswith(".sock")]
    assert sockets, cmdline
    return os.path.basename(os.path.dirname(sockets[0]))


def _socket_dirs() -> set[str]:
    tmp = tempfile.gettempdir()
    return {name for name in os.listdir(tmp) if name.startswith(leftovers.SOCKET_DIR_PREFIX)}


def test_what_a_killed_engine_left_is_removed_by_the_next_engine(tmp_path):
    repo = make_repo(tmp_path / "repo")
    first = NaiadProcess(
        repo, "--frontend-workers", "2", "--model-control-mode", "explicit", "--load-model", "*"
    )
    first.start()
    second = None
    try:
        workers = wait_for(lambda: worker_pids(first) if len(worker_pids(first)) == 2 else None, 20)
        data = np.random.default_rng(0).random((1, 1 << 18), dtype=np.float32)  # 1 MiB: through slabs
        for _ in range(4):  # on each worker, most likely
            client = httpclient.InferenceServerClient(first.http)
            out = client.infer("identity_fp32", identity_inputs(httpclient, data)).as_numpy("OUTPUT0")
            np.testing.assert_array_equal(out, data)
            client.close()
        pids = [first.proc.pid, *workers]
        assert _leftovers_of(pids), "the server made no shared-memory segment to leave"
        own_dirs = {_engine_socket_dir(workers[0])}
        assert own_dirs <= _socket_dirs()
        # the container's end: every process of it killed at once, as the kernel's OOM killer or a kubelet does
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        first.proc.wait(10)
        wait_for(lambda: not any(_alive(p) for p in workers), 15, "the workers to end")
        left = _leftovers_of(pids)
        assert any(name.endswith(".lock") for name in left) and len(left) >= 2, left  # a pool, with its lock
        assert own_dirs <= _socket_dirs()

        second = NaiadProcess(repo, "--frontend-workers", "2", "--model-control-mode", "explicit")
        second.start()
        wait_for(lambda: len(worker_pids(second)) == 2, 20, "the new server's workers")
        assert _leftovers_of(pids) == []
        assert not own_dirs & _socket_dirs()
        assert "removed what engines and workers that are gone left" in second.output()
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.stop()
    deadline = time.monotonic() + 5
    while _leftovers_of([second.proc.pid]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _leftovers_of([second.proc.pid]) == []  # a server stopped cleanly leaves nothing of its engine
