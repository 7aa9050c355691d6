"""Server CPU per large HTTP binary infer request by how its body is framed: `Content-Length`, `Expect:
100-continue` (what curl sends with a body over 1 MiB, waiting for the 100 before the body) and `Transfer-Encoding:
chunked` (64 KiB chunks: a client that streams a body of unknown length), each from one keep-alive connection
(http.client, requests back to back), the trees alternated round by round.

    .venv/bin/python bench/http_body_framing.py                                  # this tree, 3 rounds
    .venv/bin/python bench/http_body_framing.py --trees .,/tmp/base --rounds 3   # an A/B against a checkout

A figure is the median over rounds of the server's CPU-seconds per request (all its processes) and of the wall
time per request; the ratio is against the first tree.
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import sys
import tempfile
import time
from pathlib import Path

from frontend_workers import Server, body_file, make_repo

MODES = ("length", "expect", "chunked")
CHUNK = 64 * 1024


def one(conn: http.client.HTTPConnection, mode: str, body: bytes, header_len: int) -> None:
    path = "/v2/models/identity_var/infer"
    headers = {"Inference-Header-Content-Length": str(header_len), "Content-Type": "application/octet-stream"}
    if mode == "chunked":
        chunks = (body[i : i + CHUNK] for i in range(0, len(body), CHUNK))
        conn.request("POST", path, body=chunks, headers=headers, encode_chunked=True)
    elif mode == "expect":
        conn.putrequest("POST", path)
        for k, v in {**headers, "Content-Length": str(len(body)), "Expect": "100-continue"}.items():
            conn.putheader(k, v)
        conn.endheaders()
        interim = b""
        while not interim.endswith(b"\r\n\r\n"):  # the client waits for the 100 before it sends the body
            got = conn.sock.recv(1)
            if not got:
                raise ConnectionError("closed before 100 Continue")
            interim += got
        if not interim.startswith(b"HTTP/1.1 100"):
            raise RuntimeError(f"expected 100 Continue, got {interim!r}")
        conn.send(body)
    else:
        conn.request("POST", path, body=body, headers=headers)
    response = conn.getresponse()
    data = response.read()
    if response.status != 200 or len(data) < len(body) - header_len:
        raise RuntimeError(f"{mode}: HTTP {response.status}: {data[:300]!r}")


def measure(server: Server, mode: str, body: bytes, header_len: int, seconds: float) -> tuple[float, float]:
    """(server CPU µs, wall µs) per request of `mode` for about `seconds`."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    for _ in range(5):
        one(conn, mode, body, header_len)
    cpu0, n, t0 = server.cpu_seconds()[0], 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        one(conn, mode, body, header_len)
        n += 1
    wall = time.perf_counter() - t0
    cpu = server.cpu_seconds()[0] - cpu0
    conn.close()
    return cpu / n * 1e6, wall / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=".", help="comma-separated checkouts whose server code is measured")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per mode and round")
    ap.add_argument("--values", type=int, default=1 << 20, help="FP32 values a request (default 4 MiB)")
    args = ap.parse_args()
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    results: dict[tuple[Path, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        repo = make_repo(tmp / "repo")
        path, header_len = body_file(args.values, tmp)
        body = path.read_bytes()
        for r in range(args.rounds):
            for tree in trees if r % 2 == 0 else trees[::-1]:
                server = Server(repo, "1", tmp / "server.log", tree)
                try:
                    for mode in MODES:
                        cpu, wall = measure(server, mode, body, header_len, args.duration)
                        results.setdefault((tree, mode), []).append((cpu, wall))
                        print(f"round {r + 1} {tree} {mode:8s} {cpu:9.0f} µs CPU/request {wall:9.0f} µs wall")
                finally:
                    server.stop()
    print("\nmedians over rounds (ratio: against the first tree)")
    for mode in MODES:
        base = statistics.median(c for c, _ in results[(trees[0], mode)])
        for tree in trees:
            cpu = statistics.median(c for c, _ in results[(tree, mode)])
            wall = statistics.median(w for _, w in results[(tree, mode)])
            print(f"  {mode:8s} {tree!s:24s} {cpu:9.0f} µs CPU ({cpu / base:.2f}x) {wall:9.0f} µs wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
