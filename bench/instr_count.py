"""Instructions per request of Naiad (valgrind callgrind), for one or more checkouts: a noise-free A/B.

    python bench/instr_count.py --checkout . --checkout /tmp/base --requests 300 \\
        identity_16/http_json/c1 identity_16/grpc/c1 identity_64k/grpc/c1

Each checkout's server runs under `valgrind --tool=callgrind --instr-atstart=no` with the bench model
repository; per scenario it gets 100 unmeasured requests, then instrumentation is switched on for exactly
`--requests` requests sent by h2load (`--h1` for HTTP) on the scenario's number of connections, one request in
flight on each, and the instructions executed in the server process (Python, uvloop, protobuf, numpy and the
kernel-call wrappers; not the kernel) are divided by that count. Under valgrind the server is ~50x slower, so
timings mean nothing here: this measures work, not latency. Deterministic to about 0.1% run to run on the same
tree (at c1; with more connections the split of work between loop turns varies a little more).

`--frontend-workers N` serves with N worker processes (valgrind follows them: `--trace-children=yes`) and counts
every process of the server, with the engine's and the workers' shares. The dumps (`callgrind.out.<pid>.<n>`) stay
in the bench's work directory (`callgrind/<checkout's index>/`) for `callgrind_annotate --inclusive=yes`.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import run as bench  # (the bench driver: its scenarios, bodies and ports)

# Under valgrind every execution is ~50x slower, so a fast model would never qualify to execute inline on the event
# loop (backends/base.py: InlinePolicy) and the server would measure its threaded path instead of the one it takes
# at full speed. The limits are scaled by the same factor (trees without the policy are left as they are).
INLINE_UNDER_VALGRIND = (
    "try:\n"
    "    from naiad.backends.base import InlinePolicy\n"
    "    InlinePolicy.LIMIT_NS *= 50; InlinePolicy.EVICT_NS *= 50\n"
    "except ImportError:\n"
    "    pass\n"
)


def h2load_cmd(sc: bench.Scenario, body: bench.Body, n: int) -> list[str]:
    if sc.proto == "grpc":
        return [
            "h2load",
            f"-n{n}",
            f"-c{sc.conc}",
            "-m1",
            "-d",
            str(body.path),
            "-H",
            "content-type: application/grpc",
            "-H",
            "te: trailers",
            f"http://127.0.0.1:{bench.GRPC_PORT}{bench.GRPC_PATH}",
        ]
    headers = ["-H", "content-type: application/json"]
    if body.header_len is not None:
        headers = [
            "-H",
            "content-type: application/octet-stream",
            "-H",
            f"inference-header-content-length: {body.header_len}",
        ]
    return [
        "h2load",
        "--h1",
        f"-n{n}",
        f"-c{sc.conc}",
        "-m1",
        "-d",
        str(body.path),
        *headers,
        f"http://127.0.0.1:{bench.HTTP_PORT}/v2/models/{sc.model}/infer",
    ]


def send(sc, body, n: int) -> None:
    p = subprocess.run(h2load_cmd(sc, body, n), capture_output=True, text=True, timeout=600)
    m = re.search(r"status codes: (\d+) 2xx", p.stdout)
    if p.returncode or not m or int(m.group(1)) != n:
        raise RuntimeError(f"h2load: {p.stdout[-1500:]}{p.stderr[-500:]}")


def instructions(pid: int, out: Path) -> int:
    """Dump callgrind's counters of process `pid` (and zero them); the dump's total instructions."""
    pattern = f"{out.name}.{pid}*"
    before = set(out.parent.glob(pattern))
    subprocess.run(["callgrind_control", "--dump", str(pid)], check=True, capture_output=True)
    for _ in range(600):
        new = set(out.parent.glob(pattern)) - before
        if new:
            text = max(new, key=lambda p: p.stat().st_mtime).read_text(errors="replace")
            m = re.search(r"^totals: (\d+)", text, re.M) or re.search(r"^summary: (\d+)", text, re.M)
            if m:
                return int(m.group(1))
        time.sleep(0.1)
    raise RuntimeError("callgrind wrote no dump")


def server_pids(root: int) -> list[int]:
    """The server's processes under valgrind: the engine (or the one process) first, then its workers."""
    p = subprocess.run(["pgrep", "-P", str(root)], capture_output=True, text=True)
    return [root, *sorted(int(x) for x in p.stdout.split())]


