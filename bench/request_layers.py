"""Where `Server.infer` spends a small request, layer by layer, in one process: each layer of the path (the
backend's `instance_execute`, the instance's `execute`, the instance pool's `run`, the scheduler, validation,
`Server.infer`) is called in a loop on a 16-value identity, and each row adds one layer to the one above it.
The last row is the engine of `--frontend-workers` around `Server.infer`: its connection's channel is handed
64 `Infer` frames at a time, as one read from a worker brings them, and what it writes goes nowhere (the wire
format both ways, the request's start and the reply, without the socket).

    .venv/bin/python bench/request_layers.py --backend onnxruntime
    .venv/bin/python bench/request_layers.py --trees .,/tmp/base --rounds 3      # /tmp/base: a worktree

The loop lets the event loop turn every 64 calls, as a server's loop turns between reads (without a turn, what
is deferred to the end of one, the statistics of each execution, piles up and the collector walks it). Every
figure is the best of 3 passes of `--calls` calls, less the cost of making the request; a tree is measured in a
process of its own pinned to one CPU, and with several trees the rounds alternate between them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = [
    "request",
    "instance_execute",
    "execute",
    "pool.run",
    "scheduler",
    "validate + model",
    "Server.infer",
    "engine connection",
]
BURST = 64  # requests a loop turn: the event loop turns between bursts, and the engine reads a burst at once


async def measure(backend: str, calls: int) -> dict[str, float]:
    """In the child: µs a call of each layer (the request's own making included; the parent takes it off)."""
    import numpy as np
    from frontend_workers import make_repo

    from naiad.backends.base import Timing
    from naiad.engine import wire
    from naiad.engine.core import EngineService, WorkerConnection
    from naiad.inference import InferenceRequest, RequestedOutput
    from naiad.server import Server, ServerOptions
    from naiad.shared_memory.system import SharedMemoryManager

    root = Path(tempfile.mkdtemp())
    make_repo(root / "repo", 1, backend)
    server = Server(ServerOptions(model_repositories=[str(root / "repo")]))
    await server.start()
    data = np.random.default_rng(0).random(16, dtype=np.float32)

    def request() -> InferenceRequest:
        return InferenceRequest(
            model_name="identity_var",
            inputs={"INPUT0": data},
            datatypes={"INPUT0": "FP32"},
            outputs=[RequestedOutput("OUTPUT0", True, 0, {})],
        )

    mv = server.repository.get("identity_var", -1)
    pool = mv.scheduler.pool
    inst = pool.instances[0]
    for _ in range(200):  # the inline policy qualifies the instance for the event loop
        await server.infer(request())

    async def through_pool(req: InferenceRequest) -> None:
        taken = pool.try_acquire()
        try:
            await pool.run(taken, [req], time.monotonic_ns())
        finally:
            pool.release(taken)

    async def through_model(req: InferenceRequest) -> None:
        mv.validate(req)
        await mv.infer(req)

    backend_execute = getattr(inst, "backend", None)
    layers = {
        "request": None,
        "instance_execute": (lambda r: backend_execute.instance_execute(inst.state, [r]))
        if backend_execute is not None
        else None,
        "execute": lambda r: inst.execute([r], Timing()),
        "pool.run": through_pool,
        "scheduler": mv.scheduler.submit,
        "validate + model": through_model,
        "Server.infer": server.infer,
    }
    out: dict[str, float] = {}
    for name, fn in layers.items():
        if name != "request" and fn is None:
            continue  # (a python model has no backend object: its instance executes itself)
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for i in range(calls):
                if i % BURST == 0:
                    await asyncio.sleep(0)
                req = request()
                if fn is not None:
                    result = fn(req)
                    if asyncio.iscoroutine(result):
                        await result
            best = min(best, time.perf_counter() - t0)
        out[name] = best / calls * 1e6
    # the engine of --frontend-workers around Server.infer
    conn = WorkerConnection(EngineService(server, SharedMemoryManager()))
    conn.channel.connection_made(_Discard())
    desc = wire.encode_request(request(), conn.engine.pool)  # (as the tree's own worker describes it)
    burst = b"".join(wire.frame(wire.Infer(i, desc)) for i in range(BURST))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls // BURST):
            await asyncio.sleep(0)
            conn.channel.data_received(burst)
            for _ in range(BURST):  # (the parent takes the request's making off this row too)
                request()
        best = min(best, time.perf_counter() - t0)
    out["engine connection"] = best / (calls // BURST * BURST) * 1e6
    await conn.engine.stop()  # (its connection, slab pool and socket directory)
    await server.stop()
    return out


class _Discard:
    """The engine connection's transport: what it writes goes nowhere."""

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


def child(tree: Path, backend: str, calls: int, cpu: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree / "server"), str(ROOT / "bench")]))
    cmd = [sys.executable, __file__, "--child", "--backend", backend, "--calls", str(calls)]
    out = subprocess.run(
        ["taskset", "-c", str(cpu), *cmd], env=env, stdout=subprocess.PIPE, text=True, check=True
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--trees", default=".", help="checkouts to compare, comma-separated (their server/ is used)"
    )
    ap.add_argument("--backend", choices=["onnxruntime", "python"], default="onnxruntime")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        import uvloop

        print(json.dumps(uvloop.run(measure(args.backend, args.calls))))
        return
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    cpu = max(os.sched_getaffinity(0))
    runs: dict[Path, list[dict[str, float]]] = {t: [] for t in trees}
    for r in range(args.rounds):
        for tree in trees:
            figures = child(tree, args.backend, args.calls, cpu)
            runs[tree].append(figures)
            made = figures["request"]
            row = ", ".join(f"{k} {v - made:.2f}" for k, v in figures.items() if k != "request")
            print(f"round {r + 1} {tree}: {row} µs", flush=True)
    print(
        f"\nmedians over rounds, µs a request ({args.backend} identity, 16 FP32 values, the request's making off):"
    )
    print("| layer | " + " | ".join(str(t) for t in trees) + " |")
    print("|---|" + "---|" * len(trees))
    for name in LAYERS[1:]:
        cells = []
        for tree in trees:
            values = [f[name] - f["request"] for f in runs[tree] if name in f]
            cells.append(f"{statistics.median(values):.2f}" if values else "n/a")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
