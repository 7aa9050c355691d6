"""The fast HTTP/1.1 infer path (naiad/frontends/http/fast.py) over raw sockets: pipelining, keep-alive,
handoff to the aiohttp app mid-connection, malformed input, disconnects.

A response from the fast path carries no `Server:` header; one from aiohttp does. Tests use that to check
which path answered."""

from __future__ import annotations

import gzip
import json
import socket
import time
import zlib

import pytest
from helpers import NaiadProcess

MODEL = "identity_fp32"
ROUTE = f"/v2/models/{MODEL}/infer"


def body_for(values) -> bytes:
    return json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, len(values)], "datatype": "FP32", "data": list(values)}]}
    ).encode()


def infer_request(values=(1, 2, 3, 4), path=ROUTE, headers: dict | None = None, version=b"HTTP/1.1") -> bytes:
    body = body_for(values)
    head = [
        b"POST %s %s" % (path.encode(), version),
        b"Host: test",
        b"Content-Length: %d" % len(body),
        b"Content-Type: application/json",
    ]
    head += [f"{k}: {v}".encode() for k, v in (headers or {}).items()]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def get_request(path: str) -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: test\r\n\r\n" % path.encode()


class Conn:
    """A raw HTTP/1.1 client connection that reads Content-Length-framed responses."""

    def __init__(self, proc: NaiadProcess, timeout: float = 10.0):
        self.sock = socket.create_connection(("127.0.0.1", proc.http_port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def response(self) -> tuple[int, dict, bytes]:
        while b"\r\n\r\n" not in self.buf:
            if not self._fill():
                raise ConnectionError(f"connection closed before a response; got {self.buf!r}")
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ")[1])
        headers = {}
        for line in lines[1:]:
            k, _, v = line.partition(":")
            headers[k.strip().lower()] = v.strip()
        n = int(headers.get("content-length", "0"))
        while len(self.buf) < n:
            if not self._fill():
                raise ConnectionError("connection closed mid-body")
        body, self.buf = self.buf[:n], self.buf[n:]
        return status, headers, body

    def closed_by_server(self) -> bool:
        """True once the server has closed the connection (EOF, or a reset)."""
        try:
            return not self._fill() and not self.buf
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def outputs(body: bytes) -> list:
    return json.loads(body)["outputs"][0]["data"]


@pytest.fixture
def conn(naiad):
    c = Conn(naiad)
    yield c
    c.close()


def test_pipelined_infers_answered_in_order(naiad, conn):
    conn.send(infer_request((1, 2, 3, 4)) + infer_request((5, 6, 7, 8)))
    for expected in ((1, 2, 3, 4), (5, 6, 7, 8)):
        status, headers, body = conn.response()
        assert status == 200, body
        assert "server" not in headers, "the fast path should have answered"
        assert headers["content-type"] == "application/json"
        assert outputs(body) == list(expected)


def test_deep_pipeline_pauses_and_resumes(naiad, conn):
    """More requests in one send than the fast path queues before it pauses reading."""
    conn.send(b"".join(infer_request((i, i, i, i)) for i in range(60)))
    for i in range(60):
        status, _, body = conn.response()
        assert status == 200 and outputs(body) == [i] * 4


def test_handoff_mid_connection(naiad, conn):
    conn.send(infer_request((1, 2, 3, 4)))
    status, headers, body = conn.response()
    assert status == 200 and "server" not in headers and outputs(body) == [1, 2, 3, 4]
    conn.send(get_request("/v2/health/ready"))
    status, headers, _ = conn.response()
    assert status == 200 and "server" in headers, "aiohttp should answer the health check"
    conn.send(infer_request((5, 6, 7, 8)))
    status, headers, body = conn.response()
    assert status == 200 and outputs(body) == [5, 6, 7, 8]


def test_handoff_waits_for_in_flight_fast_request(naiad, conn):
    """A pipelined request for aiohttp behind a slow fast-path request is answered after it."""
    slow = json.dumps(
        {"inputs": [{"name": "SECONDS", "shape": [1], "datatype": "FP32", "data": [0.3]}]}
    ).encode()
    conn.send(
        b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(slow), slow)
        + get_request("/v2/models/slow/ready")
        + infer_request((9, 9, 9, 9))
    )
    status, headers, body = conn.response()
    assert status == 200 and "server" not in headers
    assert json.loads(body)["outputs"][0]["data"] == [pytest.approx(0.3)]
    status, headers, _ = conn.response()
    assert status == 200 and "server" in headers
    status, _, body = conn.response()
    assert status == 200 and outputs(body) == [9, 9, 9, 9]


def test_versioned_route_and_errors_match_aiohttp(naiad, conn):
    conn.send(infer_request((1, 2), path=f"/v2/models/{MODEL}/versions/1/infer"))
    status, headers, body = conn.response()
    assert status == 200 and "server" not in headers and outputs(body) == [1, 2]
    # the same failing requests through the fast path and (a Content-Encoding header) through aiohttp
    for path, raw_body in (
        (f"/v2/models/{MODEL}/versions/x/infer", body_for((1,))),
        ("/v2/models/no_such_model/infer", body_for((1,))),
        (ROUTE, b"{not json"),
        (ROUTE, b'{"inputs": 3}'),
    ):
        answers = []
        for extra in (b"", b"Content-Encoding: identity\r\n"):
            conn.send(
                b"POST %s HTTP/1.1\r\nHost: t\r\n%sContent-Length: %d\r\n\r\n%s"
                % (path.encode(), extra, len(raw_body), raw_body)
            )
            status, headers, body = conn.response()
            answers.append((status, headers["content-type"], json.loads(body)))
        assert answers[0] == answers[1], path
        assert answers[0][0] in (400, 404) and "error" in answers[0][2]


def test_binary_output_headers(naiad, conn):
    head = json.dumps(
        {
            "inputs": [
                {"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    payload = head + b"\x00\x00\x80\x3f\x00\x00\x00\x40"  # 1.0, 2.0
    conn.send(
        b"POST %s HTTP/1.1\r\nHost: t\r\nInference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n%s"
        % (ROUTE.encode(), len(head), len(payload), payload)
    )
    status, headers, body = conn.response()
    assert status == 200 and headers["content-type"] == "application/octet-stream"
    n = int(headers["inference-header-content-length"])
    doc = json.loads(body[:n])
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 8
    assert body[n:] == b"\x00\x00\x80\x3f\x00\x00\x00\x40"


def test_connection_close(naiad, conn):
    conn.send(infer_request(headers={"Connection": "close"}) + infer_request((7,)))
    status, headers, body = conn.response()
    assert status == 200 and headers.get("connection") == "close" and outputs(body) == [1, 2, 3, 4]
    assert conn.closed_by_server(), "the request after Connection: close must not be answered"


def test_http10_goes_to_aiohttp(naiad, conn):
    conn.send(infer_request((3, 4), version=b"HTTP/1.0"))
    status, headers, body = conn.response()
    assert status == 200 and "server" in headers and outputs(body) == [3, 4]


@pytest.mark.parametrize(
    "accept, coding", [("gzip", "gzip"), ("gzip, deflate", "gzip"), ("deflate", "deflate"), ("br", None)]
)
def test_compressed_responses_match_aiohttp(naiad, conn, accept, coding):
    """python `requests` sends Accept-Encoding: gzip, deflate: the fast path compresses as aiohttp does."""
    answers = []
    for extra in ({}, {"Content-Encoding": "identity"}):  # fast path, then aiohttp
        conn.send(infer_request((1, 2, 3, 4), headers={"Accept-Encoding": accept, **extra}))
        status, headers, body = conn.response()
        assert status == 200 and headers.get("content-encoding") == coding
        if coding == "gzip":
            body = gzip.decompress(body)
        elif coding == "deflate":
            body = zlib.decompress(body)
        answers.append(("server" in headers, outputs(body)))
    assert answers == [(False, [1, 2, 3, 4]), (True, [1, 2, 3, 4])]


def test_chunked_request_body(naiad, conn):
    body = body_for((4, 3, 2, 1))
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + 10]), body[i : i + 10]) for i in range(0, len(body), 10)
    )
    conn.send(
        b"POST %s HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n%s0\r\n\r\n"
        % (ROUTE.encode(), chunks)
    )
    status, _, body = conn.response()
    assert status == 200 and outputs(body) == [4, 3, 2, 1]


def binary_request(data: bytes, headers: dict | None = None, chunked: bool = False) -> tuple[bytes, bytes]:
    """(head, body) of a binary-tensor infer request of FP32 `data` (binary output asked for)."""
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [1, len(data) // 4],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": len(data)},
                }
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    body = header + data
    head = [
        b"POST %s HTTP/1.1" % ROUTE.encode(),
        b"Host: t",
        b"Inference-Header-Content-Length: %d" % len(header),
    ]
    head.append(b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % len(body))
    head += [f"{k}: {v}".encode() for k, v in (headers or {}).items()]
    return b"\r\n".join(head) + b"\r\n\r\n", body


def binary_output(headers: dict, body: bytes) -> bytes:
    return body[int(headers["inference-header-content-length"]) :]


def final_response(conn: Conn) -> tuple[int, dict, bytes]:
    """The next response that is not an interim 1xx one."""
    while True:
        status, headers, body = conn.response()
        if status >= 200:
            return status, headers, body


def test_expect_100_continue_is_answered_on_the_fast_path(naiad, conn):
    """curl sends `Expect: 100-continue` with a body over 1 MiB and waits for the 100 before it sends it."""
    data = bytes(range(256)) * 8192  # 2 MiB
    head, body = binary_request(data, {"Expect": "100-continue"})
    for _ in range(2):  # the connection stays on the fast path
        conn.send(head)
        status, headers, _ = conn.response()
        assert status == 100 and "server" not in headers  # before the body: the client waits for it
        conn.send(body)
        status, headers, out = conn.response()
        assert status == 200 and "server" not in headers and binary_output(headers, out) == data


def test_expect_behind_an_unanswered_request_and_other_expectations_go_to_aiohttp(naiad, conn):
    head, body = binary_request(b"\0" * 64, {"Expect": "100-continue"})
    conn.send(infer_request((1, 2)) + head + body)  # (a client may send the body without waiting)
    status, headers, out = final_response(conn)
    assert status == 200 and "server" not in headers and outputs(out) == [1, 2]
    status, headers, out = final_response(conn)
    assert status == 200 and "server" in headers and binary_output(headers, out) == b"\0" * 64
    other = Conn(naiad)
    try:
        head, body = binary_request(b"\0" * 64, {"Expect": "a-pony"})
        other.send(head + body)
        assert final_response(other)[0] == 417
    finally:
        other.close()


def chunks_of(body: bytes, size: int, extension: bytes = b"") -> bytes:
    """`body` in chunked transfer coding, `size` bytes a chunk, with its last chunk (no trailer)."""
    return (
        b"".join(
            b"%x%s\r\n%s\r\n" % (len(body[i : i + size]), extension, body[i : i + size])
            for i in range(0, len(body), size)
        )
        + b"0\r\n"
    )


@pytest.mark.parametrize("chunk", [70000, 16384, 4096])
def test_large_chunked_request_body_byte_for_byte(naiad, conn, chunk):
    """A chunked body is decoded on the fast path into a pooled buffer (http/chunked.py); the connection stays there
    for the next requests."""
    data = bytes(range(256)) * 4096 + b"\1\2\3\4"  # 1 MiB + 4 bytes
    head, body = binary_request(data, chunked=True)
    for _ in range(2):  # the second starts in a buffer of the first one's size
        conn.send(head + chunks_of(body, chunk) + b"\r\n")
        status, headers, out = conn.response()
        assert status == 200 and "server" not in headers and binary_output(headers, out) == data
    conn.send(infer_request((1, 2)))
    status, headers, out = conn.response()
    assert status == 200 and "server" not in headers and outputs(out) == [1, 2]


def test_chunked_body_split_anywhere_with_extensions_and_trailer(naiad, conn):
    """Size lines, extensions, data and the trailer cut across reads at every byte; `Expect` answered first."""
    data = bytes(range(256)) * 300
    head, body = binary_request(data, {"Expect": "100-continue"}, chunked=True)
    wire = chunks_of(body, 1000, b";name=value ; x") + b"X-Checksum: 1\r\nX-Other: 2\r\n\r\n"
    conn.send(head)
    assert conn.response()[0] == 100
    for i in range(0, len(wire), 7):
        conn.send(wire[i : i + 7])
    status, headers, out = conn.response()
    assert status == 200 and "server" not in headers and binary_output(headers, out) == data


def test_chunked_requests_pipelined_with_others(naiad, conn):
    """Chunked and Content-Length requests in one write are answered in order; thousands of small chunked requests
    in one write are each answered."""
    small = b"POST %s HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" % ROUTE.encode()
    conn.send(
        infer_request((1,))
        + small
        + chunks_of(body_for((2, 3)), 5)
        + b"\r\n"
        + infer_request((4,))
        + small
        + chunks_of(body_for((5,)), 100)
        + b"\r\n"
    )
    for expected in ([1], [2, 3], [4], [5]):
        status, headers, out = conn.response()
        assert status == 200 and "server" not in headers and outputs(out) == expected
    many = 1500  # (a request a call deeper would pass Python's recursion limit)
    conn.send((small + chunks_of(body_for((7,)), 1000) + b"\r\n") * many)
    for _ in range(many):
        status, _, out = conn.response()
        assert status == 200 and outputs(out) == [7]


@pytest.mark.parametrize(
    "wire,message",
    [
        (b"zz\r\nabc\r\n0\r\n\r\n", "invalid chunk size"),
        (b"2\r\nabc\r\n0\r\n\r\n", "chunk data longer than its size"),
        (b"1" * 5000, "chunk size line too long"),
        (b"0\r\nno colon here\r\n\r\n", "invalid trailer"),
    ],
    ids=["size", "overrun", "long-line", "trailer"],
)
def test_bad_chunked_framing_gets_400_after_earlier_answers(naiad, conn, wire, message):
    head = b"POST %s HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" % ROUTE.encode()
    conn.send(infer_request((1, 2)) + head + wire)
    status, _, out = conn.response()
    assert status == 200 and outputs(out) == [1, 2]
    status, headers, out = conn.response()
    assert status == 400 and "server" not in headers
    assert json.loads(out) == {"error": f"Bad Request: {message}"}
    assert headers.get("connection") == "close" and conn.closed_by_server()


def test_request_split_byte_by_byte(naiad, conn):
    # leading empty lines are allowed before a request line, and must not confuse the framing
    data = infer_request((1, 2, 3, 4)) + b"\r\n\r\n" + infer_request((5, 6, 7, 8))
    for i in range(len(data)):
        conn.send(data[i : i + 1])
        if i % 16 == 0:
            time.sleep(0.001)
    for expected in ([1, 2, 3, 4], [5, 6, 7, 8]):
        status, headers, body = conn.response()
        assert status == 200 and "server" not in headers and outputs(body) == expected


def test_large_body_over_many_reads(naiad, conn):
    values = [float(i % 1000) for i in range(60000)]
    data = infer_request(values) + infer_request((1, 2))
    for i in range(0, len(data), 50000):  # several reads; a large response goes out in several writes
        conn.send(data[i : i + 50000])
        time.sleep(0.002)
    status, headers, body = conn.response()
    assert status == 200 and "server" not in headers and outputs(body) == values
    assert outputs(conn.response()[2]) == [1, 2]


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x16\x03\x01\x02\x00" + b"\0" * 64 + b"\r\n\r\n",
        b"POST /v2/models/x/infer HTTP/1.1\r\nContent-Length: 12x\r\n\r\n",
        b"FOO BAR\r\n\r\n",
    ],
)
def test_garbage_gets_400_and_server_keeps_serving(naiad, garbage):
    c = Conn(naiad)
    try:
        c.send(infer_request((1,)) + garbage)
        status, _, body = c.response()
        assert status == 200 and outputs(body) == [1]
        status, headers, body = c.response()
        assert status == 400 and "error" in json.loads(body) and headers.get("connection") == "close"
        assert c.closed_by_server()
    finally:
        c.close()
    c = Conn(naiad)
    try:
        c.send(infer_request((2,)))
        assert c.response()[0] == 200
    finally:
        c.close()


