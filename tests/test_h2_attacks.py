"""The resource/attack tier: each attack from issue 20 against a live `naiad serve` (loopback only, bounded
loops). For each: the server stays up, a normal tritonclient keeps being served meanwhile (a background
thread), and the server process's RSS stays under BASELINE + RSS_BOUND."""

from __future__ import annotations

import gzip
import os
import shutil
import socket
import struct
import threading
import time

import hpack
import numpy as np
import psutil
import pytest
import requests
import tritonclient.grpc as grpcclient
from h2frames import (
    CONTINUATION,
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    PING,
    RST_STREAM,
    SETTINGS,
    RawH2,
    frame,
    goaway,
    grpc_message,
)
from helpers import ROOT, NaiadProcess
from tritonclient.grpc import service_pb2 as pb

RSS_BOUND = 200 * 1024 * 1024  # what any one attack may add to the server's resident memory
MAX_MESSAGE = 64 * 1024 * 1024  # --grpc-max-message-size for this server
ENHANCE_YOUR_CALM, PROTOCOL_ERROR, CANCEL = 11, 1, 8
INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(ROOT / "tests" / "models" / "identity_fp32", repo / "identity_fp32")
    env = {"NAIAD_HTTP_HEAD_TIMEOUT": "1", "NAIAD_HTTP_BODY_GRACE": "1", "NAIAD_HTTP_MIN_BODY_RATE": "65536"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        proc = NaiadProcess(
            repo,
            "--grpc-max-message-size",
            str(MAX_MESSAGE),
            "--grpc-handshake-timeout",
            "1000",
            "--grpc-stall-timeout",
            "2000",
        ).start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    proc.ps = psutil.Process(proc.proc.pid)
    _infer(grpcclient.InferenceServerClient(proc.grpc))  # warm
    proc.baseline = proc.ps.memory_info().rss
    yield proc
    proc.stop()


def _infer(client) -> None:
    data = np.arange(8, dtype=np.float32).reshape(1, 8)
    inp = grpcclient.InferInput("INPUT0", [1, 8], "FP32")
    inp.set_data_from_numpy(data)
    np.testing.assert_array_equal(client.infer("identity_fp32", [inp]).as_numpy("OUTPUT0"), data)


@pytest.fixture
def meanwhile(server):
    """A normal tritonclient calling the server throughout the test; every call must succeed. After the
    test: the server is up and within its RSS bound."""
    stop = threading.Event()
    done, errors, peak = [0], [], [0]
    start = server.ps.memory_info().rss  # (earlier attacks may leave freed memory the allocator keeps)

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], server.ps.memory_info().rss)
            time.sleep(0.01)

    def loop():
        client = grpcclient.InferenceServerClient(server.grpc)
        while not stop.is_set():
            try:
                _infer(client)
                done[0] += 1
            except Exception as exc:
                errors.append(repr(exc))
            time.sleep(0.02)
        client.close()

    threads = [threading.Thread(target=loop, daemon=True), threading.Thread(target=sample, daemon=True)]
    for t in threads:
        t.start()
    yield
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join(10)
    assert server.proc.poll() is None, server.output()[-3000:]
    assert not errors, errors[:3]
    assert done[0] > 0
    rss = max(peak[0], server.ps.memory_info().rss)
    print(
        f"RSS at the start {(start - server.baseline) / 2**20:+.0f} MiB over the baseline, peak during the "
        f"attack {(rss - start) / 2**20:+.0f} MiB over the start"
    )
    assert rss < start + RSS_BOUND, f"RSS {rss >> 20} MiB, {start >> 20} MiB at the start"
    # (aiohttp logs its own 400s with a traceback; none may come from Naiad's code)
    for block in server.output().split("Traceback (most recent call last)")[1:]:
        assert "/naiad/" not in "\n".join(block.splitlines()[:40]), block[:3000]


def _send_until_closed(sock: socket.socket, chunks, seconds: float = 5.0) -> None:
    sock.settimeout(1.0)
    deadline = time.monotonic() + seconds
    try:
        for chunk in chunks:
            sock.sendall(chunk)
            if time.monotonic() > deadline:
                return
    except OSError:
        return  # the server stopped reading, or closed the connection


def test_continuation_flood(server, meanwhile):
    """A header block that never ends: capped at the header-list limit, GOAWAY ENHANCE_YOUR_CALM."""
    with RawH2(server.grpc) as conn:
        conn.send(frame(HEADERS, 0, 1, conn.enc.encode([(":method", "POST"), (":path", INFER)])))
        block = frame(CONTINUATION, 0, 1, b"\x40\x01a\x01b" * 3000)
        _send_until_closed(conn.sock, (block for _ in range(20_000)))  # up to 300 MB
        frames = conn.frames(timeout=3)
        assert goaway(frames)[0] == ENHANCE_YOUR_CALM
        assert conn.closed


