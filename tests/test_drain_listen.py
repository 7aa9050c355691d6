"""`--drain-quiet-secs`: after SIGTERM the server goes on listening while new connections still arrive (a pod whose
Service endpoint has not yet left kube-proxy's rules), on HTTP, gRPC and the OpenAI port, in one process and with
frontend workers (the engine's acceptor, or each worker's SO_REUSEPORT listener), and stops once none has come for
that long."""

from __future__ import annotations

import http.client
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from helpers import NaiadProcess, free_ports

MODELS = Path(__file__).parent / "models"
QUIET = 1.5


def _http_live(port: int, path: str = "/v2/health/live") -> int:
    """One request on a new connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def _grpc_live(port: int) -> bool:
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        return bool(client.is_server_live())
    finally:
        client.close()


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except ConnectionRefusedError:
        return True
    return False


def _serve(*args: str) -> NaiadProcess:
    proc = NaiadProcess(
        MODELS, "--model-control-mode", "explicit", "--exit-timeout-secs", "20", *args
    ).start()
    deadline = time.monotonic() + 60  # with workers, the engine's banner says every one has connected
    while "Started HTTPService" not in proc.output() and time.monotonic() < deadline:
        time.sleep(0.1)
    return proc


def _listens_while_connections_arrive(proc: NaiadProcess, call) -> None:
    """SIGTERM, then a new connection every 0.25 s for 3 s (twice the quiet time): each is answered; then none,
    and the port is closed within the quiet time (and a second); the server exits 0 and says what it saw."""
    proc.proc.send_signal(signal.SIGTERM)
    answered = 0
    end = time.monotonic() + 2 * QUIET
    while time.monotonic() < end:
        call()  # raises (connection refused) if the listener closed
        answered += 1
        time.sleep(0.25)
    assert answered >= 8
    assert proc.proc.poll() is None, "the server exited while connections still arrived"
    time.sleep(QUIET + 1.0)
    assert _refused(proc.http_port) and _refused(proc.grpc_port)
    assert proc.proc.wait(20) == 0
    assert "new connection(s) (none for 1.5s); closing the listeners" in proc.output()


@pytest.mark.parametrize(
    "workers",
    [[], ["--frontend-workers", "2"], ["--frontend-workers", "2", "--frontend-accept", "reuseport"]],
    ids=["one-process", "balanced", "reuseport"],
)
def test_http_connections_keep_the_listener_open(workers):
    proc = _serve("--drain-quiet-secs", str(QUIET), *workers)
    try:

        def call():
            assert _http_live(proc.http_port) == 200

        _listens_while_connections_arrive(proc, call)
    finally:
        proc.stop()


def test_grpc_connections_keep_the_listener_open():
    proc = _serve("--drain-quiet-secs", str(QUIET))
    try:
        _listens_while_connections_arrive(proc, lambda: _grpc_live(proc.grpc_port))
    finally:
        proc.stop()


def test_openai_port_connections_keep_the_listener_open():
    (openai_port,) = free_ports(1)
    proc = _serve("--drain-quiet-secs", str(QUIET), "--openai-port", str(openai_port))
    try:

        def call():
            assert _http_live(openai_port, "/v1/models") == 200

        _listens_while_connections_arrive(proc, call)
        assert _refused(openai_port)
    finally:
        proc.stop()


def test_unready_while_listening():
    """The listen phase is part of the drain: /v2/health/ready says 400 (as Triton says it: the kubelet's probe takes the pod out),
    /v2/health/live 200."""
    proc = _serve("--drain-quiet-secs", str(QUIET))
    try:
        assert _http_live(proc.http_port, "/v2/health/ready") == 200
        proc.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert _http_live(proc.http_port, "/v2/health/ready") == 400
        assert _http_live(proc.http_port, "/v2/health/live") == 200
        assert proc.proc.wait(20) == 0
    finally:
        proc.stop()


def test_no_connection_closes_after_the_quiet_time():
    """Nothing arrives: the listeners close after the quiet time, not at the exit timeout."""
    proc = _serve("--drain-quiet-secs", str(QUIET))
    try:
        started = time.monotonic()
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(20) == 0
        assert QUIET - 0.2 < time.monotonic() - started < QUIET + 8
        assert "0 new connection(s) (none for 1.5s)" in proc.output()
    finally:
        proc.stop()


def test_negative_quiet_time_is_refused():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "naiad.cli",
            "serve",
            "--model-repository",
            str(MODELS),
            "--drain-quiet-secs",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "--drain-quiet-secs must not be negative" in out.stdout + out.stderr