def test_disconnects_do_not_disturb_the_next_client(naiad):
    before = len(naiad.output())
    # mid-body
    c = Conn(naiad)
    c.send(b'POST %s HTTP/1.1\r\nHost: t\r\nContent-Length: 1000\r\n\r\n{"inputs"' % ROUTE.encode())
    c.close()
    # during execution, with more requests queued behind it
    slow = json.dumps(
        {"inputs": [{"name": "SECONDS", "shape": [1], "datatype": "FP32", "data": [0.3]}]}
    ).encode()
    req = b"POST /v2/models/slow/infer HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (
        len(slow),
        slow,
    )
    c = Conn(naiad)
    c.send(req + infer_request() + get_request("/v2/health/ready"))
    time.sleep(0.05)
    c.sock.setsockopt(
        socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
    )  # RST on close
    c.close()
    # half-closed after sending: the response still comes
    c = Conn(naiad)
    c.send(req)
    c.sock.shutdown(socket.SHUT_WR)
    status, _, body = c.response()
    assert status == 200 and c.closed_by_server()
    c.close()
    c = Conn(naiad)
    try:
        c.send(infer_request((8, 8)))
        status, _, body = c.response()
        assert status == 200 and outputs(body) == [8, 8]
    finally:
        c.close()
    time.sleep(0.4)  # the abandoned slow request finishes and its response is dropped quietly
    new_log = naiad.output()[before:]
    assert "Traceback" not in new_log and "Exception" not in new_log, new_log


