#!/usr/bin/env python3
"""Ask a real Triton how it answers chunked HTTP request bodies (docs/triton-behaviour.md, "HTTP request bodies with
`Expect` or chunked framing"): extensions, a trailer, bad sizes, data longer than its size, a pipelined request.

    .venv/bin/python tools/triton/probe_chunked.py          # starts tritonserver on the test models
    .venv/bin/python tools/triton/probe_chunked.py 8000     # the same raw requests to a server already listening

Each case goes out on a fresh connection in one write; it prints the status lines and JSON bodies that came back,
and `<EOF>` when the server closed the connection (`<open>` when it kept it open for 3 s).
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.triton_reference import TRITON_MODELS, tritonserver  # noqa: E402

HEADER = json.dumps(
    {
        "inputs": [
            {"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}}
        ],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
    }
).encode()
BODY = HEADER + np.arange(4, dtype=np.float32).tobytes()
HEAD = (
    b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: t\r\nInference-Header-Content-Length: %d\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n" % len(HEADER)
)
WHOLE = b"%x\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY)
CASES = {
    "two chunks": b"5\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (BODY[:5], len(BODY) - 5, BODY[5:]),
    "a trailer field": b"%x\r\n%s\r\n0\r\nX-Sum: 1\r\n\r\n" % (len(BODY), BODY),
    "a chunk extension": b"%x;a=b\r\n%s\r\n0\r\n\r\n" % (len(BODY), BODY),
    "an invalid size": b"zz\r\n%s\r\n0\r\n\r\n" % BODY,
    "data longer than its size": b"%x\r\n%sXX\r\n0\r\n\r\n" % (len(BODY), BODY),
    "a second request pipelined behind": WHOLE + HEAD + WHOLE,
}


def exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        sock.settimeout(3)
        out = b""
        try:
            while chunk := sock.recv(1 << 20):
                out += chunk
            return out + b"<EOF>"
        except TimeoutError:
            return out + b"<open>"


def probe(port: int) -> None:
    for name, body in CASES.items():
        out = exchange(port, HEAD + body)
        seen = [line[:100] for line in out.split(b"\r\n") if line.startswith((b"HTTP/", b"{", b"<"))]
        print(f"- {name}: {seen}")


def main() -> None:
    if len(sys.argv) > 1:
        probe(int(sys.argv[1]))
        return
    with tritonserver(
        TRITON_MODELS, 18000, 18001, 18002, ["--exit-on-error=false", "--strict-readiness=false"]
    ):
        probe(18000)


if __name__ == "__main__":
    main()
