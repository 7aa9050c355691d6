"""Server CPU per large HTTP binary infer request by how its body is framed: `Content-Length`, `Expect:
100-continue` (what curl sends with a body over 1 MiB, waiting for the 100 before the body) and `Transfer-Encoding:
chunked` (64 KiB chunks: a client that streams a body of unknown length), each from one keep-alive connection
(http.client, requests back to back), the trees alternated round by round.

    .venv/bin/python bench/http_body_framing.py                                  # this tree, 3 rounds
    .venv/bin/python bench/http_body_framing.py --trees .,/tmp/base --rounds 3   # an A/B against a checkout
    .venv/bin/python bench/http_body_framing.py --trees .,triton                  # against the real Triton

Trees, rounds and figures as in tree_rounds.py.
"""

from __future__ import annotations

import argparse
import http.client
import sys
import tempfile
from pathlib import Path

import tree_rounds
from frontend_workers import body_file, make_repo

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


def measure(server, mode: str, body: bytes, header_len: int, seconds: float) -> tuple[float, float]:
    """(server CPU µs, wall µs) per request of `mode` for about `seconds`."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    for _ in range(5):
        one(conn, mode, body, header_len)
    try:
        return tree_rounds.timed(server, lambda: one(conn, mode, body, header_len), seconds)
    finally:
        conn.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tree_rounds.add_arguments(ap)
    ap.add_argument("--values", type=int, default=1 << 20, help="FP32 values a request (default 4 MiB)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        repo = make_repo(tmp / "repo")
        path, header_len = body_file(args.values, tmp)
        body = path.read_bytes()
        tree_rounds.run(
            args.trees,
            args.rounds,
            MODES,
            repo,
            tmp,
            lambda server, mode: measure(server, mode, body, header_len, args.duration),
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