@pytest.fixture(scope="module")
def limited(model_repo):
    with NaiadProcess(
        model_repo,
        "--model-control-mode",
        "explicit",
        "--load-model",
        MODEL,
        "--http-max-input-size",
        "2000",
        "--http-restricted-api",
        "inference:X-Key=secret",
    ) as proc:
        yield proc


def test_chunked_body_over_limit_gets_413(limited):
    c = Conn(limited)
    try:
        head = (
            b"POST %s HTTP/1.1\r\nHost: t\r\nX-Key: secret\r\nTransfer-Encoding: chunked\r\n\r\n"
            % ROUTE.encode()
        )
        c.send(head + b"400\r\n" + b"x" * 1024 + b"\r\n" + b"400\r\n")  # 1 KiB, then 1 KiB more: over 2000
        status, headers, body = c.response()
        assert status == 413 and "server" not in headers
        assert json.loads(body)["error"].endswith(": request body larger than 2000 bytes")
    finally:
        c.close()


def test_content_length_over_limit_gets_413(limited):
    c = Conn(limited)
    try:
        body = body_for([1.0] * 400)
        assert len(body) > 2000
        c.send(infer_request([1.0] * 400, headers={"X-Key": "secret"}))
        status, _headers, body = c.response()
        assert status == 413 and "error" in json.loads(body)
    finally:
        c.close()