def instr(pids: list[int], on: bool) -> None:
    for pid in pids:
        subprocess.run(
            ["callgrind_control", f"--instr={'on' if on else 'off'}", str(pid)],
            check=True,
            capture_output=True,
        )


def measure(checkout: Path, scenarios, n: int, work: Path, workers: int = 1) -> dict[str, float]:
    work.mkdir(parents=True, exist_ok=True)
    for f in work.glob("callgrind.out*"):
        f.unlink()
    out = work / "callgrind.out"
    models = sorted({sc.model for sc in scenarios})
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        f"--callgrind-out-file={out}.%p",
        *(["--trace-children=yes"] if workers > 1 else []),
        str(bench.NAIAD_VENV / "bin" / "python"),
        "-c",
        INLINE_UNDER_VALGRIND
        + "import sys; from naiad.cli import main; sys.argv[0] = 'naiad'; sys.exit(main())",
        "serve",
        "--model-repository",
        str(bench.MODELS),
        "--http-port",
        str(bench.HTTP_PORT),
        "--grpc-port",
        str(bench.GRPC_PORT),
        "--metrics-port",
        str(bench.METRICS_PORT),
    ]
    if "--busy-poll-us" in (checkout / "server" / "naiad" / "cli.py").read_text():
        cmd += ["--busy-poll-us", "0"]  # polls between requests are not work done for a request
    if workers > 1:
        cmd += ["--frontend-workers", str(workers)]
    env = dict(os.environ, PYTHONPATH=str(checkout / "server"), PYTHONMALLOC="malloc")
    log = open(work / "server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not all(
            bench.http_get(f"http://127.0.0.1:{bench.HTTP_PORT}/v2/models/{m}/ready", 5)[0] == 200
            for m in models
        ):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {(work / 'server.log').read_text()[-2000:]}")
            time.sleep(1)
        pids = server_pids(proc.pid)
        if workers > 1 and len(pids) != workers + 1:
            raise RuntimeError(f"expected the engine and {workers} workers, found processes {pids}")
        result = {}
        for sc in scenarios:
            body = bench.build_body(sc, bench.expected_output(sc))
            send(sc, body, 100)  # warm-up, not collected
            instr(pids, True)
            for pid in pids:
                instructions(pid, out)  # zero the counters
            send(sc, body, n)
            counts = [instructions(pid, out) for pid in pids]
            instr(pids, False)
            result[sc.name] = sum(counts) / n
            split = (
                f"  (engine {counts[0] / n:,.0f}, workers {sum(counts[1:]) / n:,.0f})" if workers > 1 else ""
            )
            print(
                f"  {checkout}  {sc.name:30s} {sum(counts) / n:12,.0f} instructions/request{split}",
                flush=True,
            )
        return result
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
        log.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenarios", nargs="+", help="model/protocol/c1 names from `bench/run.py --list`")
    p.add_argument("--checkout", action="append", type=Path, required=True, help="a Naiad tree (repeatable)")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--frontend-workers", type=int, default=1, help="serve with this many worker processes")
    args = p.parse_args()
    by_name = {s.name: s for s in bench.all_scenarios()}
    scs = [by_name[n] for n in args.scenarios]
    results = {}
    for i, co in enumerate(args.checkout):
        results[co] = measure(
            co.resolve(), scs, args.requests, bench.WORK / "callgrind" / str(i), args.frontend_workers
        )
    print("\n| scenario | " + " | ".join(str(c) for c in args.checkout) + " | ratio (first/last) |")
    print("|---|" + "---|" * (len(args.checkout) + 1))
    for sc in scs:
        vals = [results[c][sc.name] for c in args.checkout]
        print(f"| {sc.name} | " + " | ".join(f"{v:,.0f}" for v in vals) + f" | {vals[0] / vals[-1]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
