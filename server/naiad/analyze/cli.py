"""The `naiad analyze` command line: parse, run the sweep with a progress bar, write the reports."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sweep import Result

# The sweep, load generator and report (and their dependencies: requests, aiohttp, matplotlib) are imported
# when `naiad analyze` runs, never by `naiad serve`, whose parser defines this subcommand too.


def _ints(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got '{text}'")
    return values


def _bools(text: str) -> list[bool]:
    table = {"on": True, "off": False, "true": True, "false": False}
    try:
        return [table[x.strip().lower()] for x in text.split(",") if x.strip()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"expected a list of on/off, got '{text}'") from None


def _shape(text: str) -> tuple[str, list[int]]:
    name, _, dims = text.rpartition(":")
    if not name:
        raise argparse.ArgumentTypeError(f"expected <input>:<d1>,<d2>..., got '{text}'")
    return name, _ints(dims)


def add_parser(sub) -> argparse.ArgumentParser:
    a = sub.add_parser(
        "analyze",
        help="sweep max_batch_size, dynamic batching and instance counts; pick the best config for a p99 budget",
    )
    a.add_argument("--model-repository", required=True, type=Path, help="repository holding the model")
    a.add_argument("--model", required=True, help="model name")
    a.add_argument(
        "--latency-budget-ms", type=float, required=True, help="p99 latency budget in milliseconds"
    )
    a.add_argument("--output", type=Path, default=Path("analysis"), help="directory for the reports")
    a.add_argument("--max-batch-sizes", type=_ints, default=[1, 4, 16])
    a.add_argument("--dynamic-batching", type=_bools, default=[False, True], help="e.g. off,on")
    a.add_argument("--instance-counts", type=_ints, default=[1, 2])
    a.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8], help="load levels (concurrent clients)")
    a.add_argument("--measurement-seconds", type=float, default=3.0, help="recorded window per load level")
    a.add_argument("--warmup-seconds", type=float, default=0.5)
    a.add_argument(
        "--shape", type=_shape, action="append", default=[], help="<input>:<dims> for variable dims"
    )
    a.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra `naiad serve` flag, written --server-arg=--flag=value (repeatable)",
    )
    return a


class Progress:
    """A one-line progress bar on stderr (a line per step when stderr is not a terminal)."""

    def __init__(self, total: int):
        self.total, self.done, self.start = total, 0, time.monotonic()
        self.tty = sys.stderr.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        width = 30
        filled = int(width * self.done / self.total)
        elapsed = time.monotonic() - self.start
        bar = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {elapsed:5.0f}s {label}"
        sys.stderr.write(("\r" + bar.ljust(110)) if self.tty else bar + "\n")
        if self.tty and self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def run(args: argparse.Namespace) -> int:
    from . import loadgen
    from .sweep import Result, Server, variants

    try:
        import matplotlib  # noqa: F401  (checked before the sweep, not after it)
    except ImportError:
        print("naiad analyze: the chart needs matplotlib: pip install 'naiad[analyze]'", file=sys.stderr)
        return 2
    model_dir = args.model_repository / args.model
    if not model_dir.is_dir():
        print(f"naiad analyze: no model '{args.model}' in {args.model_repository}", file=sys.stderr)
        return 2
    args.output.mkdir(parents=True, exist_ok=True)
    server = Server(args.model_repository.resolve(), args.model, args.server_arg)
    try:
        server.wait_ready()
        base = server.config()
        if base.get("max_batch_size", 0) == 0:
            print(
                "naiad analyze: max_batch_size is 0, so only instance counts are swept",
                file=sys.stderr,
            )
            args.max_batch_sizes, args.dynamic_batching = [0], [False]
        metadata = server.metadata()
        metadata["_max_batch_size"] = base.get("max_batch_size", 0)
        body = loadgen.request_body(metadata, dict(args.shape), batch_size=1)
        todo = variants(args.max_batch_sizes, args.dynamic_batching, args.instance_counts)
        progress = Progress(len(todo) * len(args.concurrency))
        results: list[Result] = []
        for v in todo:
            cfg = v.apply(base)
            result = Result(v, cfg)
            results.append(result)
            try:
                server.load(cfg)
                result.config = server.config()
            except Exception as exc:  # a variant the model cannot take is a result, not the end of the run
                result.error = str(exc)
                for c in args.concurrency:
                    progress.step(f"{v.name} c={c}: load failed")
                continue
            cpu, mem = [], []
            cpu0, _ = server.usage()
            own0 = time.process_time()
            t0 = time.monotonic()
            for c in args.concurrency:
                m = loadgen.measure(
                    server.url, args.model, body, c, args.measurement_seconds, args.warmup_seconds
                )
                result.measurements.append(m)
                u, b = server.cpu_metrics()
                cpu.append(u)
                mem.append(b)
                progress.step(f"{v.name} c={c}: {m.throughput:.0f}/s p99 {m.p99_ms:.1f} ms")
            cpu1, result.server_rss = server.usage()
            wall = time.monotonic() - t0
            result.server_cpu = (cpu1 - cpu0) / wall
            result.client_cpu = (time.process_time() - own0) / wall
            result.cpu_utilization = _mean(cpu)
            result.memory_bytes = _mean(mem)
    finally:
        server.stop()
    return write(args, results)


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def write(args: argparse.Namespace, results: list[Result]) -> int:
    from . import report

    title = f"naiad analyze: {args.model}, p99 budget {args.latency_budget_ms:g} ms"
    ranked = report.ranking(results, args.latency_budget_ms)
    winner = ranked[0][0] if ranked else None
    text = report.table(results, args.latency_budget_ms)
    (args.output / "results.txt").write_text(text + "\n")
    summary = [
        {
            "config": r.variant.name,
            "concurrency": m.concurrency,
            "throughput": m.throughput,
            "p50_ms": m.p50_ms,
            "p99_ms": m.p99_ms,
        }
        for r, m in ranked
    ]
    (args.output / "ranking.json").write_text(json.dumps(summary, indent=2) + "\n")
    png = args.output / "throughput_vs_latency.png"
    report.chart(results, args.latency_budget_ms, png, title)
    (args.output / "report.html").write_text(
        report.html_report(results, args.latency_budget_ms, png, winner, title)
    )
    print(text)
    busy = report.busy_host(results)
    if busy:
        print(f"\nwarning: {report.busy_warning(busy)}", file=sys.stderr)
    if winner is None:
        print(f"\nno configuration met a p99 of {args.latency_budget_ms:g} ms; reports in {args.output}")
        return 1
    (args.output / "config.pbtxt").write_text(report.config_pbtxt(winner.config))
    best = ranked[0][1]
    print(
        f"\nbest: {winner.variant.name}, {best.throughput:.1f} inferences/s at concurrency {best.concurrency} "
        f"(p99 {best.p99_ms:.2f} ms); {args.output / 'config.pbtxt'}, {args.output / 'report.html'}"
    )
    return 0
