"""Rounds of one-connection, back-to-back measurements across checkouts (and the real Triton), the trees alternated
round by round: the loop and the table of medians that http_body_framing.py and grpc_typed_contents.py share.

A tree is a checkout whose server code runs (`Server`, with PYTHONPATH at its server/), or `triton`: the real
Triton 2.51 (tools/triton/, `make test` installs it) on the same repository, its python backend running the model
in a stub process. A figure is the median over rounds of the server's CPU-seconds per request (all its processes)
and of the wall time per request; the ratio is against the first tree.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil
from frontend_workers import ROOT, Server, free_port

sys.path.insert(0, str(ROOT))

Measure = Callable[
    ["Server | Triton", str], tuple[float, float]
]  # (server, mode) -> (CPU µs, wall µs) a request


class Triton:
    """The real Triton on `repo`, with what a measurement asks of a Server (`port`, `grpc_port`, `cpu_seconds`)."""

    def __init__(self, repo: Path, log: Path):
        from tests.triton_reference import tritonserver

        self.stack = contextlib.ExitStack()
        self.port, self.grpc_port = free_port(), free_port()
        args = ["--exit-on-error=false", "--strict-readiness=false"]
        self.triton = self.stack.enter_context(
            tritonserver(repo, self.port, self.grpc_port, free_port(), args, timeout=120, log_path=log)
        )

    def cpu_seconds(self) -> tuple[float, float]:
        root = psutil.Process(self.triton.process.pid)
        total = 0.0
        for p in [root, *root.children(recursive=True)]:  # (the python backend's stub processes)
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total, total

    def stop(self) -> None:
        self.stack.close()


def timed(server: Server | Triton, one: Callable[[], object], seconds: float) -> tuple[float, float]:
    """(server CPU µs, wall µs) per request of `one()` called back to back for about `seconds`."""
    cpu0, n, t0 = server.cpu_seconds()[0], 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        one()
        n += 1
    wall = time.perf_counter() - t0
    cpu = server.cpu_seconds()[0] - cpu0
    return cpu / n * 1e6, wall / n * 1e6


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--trees", default=".", help="comma-separated checkouts whose server code is measured, or triton"
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per mode and round")


def run(
    trees_arg: str,
    rounds: int,
    modes: Sequence[str],
    repo: Path,
    tmp: Path,
    measure: Measure,
    setting: str = "1",
) -> None:
    """Each round starts each tree's server once (`setting`: its --frontend-workers value and any further
    arguments, as frontend_workers.Server takes them) and measures every mode on it; then prints the medians."""
    trees = [t if t == "triton" else str(Path(t).resolve()) for t in trees_arg.split(",")]
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    width = max(len(m) for m in modes)
    for r in range(rounds):
        for tree in trees if r % 2 == 0 else trees[::-1]:
            if tree == "triton":
                server: Server | Triton = Triton(repo, tmp / "triton.log")
            else:
                server = Server(repo, setting, tmp / "server.log", Path(tree))
            try:
                for mode in modes:
                    cpu, wall = measure(server, mode)
                    results.setdefault((tree, mode), []).append((cpu, wall))
                    print(
                        f"round {r + 1} {tree} {mode:{width}s} {cpu:9.0f} µs CPU/request {wall:9.0f} µs wall"
                    )
            finally:
                server.stop()
    print("\nmedians over rounds (ratio: against the first tree)")
    for mode in modes:
        base = statistics.median(c for c, _ in results[(trees[0], mode)])
        for tree in trees:
            cpu = statistics.median(c for c, _ in results[(tree, mode)])
            wall = statistics.median(w for _, w in results[(tree, mode)])
            print(f"  {mode:{width}s} {tree:24s} {cpu:9.0f} µs CPU ({cpu / base:.2f}x) {wall:9.0f} µs wall")
