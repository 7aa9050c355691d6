"""The attack tier for issue 35, with `naiad serve`'s default limits, on both gRPC implementations and HTTP/1.1:
a gzip bomb (509 KB inflating to 512 MiB of zeros) answered within 2 s, and three streams that each send 512 MiB
and then fail; meanwhile a normal tritonclient is served within its deadline, the server's peak RSS stays
bounded and its RSS afterwards comes back to within 50 MB of where it was (the figures: docs/security.md)."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import psutil
import pytest
import requests
import tritonclient.grpc as grpcclient
from h2frames import DATA, END_STREAM, HEADERS, RST_STREAM, SETTINGS, WINDOW_UPDATE, RawH2, frame
from helpers import ROOT, NaiadProcess

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"
BOMB_MIB = 512
AFTER_BOUND = 50 * 1024 * 1024  # RSS after an attack, over the RSS before it
PEAK_BOUND = {"naiad": 300 * 1024 * 1024}
# grpcio, the reference, inflates 512 MiB first: 1.6-11 s on a quiet 2-core VM, past 30 s once beside a loaded
# make test's other tiers; its bound only keeps a reference that never answers from hanging the test
ANSWER_WITHIN = {"naiad": 2.0, "grpcio": 120.0}
# grpcio (grpc core) is not Naiad's code: it must answer the bomb and stay up; how its other clients fare and what
# memory it holds meanwhile and after are recorded (printed; docs/security.md), not bounded
STRICT = {"naiad": True, "grpcio": False}
# the HTTP app inflates up to --http-max-input-size (64 MiB) before its 413: 0.5-1.4 s here, up to 4 s at load 23
HTTP_ANSWER_WITHIN = 8.0
CLIENT_DEADLINE = 2.0  # the concurrent client's deadline per call


def _gzip_zeros(mib: int) -> bytes:
    co = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(1 << 20)
    return b"".join(co.compress(block) for _ in range(mib)) + co.flush()


@pytest.fixture(scope="module")
def bomb() -> bytes:
    data = _gzip_zeros(BOMB_MIB)
    assert len(data) < 600_000
    return data


def _start(tmp_path_factory, implementation: str) -> NaiadProcess:
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(ROOT / "tests" / "models" / "identity_fp32", repo / "identity_fp32")
    proc = NaiadProcess(repo, "--grpc-implementation", implementation).start()
    proc.implementation = implementation
    proc.ps = psutil.Process(proc.proc.pid)
    client = grpcclient.InferenceServerClient(proc.grpc)
    _infer(client)  # warm
    client.close()
    return proc


@pytest.fixture(scope="module", params=["naiad", "grpcio"])
def server(request, tmp_path_factory):
    proc = _start(tmp_path_factory, request.param)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    proc = _start(tmp_path_factory, "naiad")
    yield proc
    proc.stop()


def _infer(client) -> None:
    data = np.arange(8, dtype=np.float32).reshape(1, 8)
    inp = grpcclient.InferInput("INPUT0", [1, 8], "FP32")
    inp.set_data_from_numpy(data)
    result = client.infer("identity_fp32", [inp], client_timeout=CLIENT_DEADLINE)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)


def _rss(server) -> int:
    """The server's RSS, its frontend workers' included (`--frontend-workers`: they receive the bytes)."""
    total = 0
    for proc in [server.ps, *server.ps.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


class Watch:
    """A normal tritonclient calling throughout, each call within its deadline (tests/steady_client.py, a process
    of its own), and the server's peak RSS."""

    def __init__(self, server):
        self.server = server
        self.before = _rss(server)
        self.peak = self.before
        self.calls, self.errors, self.slowest = 0, [], 0.0
        self.stop = threading.Event()
        script = Path(__file__).with_name("steady_client.py")
        self.client = subprocess.Popen(
            [sys.executable, str(script), server.grpc, str(CLIENT_DEADLINE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.client.stdout.readline() == "calling\n"
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()

    def _sample(self):
        while not self.stop.is_set():
            try:
                self.peak = max(self.peak, _rss(self.server))
            except psutil.Error:
                return  # the server is gone: finish() says so
            time.sleep(0.01)

    def finish(self, label: str, peak_bound: int | None = None, after_bound: int = 0) -> None:
        """Wait (up to 5 s) for RSS to come back, then check every bound (`after_bound`: instead of AFTER_BOUND)."""
        after_bound = after_bound or AFTER_BOUND
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            after = _rss(self.server)
            if after < self.before + after_bound:
                break
            time.sleep(0.1)
        time.sleep(0.3)
        self.stop.set()
        self.sampler.join(10)
        out, _ = self.client.communicate(timeout=CLIENT_DEADLINE + 10)  # stdin closed: it stops and reports
        report = json.loads(out.splitlines()[-1])
        self.calls, self.errors, self.slowest = report["calls"], report["errors"], report["slowest"]
        after = _rss(self.server)
        mib = 1 << 20
        print(
            f"{label} [{self.server.implementation}]: RSS before/peak/after "
            f"{self.before // mib}/{self.peak // mib}/{after // mib} MiB; concurrent client: {self.calls} "
            f"calls, {len(self.errors)} failed, slowest {self.slowest:.2f}s"
        )
        assert self.server.proc.poll() is None, self.server.output()[-3000:]
        if STRICT[self.server.implementation]:
            assert not self.errors, self.errors[:3]
            assert self.calls > 0
            assert self.peak < self.before + (peak_bound or PEAK_BOUND[self.server.implementation])
            assert after < self.before + after_bound, (
                f"RSS {after // mib} MiB after, {self.before // mib} before"
            )


class FlowSender:
    """Sends DATA as the server's flow-control windows and frame size allow (grpcio enforces them)."""

    def __init__(self, conn: RawH2):
        self.conn = conn
        self.conn_window = 65535
        self.initial = 65535
        self.max_frame = 16384
        self.windows: dict[int, int] = {}
        self.done: dict[int, dict] = {}  # sid -> trailers
        self.read(0.5)

    def read(self, timeout: float) -> None:
        for ftype, flags, sid, payload in self.conn.frames(timeout=timeout, until=lambda f: True):
            if ftype == SETTINGS and not flags & 1:
                for off in range(0, len(payload), 6):
                    key, value = struct.unpack_from(">HI", payload, off)
                    if key == 4:
                        for s in self.windows:
                            self.windows[s] += value - self.initial
                        self.initial = value
                    elif key == 5:
                        self.max_frame = value
                self.conn.send(frame(SETTINGS, 1, 0))
            elif ftype == WINDOW_UPDATE:
                inc = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
                if sid == 0:
                    self.conn_window += inc
                elif sid in self.windows:
                    self.windows[sid] += inc
            elif ftype == HEADERS and flags & END_STREAM:
                self.done[sid] = self.conn.decode(payload)
            elif ftype == RST_STREAM:
                self.done[sid] = {"rst": str(struct.unpack(">I", payload)[0])}

    def send(self, sid: int, data: bytes, end: bool = False, deadline: float = 60.0) -> bool:
        """False when the stream ended (or time ran out) before all of `data` went."""
        self.windows.setdefault(sid, self.initial)
        view = memoryview(data)
        pos = 0
        stop = time.monotonic() + deadline
        while pos < len(data):
            if sid in self.done or self.conn.closed or time.monotonic() > stop:
                return False
            n = min(len(data) - pos, self.conn_window, self.windows[sid], self.max_frame)
            if n <= 0:
                self.read(0.05)
                continue
            self.conn.sock.settimeout(10)  # (reading left a short timeout on the socket)
            self.conn.send(frame(DATA, 0, sid, bytes(view[pos : pos + n])))
            self.conn_window -= n
            self.windows[sid] -= n
            pos += n
        if end:
            self.conn.send(frame(DATA, END_STREAM, sid))
        return True


def _send_message(conn: RawH2, path: str, message: bytes, sid: int = 1, *headers) -> None:
    sender = FlowSender(conn)
    conn.send(conn.request_headers(path, *headers, sid=sid))
    sender.send(sid, message, end=True)


def _trailers(conn: RawH2, timeout: float) -> dict | None:
    frames = conn.frames(timeout=timeout, until=lambda f: f[0] in (HEADERS, RST_STREAM) and f[1] & END_STREAM)
    if frames and frames[-1][0] == HEADERS and frames[-1][1] & END_STREAM:
        return conn.decode(frames[-1][3])
    return None


def test_grpc_gzip_bomb_is_answered_at_once(server, bomb):
    """One ModelInfer message with grpc-encoding gzip: 509 KB inflating to 512 MiB of zeros."""
    watch = Watch(server)
    message = struct.pack(">BI", 1, len(bomb)) + bomb
    with RawH2(server.grpc) as conn:
        start = time.monotonic()
        _send_message(conn, INFER, message, 1, ("grpc-encoding", "gzip"))
        trailers = _trailers(conn, timeout=ANSWER_WITHIN[server.implementation] + 5)
        took = time.monotonic() - start
    print(f"gzip bomb [{server.implementation}]: answered after {took:.2f}s with {trailers}")
    assert trailers is not None and trailers.get("grpc-status", "0") != "0", trailers
    if server.implementation == "naiad":
        assert trailers["grpc-status"] == "8", trailers  # RESOURCE_EXHAUSTED, as grpcio's over-max answer
    assert took < ANSWER_WITHIN[server.implementation]
    watch.finish("gzip bomb")


def test_streams_that_send_512_mib_and_fail_give_the_memory_back(server):
    """Three ModelStreamInfer streams, one after another, each sending 512 MiB of a 600 MiB message and then
    resetting the stream: the half-received message is released at once, not at the next garbage collection."""
    watch = Watch(server)
    chunk = bytes(1 << 20)
    for round_ in range(3):
        with RawH2(server.grpc) as conn:
            sender = FlowSender(conn)
            sid = 1
            conn.send(conn.request_headers(STREAM_INFER, sid=sid))
            sender.send(sid, struct.pack(">BI", 0, 600 << 20))
            for _ in range(BOMB_MIB):
                if not sender.send(sid, chunk):
                    break
            conn.send(frame(RST_STREAM, 0, sid, struct.pack(">I", 8)))  # CANCEL
            conn.frames(timeout=0.5)
        time.sleep(0.2)
        print(f"after stream {round_ + 1}: RSS {_rss(server) >> 20} MiB")
    watch.finish("3 failed 512 MiB streams", peak_bound=(BOMB_MIB + 300) << 20)  # one message at a time


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_requests_still_served(server, encoding):
    """Real compressed requests (tritonclient's compression_algorithm), small and 16 MiB, are served."""
    client = grpcclient.InferenceServerClient(server.grpc)
    try:
        for n in (8, 4 << 20):
            data = np.linspace(0, 1, n, dtype=np.float32).reshape(1, n)
            inp = grpcclient.InferInput("INPUT0", [1, n], "FP32")
            inp.set_data_from_numpy(data)
            result = client.infer("identity_fp32", [inp], compression_algorithm=encoding)
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data)
    finally:
        client.close()


def test_http_gzip_bomb(http_server, bomb):
    """The same bomb as an HTTP/1.1 `Content-Encoding: gzip` body: 413 at --http-max-input-size (64 MiB)."""
    watch = Watch(http_server)
    start = time.monotonic()
    r = requests.post(
        f"{http_server.url}/v2/models/identity_fp32/infer",
        data=bomb,
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        timeout=30,
    )
    took = time.monotonic() - start
    print(f"HTTP gzip bomb: {r.status_code} after {took:.2f}s")
    assert r.status_code == 413, r.text
    assert took < HTTP_ANSWER_WITHIN
    watch.finish("HTTP gzip bomb")


def test_large_accepted_requests_give_the_memory_back(server):
    """Three 256 MiB ModelInfer calls that succeed: afterwards RSS is back within 50 MB (freed heap pages below
    live ones are returned by malloc_trim; without it RSS stayed near +290 MB here)."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb

    watch = Watch(server)
    req = pb.ModelInferRequest(model_name="identity_fp32")
    tensor = req.inputs.add(name="INPUT0", datatype="FP32")
    tensor.shape.extend([1, 64 << 20])
    req.raw_input_contents.append(bytes(256 << 20))
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(server.grpc, options=options) as channel:
        call = channel.unary_unary(
            INFER,
            request_serializer=pb.ModelInferRequest.SerializeToString,
            response_deserializer=pb.ModelInferResponse.FromString,
        )
        for _ in range(3):
            reply = call(req, timeout=60)
            assert len(reply.raw_output_contents[0]) == 256 << 20
            del reply
    del req
    watch.finish("3 accepted 256 MiB requests", peak_bound=1200 << 20)


@pytest.fixture(scope="module")
def large_http_server(tmp_path_factory):
    repo = tmp_path_factory.mktemp("repo")
    shutil.copytree(ROOT / "tests" / "models" / "identity_fp32", repo / "identity_fp32")
    proc = NaiadProcess(repo, "--http-max-input-size", str(300 << 20)).start()
    proc.implementation = "naiad"
    proc.ps = psutil.Process(proc.proc.pid)
    yield proc
    proc.stop()


def test_large_accepted_http_requests_give_the_memory_back(large_http_server):
    """Two 256 MiB binary-tensor HTTP requests on one keep-alive connection, each in a receive buffer of its own
    (past the pool's 256 MiB): afterwards RSS is back within 50 MB. (uvloop keeps a connection's last
    BufferedProtocol until the next one: a body reader that kept its buffer held the last body, +272 MiB.)"""
    watch = Watch(large_http_server)
    n = 64 << 20
    head = json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [1, n],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 4 * n},
                }
            ],
            "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    body = head + bytes(4 * n)
    with requests.Session() as session:
        for _ in range(2):
            r = session.post(
                f"{large_http_server.url}/v2/models/identity_fp32/infer",
                data=body,
                headers={"Inference-Header-Content-Length": str(len(head))},
                timeout=60,
            )
            assert r.status_code == 200, r.text[:300]
            assert len(r.content) > 4 * n
            del r
        del body
        watch.finish("2 accepted 256 MiB HTTP requests", peak_bound=1200 << 20)
