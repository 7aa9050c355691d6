"""The engine process's own cost per request under `--frontend-workers`: a driver speaks the engine's socket protocol
directly (no worker, no HTTP or gRPC), keeping `--window` 16-value `Infer` messages in flight, and reads the engine's
CPU time per reply. With several checkouts (`--trees`), rounds alternate between them.

    .venv/bin/python bench/engine_socket.py --rounds 3 --duration 6
    .venv/bin/python bench/engine_socket.py --trees .,/tmp/base --backend onnxruntime
    .venv/bin/python bench/engine_socket.py --connections 8 --window 8     # as 8 workers would feed it

The engine is pinned to the first CPU and the driver to the second (on 2 or more CPUs), so the engine has a core
of its own; `busy` is the engine's CPU time over the wall time of the measurement.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil
import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.append(str(ROOT / "server"))  # (after PYTHONPATH: `--frames` runs with a tree's own)

from frontend_workers import free_port, make_repo  # noqa: E402

from naiad.engine import wire  # noqa: E402


def start(tree: Path, repo: Path, log: Path) -> subprocess.Popen:
    port = free_port()
    cmd = [sys.executable, "-m", "naiad.cli", "serve", "--model-repository", str(repo), "--http-port", str(port),
           "--grpc-port", str(free_port()), "--allow-metrics", "false", "--frontend-workers", "2"]  # fmt: skip
    path = os.environ.get("PYTHONPATH")  # (what else is on it stays: a GPU machine's carried wheels)
    env = dict(os.environ, PYTHONPATH=str(tree / "server") + (os.pathsep + path if path else ""))
    proc = subprocess.Popen(
        cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            if requests.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1).ok:
                return proc
        except requests.RequestException:
            time.sleep(0.2)
    raise RuntimeError(f"server did not start; see {log}")


def engine_socket(pid: int) -> str:
    """The Unix socket the engine listens on for its workers."""
    for conn in psutil.Process(pid).net_connections("unix"):
        if conn.laddr and str(conn.laddr).endswith("engine.sock"):
            return str(conn.laddr)
    raise RuntimeError(f"process {pid} has no engine socket")


def frames(count: int) -> list[bytes]:
    """`count` Infer frames of a 16-value request, as this interpreter's `naiad` (a tree's own) describes one."""
    from naiad.engine.slabs import SlabPool
    from naiad.inference import InferenceRequest, RequestedOutput

    data = np.random.default_rng(0).random(16, dtype=np.float32)
    pool = SlabPool(f"naiad-bench{os.getpid()}")
    request = InferenceRequest(
        "identity_var",
        {"INPUT0": data},
        {"INPUT0": "FP32"},
        outputs=[RequestedOutput("OUTPUT0", True, 0, {})],
    )
    desc = wire.encode_request(request, pool)
    pool.close()
    return [wire.frame(wire.Infer(i, desc)) for i in range(1, count + 1)]


def tree_frames(tree: Path, count: int) -> list[bytes]:
    """`frames` made by the tree's own wire module (the format may differ between the trees compared)."""
    env = dict(os.environ, PYTHONPATH=str(tree / "server"))
    out = subprocess.run(
        [sys.executable, __file__, "--frames", str(count)], env=env, stdout=subprocess.PIPE, check=True
    ).stdout
    chunks, off = [], 0
    while off < len(out):
        n = int.from_bytes(out[off : off + 4], "little")
        chunks.append(out[off : off + 4 + n])
        off += 4 + n
    return chunks


def drive(
    pid: int, ready: list[bytes], seconds: float, window: int, connections: int = 1
) -> tuple[float, float, float]:
    """(replies/s, engine CPU µs per reply, engine busy) with `window` requests in flight on each of
    `connections` connections (as many workers would hold) for `seconds`."""
    path = engine_socket(pid)
    socks = []
    for _ in range(connections):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        sock.sendall(wire.frame(wire.Hello(os.getpid(), "bench", False)))
        socks.append(sock)
    sent = [0] * connections
    replies = 0

    def send(i: int, n: int) -> None:
        base = sent[i]
        socks[i].sendall(b"".join(ready[(base + k) % len(ready)] for k in range(n)))
        sent[i] = base + n

    for i in range(connections):
        send(i, window)
    bufs = [bytearray() for _ in socks]
    poller = select.epoll()
    for sock in socks:
        poller.register(sock.fileno(), select.EPOLLIN)
    index = {sock.fileno(): i for i, sock in enumerate(socks)}
    proc = psutil.Process(pid)
    t0, c0 = time.monotonic(), proc.cpu_times()
    while time.monotonic() - t0 < seconds:
        for fd, _ in poller.poll(1.0):
            i = index[fd]
            buf = bufs[i]
            buf += socks[i].recv(1 << 20)
            off = done = 0
            while len(buf) - off >= 4:
                n = int.from_bytes(buf[off : off + 4], "little")
                if len(buf) - off - 4 < n:
                    break
                off += 4 + n
                done += 1
            del buf[:off]
            replies += done
            if done:
                send(i, done)
    wall, c1 = time.monotonic() - t0, proc.cpu_times()
    poller.close()
    for sock in socks:
        sock.close()
    cpu = (c1.user + c1.system) - (c0.user + c0.system)
    return replies / wall, 1e6 * cpu / max(1, replies), cpu / wall


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--trees", default=".", help="checkouts to compare, comma-separated (their server/ is used)"
    )
    p.add_argument("--backend", choices=["onnxruntime", "python"], default="onnxruntime")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--window", type=int, default=64, help="requests in flight on each connection")
    p.add_argument("--connections", type=int, default=1, help="connections to the engine, as many workers")
    p.add_argument("--frames", type=int, default=0, help=argparse.SUPPRESS)  # (a tree's frames, to stdout)
    args = p.parse_args()
    if args.frames:
        sys.stdout.buffer.write(b"".join(frames(args.frames)))
        return 0
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="naiad-bench-engine-"))
    repo = make_repo(tmp / "repo", backend=args.backend)
    cpus = sorted(os.sched_getaffinity(0))
    results: dict[Path, list[tuple[float, float, float]]] = {t: [] for t in trees}
    try:
        for rnd in range(args.rounds):
            for tree in trees if rnd % 2 == 0 else trees[::-1]:
                ready = tree_frames(tree, 65536)
                server = start(tree, repo, tmp / "server.log")
                try:
                    if len(cpus) > 1:
                        os.sched_setaffinity(server.pid, {cpus[0]})
                        os.sched_setaffinity(0, {cpus[1]})
                    # warm-up: the model qualifies to run inline
                    drive(server.pid, ready, 1.0, args.window, args.connections)
                    row = drive(server.pid, ready, args.duration, args.window, args.connections)
                finally:
                    os.sched_setaffinity(0, set(cpus))
                    os.killpg(server.pid, signal.SIGTERM)
                    server.wait(30)
                results[tree].append(row)
                print(f"round {rnd + 1} {tree}: {row[0]:,.0f} replies/s, {row[1]:.1f} µs engine CPU/reply, "
                      f"busy {row[2]:.2f}", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\nmedians over rounds:")
    first = statistics.median(r[1] for r in results[trees[0]])
    for tree, rows in results.items():
        rate, us = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        print(f"  {tree}: {rate:,.0f} replies/s, {us:.1f} µs engine CPU/reply ({us / first:.2f}x the first)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