def test_ping_flood_gets_too_many_pings(server, meanwhile):
    with RawH2(server.grpc) as conn:
        pings = frame(PING, 0, 0, b"12345678") * 1000
        _send_until_closed(conn.sock, (pings for _ in range(200)))
        code, debug = goaway(conn.frames(timeout=3))
        assert (code, debug) == (ENHANCE_YOUR_CALM, b"too_many_pings")


def test_settings_flood_by_a_client_that_never_reads(server, meanwhile):
    """Every SETTINGS is acknowledged, but reading stops while the client does not read the ACKs."""
    sock = socket.create_connection(server.grpc.rsplit(":", 1))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    with sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        flood = frame(SETTINGS, 0, 0) * 10_000
        _send_until_closed(sock, (flood for _ in range(300)), seconds=4)  # up to 27 MB of SETTINGS


def test_unknown_method_flood_is_not_echoed(server, meanwhile):
    """20k HEADERS frames naming a 4 KB path through the HPACK table (a few bytes each), never reading: the
    errors do not repeat the path, and reading pauses once the replies back up."""
    sock = socket.create_connection(server.grpc.rsplit(":", 1))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    enc = hpack.Encoder()
    fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/" + "x" * 4000),
        hpack.NeverIndexedHeaderTuple("content-type", "application/grpc"),
    ]
    first = enc.encode(fields)  # adds the path to the dynamic table
    again = enc.encode(fields)  # a few bytes: the path is an index
    assert len(again) < 40
    with sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(SETTINGS, 0, 0))
        frames = [frame(HEADERS, END_HEADERS | END_STREAM, 1, first)]
        frames += [frame(HEADERS, END_HEADERS | END_STREAM, 2 * i + 3, again) for i in range(20_000)]
        _send_until_closed(
            sock, (b"".join(frames[i : i + 500]) for i in range(0, len(frames), 500)), seconds=4
        )
        sock.settimeout(2)
        got = b""
        try:
            # 128 KiB of replies (about 1,700 of them) is plenty: one that echoed the path would be over 4 KB; and
            # through this 4 KiB receive buffer the rest trickles at TCP's delayed-ACK pace (all 1.5 MB: 35 s)
            while len(got) < 128 << 10:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                got += chunk
        except OSError:
            pass
        assert got and b"x" * 100 not in got


def test_grpc_decompression_bomb(server, meanwhile):
    """256 MiB of zeros, gzip-compressed to ~256 KB: inflated only to the message limit (64 MiB) + 1, off the
    event loop, and refused with RESOURCE_EXHAUSTED."""
    bomb = gzip.compress(b"\0" * (256 << 20), compresslevel=9)
    with RawH2(server.grpc) as conn:
        conn.send(
            conn.request_headers(INFER, ("grpc-encoding", "gzip"))
            + b"".join(
                frame(DATA, 0, 1, chunk) for chunk in _chunks(grpc_message(bomb, compressed=True), 16384)
            )
            + frame(DATA, END_STREAM, 1)
        )
        frames = conn.frames(timeout=10, until=lambda f: f[0] == HEADERS and f[1] & END_STREAM)
        trailers = conn.decode(frames[-1][3])
        assert trailers["grpc-status"] == "8", trailers  # RESOURCE_EXHAUSTED


def test_http_decompression_bomb(server, meanwhile):
    bomb = gzip.compress(b"\0" * (256 << 20), compresslevel=9)
    r = requests.post(
        f"{server.url}/v2/models/identity_fp32/infer",
        data=bomb,
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 413, r.text


def _chunks(data: bytes, size: int):
    for i in range(0, len(data), size):
        yield data[i : i + size]


def _big_stream_request(mib: int) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="no_such_model")
    t = req.inputs.add(name="INPUT0", datatype="FP32")
    t.shape.extend([1, mib << 18])
    req.raw_input_contents.append(bytes(mib << 20))
    return req


