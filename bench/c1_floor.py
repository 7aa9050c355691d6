"""The concurrency-1 floor: what the kernel, loopback TCP and the load generator cost before any server work.

    python bench/c1_floor.py --rounds 3 --duration 5

A do-nothing HTTP/1.1 server (uvloop + httptools, the same stack as Naiad's fast HTTP path; it answers every
request with a fixed identity_16 response) runs under exactly the load `bench/run.py` puts on Naiad for
`identity_16/{http_json,http_binary}/c1` (same pinning, priority, wrk script and body), alternating with Naiad
round by round. The floor's p50 is the part of a c1 round trip no server written on this stack can remove; the
difference to Naiad's p50 is Naiad's own request path. `--instructions` also counts the floor server's
instructions per request under callgrind, to set next to `bench/instr_count.py`'s figure for Naiad.

`floor_poll` is the same server polling 200 µs after each request instead of sleeping, next to Naiad with its
default busy polling (`naiad`) and with `--busy-poll-us 0` (`naiad_sleep`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import instr_count  # (callgrind helpers)
import run as bench  # (the bench driver: its servers, scenarios, bodies, pinning and wrk runner)

FLOOR_SERVER = r"""
import asyncio, sys, time, httptools, uvloop
POLL_NS = int(sys.argv[3]) * 1000 if len(sys.argv) > 3 else 0  # keep polling this long after each request
BODY = b'{"model_name":"identity_16","model_version":"1","outputs":[{"name":"OUTPUT0","datatype":"FP32",' \
       b'"shape":[16],"data":[' + b",".join(b"0.5" for _ in range(16)) + b"]}]}"
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY) + BODY
class Floor(asyncio.Protocol):
    def connection_made(self, transport):
        self.transport, self.parser = transport, httptools.HttpRequestParser(self)
    def data_received(self, data):
        self.parser.feed_data(data)
    def on_message_complete(self):
        self.transport.write(ANSWER)
        if POLL_NS:
            poll.last = time.perf_counter_ns()
            if not poll.on:
                poll.on = True
                loop.call_soon(poll)
def poll():  # a callback that re-queues itself: each turn of the loop polls with a zero timeout
    if time.perf_counter_ns() - poll.last < POLL_NS:
        loop.call_soon(poll)
    else:
        poll.on = False
poll.on, poll.last = False, 0
async def main():
    global loop
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(Floor, "127.0.0.1", int(p)) for p in sys.argv[1:]]
    await asyncio.gather(*(s.serve_forever() for s in servers))
uvloop.run(main())
"""


class FloorServer(bench.Server):
    name = "floor"
    poll_us = 0

    def command(self):
        script = bench.WORK / "c1_floor_server.py"
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(FLOOR_SERVER)
        python = str(bench.NAIAD_VENV / "bin" / "python")
        return [python, str(script), str(bench.HTTP_PORT), str(bench.METRICS_PORT), str(self.poll_us)], {}

    def success_count(self, model: str) -> float | None:
        return None


class PollingFloorServer(FloorServer):
    """The floor server, polling 200 µs after each request instead of sleeping (as Naiad's --busy-poll-us)."""

    name = "floor_poll"
    poll_us = 200


class SleepingNaiadServer(bench.NaiadServer):
    name = "naiad_sleep"

    @property
    def extra_args(self) -> list[str]:
        return ["--busy-poll-us", "0"]


SCENARIOS = [
    bench.Scenario("identity_16", proto, 1, (16,), "identity") for proto in ("http_json", "http_binary")
]


def measure(rounds: int, duration: float) -> dict[tuple[str, str], list[dict]]:
    bench.export_mlp(None)  # the bench repository's ONNX models (the server is not ready without them)
    bodies = {sc.proto: bench.build_body(sc, bench.expected_output(sc)) for sc in SCENARIOS}
    log_dir = bench.WORK / "logs"
    results: dict[tuple[str, str], list[dict]] = {}
    for rnd in range(rounds):
        order = [
            FloorServer(log_dir),
            PollingFloorServer(log_dir),
            bench.NaiadServer(log_dir),
            SleepingNaiadServer(log_dir),
        ]
        for server in order if rnd % 2 == 0 else order[::-1]:
            server.start(SCENARIOS)
            try:
                for sc in SCENARIOS:
                    bench.run_wrk(sc, bodies[sc.proto], 1.0)  # warm-up
                    r = bench.run_wrk(sc, bodies[sc.proto], duration)
                    if r["errors"]:
                        raise RuntimeError(f"{server.name} {sc.name}: wrk errors {r['errors']}")
                    results.setdefault((server.name, sc.proto), []).append(r)
                    bench.log(
                        f"round {rnd + 1} {server.name:11} {sc.name}: {r['rps']:,.0f} req/s "
                        f"p50 {r['lat_p50_ms']:.3f} ms"
                    )
            finally:
                server.stop()
    return results


def floor_instructions(requests: int) -> float:
    """Instructions per request of the floor server under callgrind (user space only, as instr_count.py)."""
    work = bench.WORK / "callgrind-floor"
    work.mkdir(parents=True, exist_ok=True)
    for f in work.glob("callgrind.out*"):
        f.unlink()
    cmd, _env = FloorServer(bench.WORK / "logs").command()
    out = work / "callgrind.out"
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", *cmd],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    sc = SCENARIOS[0]
    try:
        deadline = time.monotonic() + 120
        while bench.http_get(f"http://127.0.0.1:{bench.HTTP_PORT}/v2/health/ready", 5)[0] != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the floor server did not start under valgrind")
            time.sleep(0.5)
        body = bench.build_body(sc, None)
        instr_count.send(sc, body, 100)  # warm-up, not collected
        subprocess.run(["callgrind_control", "--instr=on", str(proc.pid)], check=True, capture_output=True)
        instr_count.instructions(proc.pid, out)  # zero the counters
        instr_count.send(sc, body, requests)
        return instr_count.instructions(proc.pid, out) / requests
    finally:
        proc.kill()
        proc.wait()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=float, default=5.0)
    p.add_argument("--instructions", action="store_true", help="also count the floor's instructions/request")
    args = p.parse_args()
    results = measure(args.rounds, args.duration)
    print("\n| scenario | server | p50 ms | req/s | p50 minus its floor's |")
    print("|---|---|---|---|---|")
    for sc in SCENARIOS:
        p50 = {}
        for name, floor in (
            ("floor", None),
            ("floor_poll", None),
            ("naiad_sleep", "floor"),
            ("naiad", "floor_poll"),
        ):
            rs = results[(name, sc.proto)]
            p50[name] = statistics.median(r["lat_p50_ms"] for r in rs)
            rps = statistics.median(r["rps"] for r in rs)
            own = f"{p50[name] - p50[floor]:.3f}" if floor else ""
            print(f"| {sc.name} | {name} | {p50[name]:.3f} | {rps:,.0f} | {own} |")
    if args.instructions:
        print(f"\nfloor server: {floor_instructions(300):,.0f} instructions/request (callgrind, user space)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