def test_restricted_inference_api(limited):
    c = Conn(limited)
    try:
        c.send(
            infer_request((1, 2))
            + infer_request((3, 4), headers={"x-key": "secret"})
            + infer_request((5,), headers={"X-Key": "wrong"})
        )
        status, headers, body = c.response()
        assert status == 403 and "server" not in headers
        assert json.loads(body) == {"error": "This API is restricted, expecting header 'x-key'"}
        status, _, body = c.response()
        assert status == 200 and outputs(body) == [3, 4]
        assert c.response()[0] == 403
        c.send(
            infer_request((1, 2), headers={"Content-Encoding": "identity"})
        )  # aiohttp answers the same way
        status, headers, body = c.response()
        assert status == 403 and "server" in headers
        assert json.loads(body) == {"error": "This API is restricted, expecting header 'x-key'"}
    finally:
        c.close()


def test_fast_path_can_be_switched_off(model_repo, monkeypatch):
    monkeypatch.setenv("NAIAD_HTTP_FAST", "0")
    with NaiadProcess(model_repo, "--model-control-mode", "explicit", "--load-model", MODEL) as proc:
        c = Conn(proc)
        try:
            c.send(infer_request((1, 2)) + infer_request((3,)))
            for expected in ([1, 2], [3]):
                status, headers, body = c.response()
                assert status == 200 and "server" in headers and outputs(body) == expected
        finally:
            c.close()