def test_failed_stream_requests_do_not_leak(server, meanwhile):
    """Three 40 MiB ModelStreamInfer messages (120 MiB in all, over the 64 MiB message limit, which applies
    per message) for a model that does not exist: each answered with an error, none kept afterwards."""
    import grpc

    with grpc.insecure_channel(
        server.grpc, options=[("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    ) as channel:
        call = channel.stream_stream(
            STREAM_INFER,
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.ModelStreamInferResponse.FromString,
        )
        replies = list(call(iter([_big_stream_request(40) for _ in range(3)]), timeout=60))
    assert len(replies) == 3
    assert all("no_such_model" in r.error_message for r in replies), replies[0].error_message


def test_stalled_response_is_reset(server, meanwhile):
    """A client that never opens its flow-control window: the response waits, then RST_STREAM CANCEL after
    the stall timeout (2 s here), and the stream's buffers go."""
    with RawH2(server.grpc, settings=struct.pack(">HI", 4, 0)) as conn:
        req = pb.ModelInferRequest(model_name="identity_fp32")
        t = req.inputs.add(name="INPUT0", datatype="FP32")
        t.shape.extend([1, 1 << 18])
        req.raw_input_contents.append(bytes(1 << 20))
        body = grpc_message(req.SerializeToString())
        conn.send(
            conn.request_headers(INFER)
            + b"".join(frame(DATA, 0, 1, c) for c in _chunks(body, 16384))
            + frame(DATA, END_STREAM, 1)
        )
        frames = conn.frames(timeout=8, until=lambda f: f[0] == RST_STREAM)
        assert frames and frames[-1][0] == RST_STREAM and struct.unpack(">I", frames[-1][3])[0] == CANCEL


def test_open_header_block_and_missing_preface_time_out(server, meanwhile):
    with RawH2(server.grpc) as conn:
        conn.send(frame(HEADERS, 0, 1, conn.enc.encode([(":method", "POST")])))
        start = time.monotonic()
        conn.frames(timeout=6)
        assert conn.closed and time.monotonic() - start < 4
    with socket.create_connection(server.grpc.rsplit(":", 1)) as sock:
        sock.settimeout(6)
        start = time.monotonic()
        while sock.recv(100):  # the server's SETTINGS, then the close
            pass
        assert time.monotonic() - start < 4


def test_empty_padded_frame_is_a_protocol_error(server, meanwhile):
    with RawH2(server.grpc) as conn:
        conn.send(conn.request_headers(INFER) + frame(DATA, 0x8, 1))
        assert goaway(conn.frames(timeout=3))[0] == PROTOCOL_ERROR


def _http_socket(server) -> socket.socket:
    return socket.create_connection(server.http.rsplit(":", 1))


def _closed_within(sock: socket.socket, trickle: bytes, seconds: float) -> bool:
    """Send `trickle` one byte every 0.1 s; True once the server closes the connection."""
    sock.settimeout(0.1)
    deadline = time.monotonic() + seconds
    for b in trickle:
        if time.monotonic() > deadline:
            return False
        try:
            sock.sendall(bytes([b]))
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


def test_http_slowloris_head_and_body(server, meanwhile):
    with _http_socket(server) as sock:
        sock.sendall(b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: x\r\n")
        assert _closed_within(sock, b"X-Slow: " + b"a" * 200, seconds=5)
    with _http_socket(server) as sock:
        sock.sendall(
            b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"
        )
        assert _closed_within(sock, b"{" * 200, seconds=5)
    with _http_socket(server) as sock:  # a chunked body decoded on the fast path (http/chunked.py)
        sock.sendall(
            b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        assert _closed_within(sock, b"1\r\n{\r\n" * 40, seconds=5)


@pytest.mark.parametrize(
    "head",
    [
        b"X-Big: " + b"a" * 100_000 + b"\r\n",
        b"".join(b"X-H%d: v\r\n" % i for i in range(1000)),
    ],
    ids=["100KB-header", "1000-headers"],
)
def test_http_oversized_heads_are_refused(server, meanwhile, head):
    body = b'{"inputs":[{"name":"INPUT0","shape":[1,1],"datatype":"FP32","data":[1]}]}'
    with _http_socket(server) as sock:
        sock.sendall(
            b"POST /v2/models/identity_fp32/infer HTTP/1.1\r\nHost: x\r\n"
            + head
            + b"Content-Length: %d\r\n\r\n" % len(body)
            + body
        )
        sock.settimeout(5)
        reply = sock.recv(65536)
    assert reply.split(b" ", 2)[1] in (b"400", b"413", b"431"), reply[:200]


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_http_compressed_requests_still_served(server, meanwhile, algorithm):
    """The bounded inflation serves real compressed requests (tritonclient's request_compression_algorithm)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.http)
    try:
        data = np.linspace(0, 1, 4096, dtype=np.float32).reshape(1, -1)
        for binary in (True, False):
            inp = httpclient.InferInput("INPUT0", list(data.shape), "FP32")
            inp.set_data_from_numpy(data, binary_data=binary)
            result = client.infer("identity_fp32", [inp], request_compression_algorithm=algorithm)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)
    finally:
        client.close()
