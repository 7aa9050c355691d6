"""Graceful drain on SIGTERM: in-flight requests finish, requests on open keep-alive connections are served with
`Connection: close`, new connections are refused, gRPC clients see a GOAWAY (never a reset mid-call), exit 0."""

from __future__ import annotations

import gc
import json
import os
import select
import shutil
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from helpers import NaiadProcess, free_ports
from tritonclient.utils import InferenceServerException

MODELS = Path(__file__).parent / "models"


SLOW_STREAM_CONFIG = """name: "slow_stream"
backend: "python"
model_transaction_policy { decoupled: true }
input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "IDX" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

SLOW_STREAM_MODEL = '''import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    """Decoupled: COUNT responses 0.5 s apart, then the final flag."""

    def execute(self, requests):
        for request in requests:
            count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
            sender = request.get_response_sender()

            def run(count=count, sender=sender):
                for i in range(count):
                    time.sleep(0.5)
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("IDX", np.array([i], np.int32))]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

            threading.Thread(target=run).start()
        return None
'''


@pytest.fixture(scope="module")
def slow_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("drain") / "models"
    shutil.copytree(MODELS / "slow", repo / "slow", ignore=shutil.ignore_patterns("__pycache__"))
    (repo / "slow_stream" / "1").mkdir(parents=True)
    (repo / "slow_stream" / "config.pbtxt").write_text(SLOW_STREAM_CONFIG)
    (repo / "slow_stream" / "1" / "model.py").write_text(SLOW_STREAM_MODEL)
    return repo


class KeepAlive:
    """One HTTP/1.1 keep-alive connection on a raw socket, so that the test sees when the server closes it."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.buf = b""

    def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, dict, bytes]:
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
        if body:
            head += "Content-Type: application/json\r\n"
        self.sock.sendall(head.encode() + b"\r\n" + body)
        while b"\r\n\r\n" not in self.buf:
            self._read()
        head_bytes, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head_bytes.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        length = int(headers.get("content-length", "0"))
        while len(self.buf) < length:
            self._read()
        payload, self.buf = self.buf[:length], self.buf[length:]
        return status, headers, payload

    def infer(self, seconds: float) -> tuple[int, dict, dict]:
        body = {"inputs": [{"name": "SECONDS", "shape": [1], "datatype": "FP32", "data": [seconds]}]}
        status, headers, payload = self.request("POST", "/v2/models/slow/infer", json.dumps(body).encode())
        return status, headers, json.loads(payload)

    def _read(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buf += data

    def closed_by_server(self, wait: float) -> bool:
        """Whether the server closed the connection within `wait` seconds (EOF on the socket)."""
        readable, _, _ = select.select([self.sock], [], [], wait)
        return bool(readable) and self.sock.recv(1) == b""

    def close(self) -> None:
        self.sock.close()


def _refused(port: int, within: float = 5.0) -> bool:
    """Whether new connections to `port` are refused (within `within` seconds of SIGTERM: a loaded machine
    may take a moment to run the signal handler)."""
    deadline = time.monotonic() + within
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except ConnectionRefusedError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def _slow_http(proc: NaiadProcess, seconds: float, out: dict) -> threading.Thread:
    def call():
        conn = KeepAlive(proc.http_port)
        out["http"] = conn.infer(seconds)
        conn.close()

    t = threading.Thread(target=call)
    t.start()
    return t


def test_sigterm_drains_open_connections(slow_repo):
    (openai_port,) = free_ports(1)
    proc = NaiadProcess(
        slow_repo,
        "--exit-timeout-secs",
        "20",
        "--drain-idle-connections-secs",
        "3",
        "--openai-port",
        str(openai_port),
    ).start()
    try:
        fast = KeepAlive(proc.http_port)  # the fast path's infer
        aio = KeepAlive(proc.http_port)  # handed off to aiohttp's routes (a GET)
        idle = KeepAlive(proc.http_port)
        health = KeepAlive(proc.http_port)
        assert health.request("GET", "/v2/health/ready")[0] == 200
        openai = KeepAlive(openai_port)  # the OpenAI API's own listener
        assert openai.request("GET", "/v1/models")[0] == 200
        assert fast.infer(0)[0] == 200
        status, headers, _ = aio.request("GET", "/v2/models/slow")
        assert status == 200 and headers.get("connection") != "close"
        assert idle.infer(0)[0] == 200
        grpc = grpcclient.InferenceServerClient(proc.grpc)
        inp = grpcclient.InferInput("SECONDS", [1], "FP32")
        inp.set_data_from_numpy(np.array([0.0], dtype=np.float32))
        assert grpc.infer("slow", [inp]).as_numpy("SECONDS_OUT").tolist() == [0.0]
        slow_in = grpcclient.InferInput("SECONDS", [1], "FP32")
        slow_in.set_data_from_numpy(np.array([2.5], dtype=np.float32))
        grpc_out: list = []
        grpc.async_infer("slow", [slow_in], callback=lambda result, error: grpc_out.append((result, error)))
        results: dict = {}
        slow = _slow_http(proc, 2.5, results)
        time.sleep(0.5)
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(0.4)

        # new TCP connections are refused, on both ports
        assert _refused(proc.http_port)
        assert _refused(proc.grpc_port)
        assert _refused(openai_port)
        # a request on an open keep-alive connection is served, and closes its connection
        status, headers, body = fast.infer(0.1)
        assert status == 200 and headers.get("connection") == "close", (status, headers, body)
        assert body["outputs"][0]["data"] == [0.1]
        assert fast.closed_by_server(5)
        status, headers, _ = aio.request("GET", "/v2/models/slow")
        assert status == 200 and headers.get("connection") == "close", (status, headers)
        assert aio.closed_by_server(5)
        status, headers, _ = openai.request("GET", "/v1/models")
        assert status == 200 and headers.get("connection") == "close", (status, headers)
        assert openai.closed_by_server(5)
        # draining, the server is live but no longer ready
        status, headers, _ = health.request("GET", "/v2/health/ready")
        assert status == 400 and headers.get("connection") == "close", (status, headers)
        # an idle keep-alive connection stays open for the grace, then is closed
        assert not idle.closed_by_server(1.0)
        assert idle.closed_by_server(5)
        # the gRPC client's next call: served here, or UNAVAILABLE before it is sent (the GOAWAY was seen)
        try:
            answer = grpc.infer("slow", [inp], client_timeout=10)
            assert answer.as_numpy("SECONDS_OUT").tolist() == [0.0]
        except InferenceServerException as exc:
            assert exc.status() == "StatusCode.UNAVAILABLE", exc
            assert "reset" not in str(exc).lower() and "socket closed" not in str(exc).lower(), exc
        # the requests in flight at SIGTERM completed
        slow.join(15)
        assert results["http"][0] == 200 and results["http"][2]["outputs"][0]["data"] == [2.5]
        deadline = time.monotonic() + 15
        while not grpc_out and time.monotonic() < deadline:
            time.sleep(0.05)
        (result, error) = grpc_out[0]
        assert error is None, (error.status(), error.message(), proc.output()[-3000:])
        assert result.as_numpy("SECONDS_OUT").tolist() == [2.5]
        grpc.close()
        assert proc.proc.wait(20) == 0
        assert "Server is shutting down" not in proc.output()
    finally:
        proc.stop()


def _starting_workers(pid: int) -> set[int]:
    """The children of `pid` running multiprocessing's spawn bootstrap (python workers before `worker.main`, or
    after it); not multiprocessing's resource tracker, which is started first and ignores these signals itself."""
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for child in children:
            try:
                if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                    found.add(int(child))
            except OSError:
                pass
    return found


def test_group_sigterm_while_python_workers_start(slow_repo):
    """Ctrl-C, a pod's stop and `timeout` signal the whole process group. A SIGTERM that reaches the python
    workers of a model loading on demand while they are still starting (Python's start-up and imports, before
    they can ignore it) must not kill them: the request that loads the model is answered, then the server
    drains and exits 0. (A CI run of the scale-to-zero scenario lost 4 requests this way.)"""
    proc = NaiadProcess(
        slow_repo,
        "--model-control-mode",
        "explicit",
        "--load-on-demand",
        "--exit-timeout-secs",
        "60",
        new_session=True,
    ).start()
    try:
        results: dict = {}
        request = _slow_http(proc, 0.1, results)  # loads `slow`: 4 instances, a worker process each
        deadline = time.monotonic() + 30
        while not _starting_workers(proc.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert _starting_workers(proc.proc.pid), proc.output()[-2000:]
        os.killpg(proc.proc.pid, signal.SIGTERM)
        os.killpg(proc.proc.pid, signal.SIGINT)
        request.join(60)
        assert results["http"][0] == 200, (results["http"], proc.output()[-3000:])
        assert results["http"][2]["outputs"][0]["data"] == [0.1]
        assert proc.proc.wait(60) == 0, proc.output()[-3000:]
        assert "exited unexpectedly" not in proc.output(), proc.output()[-3000:]
    finally:
        if proc.proc.poll() is None:
            os.killpg(proc.proc.pid, signal.SIGKILL)
        proc.stop()


def test_grpcio_drain(slow_repo):
    """`--grpc-implementation grpcio`: server.stop(grace) at the start of the drain lets the call in flight
    finish; the next call is refused before it is sent, never reset mid-call."""
    proc = NaiadProcess(slow_repo, "--grpc-implementation", "grpcio", "--exit-timeout-secs", "20").start()
    try:
        grpc = grpcclient.InferenceServerClient(proc.grpc)
        inp = grpcclient.InferInput("SECONDS", [1], "FP32")
        inp.set_data_from_numpy(np.array([0.0], dtype=np.float32))
        assert grpc.infer("slow", [inp]).as_numpy("SECONDS_OUT").tolist() == [0.0]
        slow_in = grpcclient.InferInput("SECONDS", [1], "FP32")
        slow_in.set_data_from_numpy(np.array([2.0], dtype=np.float32))
        out: list = []
        grpc.async_infer("slow", [slow_in], callback=lambda result, error: out.append((result, error)))
        time.sleep(0.5)
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(0.4)
        try:
            answer = grpc.infer("slow", [inp], client_timeout=10)
            assert answer.as_numpy("SECONDS_OUT").tolist() == [0.0]
        except InferenceServerException as exc:
            assert exc.status() == "StatusCode.UNAVAILABLE", exc
            assert "reset" not in str(exc).lower() and "socket closed" not in str(exc).lower(), exc
        deadline = time.monotonic() + 15
        while not out and time.monotonic() < deadline:
            time.sleep(0.05)
        result, error = out[0]
        assert error is None, (error.status(), error.message())
        assert result.as_numpy("SECONDS_OUT").tolist() == [2.0]
        grpc.close()
        assert proc.proc.wait(20) == 0
    finally:
        proc.stop()


def test_sse_stream_in_flight_finishes(slow_repo):
    """A server-sent-events stream that is under way at SIGTERM sends every event, then the server exits 0."""
    proc = NaiadProcess(slow_repo, "--exit-timeout-secs", "20").start()
    try:
        answer = requests.post(
            f"{proc.url}/v2/models/slow_stream/generate_stream", json={"COUNT": 5}, stream=True, timeout=30
        )
        assert answer.status_code == 200
        lines = answer.iter_lines()
        first = next(line for line in lines if line.startswith(b"data: "))
        proc.proc.send_signal(signal.SIGTERM)
        events = [first] + [line for line in lines if line.startswith(b"data: ")]
        assert [json.loads(e[len(b"data: ") :])["IDX"] for e in events] == [0, 1, 2, 3, 4]
        assert proc.proc.wait(20) == 0
    finally:
        proc.stop()


def test_sigterm_exits_at_once_without_connections(slow_repo):
    """No open connection: the idle grace does not delay the exit."""
    proc = NaiadProcess(slow_repo, "--drain-idle-connections-secs", "20").start()
    try:
        gc.collect()  # the readiness probe's requests.get leaves its socket to the garbage collector
        time.sleep(0.2)
        started = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(15) == 0
        assert time.monotonic() - started < 10
    finally:
        proc.stop()


def test_sigterm_does_not_wait_for_a_tls_clients_close_notify(slow_repo, tmp_path):
    """An idle TLS keep-alive connection is closed after the grace, and that is the end of it: the drain does not
    wait for the client's close_notify (which a client that is not reading never sends) until the exit timeout."""
    import ssl

    from pki import Pki

    pki = Pki(tmp_path / "pki", "drain-ca")
    cert, key = pki.issue("server")
    tls = ("--http-use-ssl=true", "--http-server-cert", cert, "--http-server-key", key)
    proc = NaiadProcess(slow_repo, *tls, "--drain-idle-connections-secs", "1", "--exit-timeout-secs", "30")
    proc.start()
    try:
        context = ssl.create_default_context(cafile=pki.ca)
        raw = socket.create_connection(("127.0.0.1", proc.http_port), timeout=5)
        client = context.wrap_socket(raw, server_hostname="localhost")
        client.sendall(b"GET /v2/health/ready HTTP/1.1\r\nHost: localhost\r\n\r\n")
        assert client.recv(4096).startswith(b"HTTP/1.1 200")
        gc.collect()  # the readiness probe's socket
        started = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)  # the client holds its connection and reads nothing from now on
        assert proc.proc.wait(25) == 0
        assert time.monotonic() - started < 10
        client.close()
    finally:
        proc.stop()


def test_frontend_workers_drain(slow_repo):
    proc = NaiadProcess(
        slow_repo,
        "--frontend-workers",
        "2",
        "--exit-timeout-secs",
        "20",
        "--drain-idle-connections-secs",
        "2",
    ).start()
    try:
        # a worker answers (ready) before the engine has seen every worker connect; one not yet connected
        # answers 503 "the engine process is gone" until then: wait for the engine's banner
        deadline = time.monotonic() + 60
        while "Started HTTPService" not in proc.output() and time.monotonic() < deadline:
            time.sleep(0.1)
        conns = [KeepAlive(proc.http_port) for _ in range(4)]  # SO_REUSEPORT spreads them over both workers
        for conn in conns:
            status, _, body = conn.infer(0)
            assert status == 200, body
        results: dict = {}
        slow = _slow_http(proc, 2.0, results)
        time.sleep(0.5)
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(0.4)
        assert _refused(proc.http_port)
        for conn in conns:
            status, headers, body = conn.infer(0.05)
            assert status == 200 and headers.get("connection") == "close", (status, headers, body)
            assert conn.closed_by_server(5)
        slow.join(15)
        assert results["http"][0] == 200 and results["http"][2]["outputs"][0]["data"] == [2.0]
        assert proc.proc.wait(20) == 0
    finally:
        proc.stop()
