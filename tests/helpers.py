"""Test helpers: free ports, and a real `naiad serve` process on 127.0.0.1."""

from __future__ import annotations

import atexit
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent


# Under pytest-xdist each worker takes its servers' ports from a range of its own, below the kernel's ephemeral
# range (32768 and up), so no other worker's server and no client's outgoing connection can be given the port
# between the moment it is found free and the moment the test's server binds it.
_WORKER_PORTS = 2500
_next_port: int | None = None


def free_ports(n: int) -> list[int]:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if not worker.startswith("gw"):
        return _ephemeral_ports(n)
    global _next_port
    index = int(worker[2:])
    low = 10000 + index * _WORKER_PORTS
    if _next_port is None or not low <= _next_port < low + _WORKER_PORTS:
        # where in the range this process starts: another run's worker of the same index (two `make test`s on one
        # machine) starts elsewhere in it
        _next_port = low + (os.getpid() * 7919) % _WORKER_PORTS
    ports: list[int] = []
    for _ in range(_WORKER_PORTS):
        port = _next_port
        _next_port = low + (_next_port + 1 - low) % _WORKER_PORTS
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
        if len(ports) == n:
            return ports
    return _ephemeral_ports(n)


def _ephemeral_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


_LOG_DIR: str | None = None


def server_log_dir() -> str:
    """A directory for this test process's server logs, removed when it exits (NAIAD_TEST_KEEP_LOGS=1 keeps it):
    a test reads a server's log after stopping it, and a `make test` used to leave ~600 of them in /tmp."""
    global _LOG_DIR
    if _LOG_DIR is None:
        _LOG_DIR = tempfile.mkdtemp(prefix="naiad-test-logs-")
        if os.environ.get("NAIAD_TEST_KEEP_LOGS") != "1":
            atexit.register(shutil.rmtree, _LOG_DIR, True)
    return _LOG_DIR


class NaiadProcess:
    """`naiad serve` in a subprocess; `.http`, `.grpc`, `.metrics` are host:port strings."""

    def __init__(
        self,
        repos,
        *args: str,
        wait_ready: bool = True,
        timeout: float = 90.0,
        client_cert=None,
        env: dict | None = None,
        new_session: bool = False,
    ):
        self.new_session = new_session  # a process group of its own, for tests that signal the whole group
        self.extra_env = dict(env or {})  # on top of this process's environment (None removes a variable)
        self.repos = [str(r) for r in (repos if isinstance(repos, (list, tuple)) else [repos])]
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        self.args = list(args)
        self.wait_ready = wait_ready
        self.client_cert = client_cert  # (cert, key) files for a server that requires a client certificate
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None
        self.log_path = None

    @property
    def http(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics(self) -> str:
        return f"127.0.0.1:{self.metrics_port}"

    @property
    def url(self) -> str:
        scheme = "https" if any(a.startswith("--http-use-ssl") for a in self.args) else "http"
        return f"{scheme}://{self.http}"

    def start(self) -> NaiadProcess:
        cmd = [sys.executable, "-m", "naiad.cli", "serve"]
        for r in self.repos:
            cmd += ["--model-repository", r]
        cmd += [
            "--http-address",
            "127.0.0.1",
            "--grpc-address",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--grpc-port",
            str(self.grpc_port),
            "--metrics-port",
            str(self.metrics_port),
            # idle keep-alive connections (the test's own clients, still open when it stops the server) close at
            # once on SIGTERM instead of after the production grace; tests of the drain give their own value
            "--drain-idle-connections-secs=0",
            # every server of a run started another way (`make worker-tests`: --frontend-workers 2); the test's
            # own arguments come after, so a test that sets one of these keeps its value
            *os.environ.get("NAIAD_TEST_EXTRA_ARGS", "").split(),
            *self.args,
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT / "server") + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        for key, value in self.extra_env.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        self.log = tempfile.NamedTemporaryFile(
            prefix="naiad-", suffix=".log", dir=server_log_dir(), delete=False
        )
        self.log_path = self.log.name
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=self.new_session
        )
        self._wait()
        return self

    def _wait(self) -> None:
        deadline = time.monotonic() + self.timeout
        path = "/v2/health/ready" if self.wait_ready else "/v2/health/live"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"naiad exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with warnings.catch_warnings():  # readiness only: a TLS test checks the certificate itself
                    warnings.simplefilter("ignore")
                    answer = requests.get(self.url + path, timeout=1, verify=False, cert=self.client_cert)
                if answer.status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"naiad did not become ready in {self.timeout}s:\n{self.output()}")

    def output(self) -> str:
        try:
            return Path(self.log_path).read_text()
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()  # (the file stays until this process exits: output() reads it after a stop)
        return self.proc.returncode

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def go_tool(name: str, binary: str | None = None) -> Path | None:
    """The path of a Go tool pinned in tools/go/<name> (built and cached by `make tools`), or None.

    `$NAIAD_TOOL_<NAME>` (upper case, '-' as '_') names a binary directly. Otherwise tools/go/build.sh is asked
    for the cached bin directory; when the tool is not built yet it is built now (minutes on a cold machine),
    unless NAIAD_TOOLS_BUILD=0.
    """
    binary = binary or name
    env_name = "NAIAD_TOOL_" + name.upper().replace("-", "_")
    if os.environ.get(env_name):
        path = Path(os.environ[env_name])
        return path if path.exists() else None
    if os.environ.get("NAIAD_TOOLS_BUILD") == "0":
        return None
    try:
        out = subprocess.run(
            ["bash", str(ROOT / "tools" / "go" / "build.sh"), name],
            capture_output=True,
            text=True,
            timeout=3600,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.strip().splitlines()
    path = Path(lines[-1]) / binary if lines else None
    return path if path is not None and path.exists() else None


def perf_analyzer() -> Path:
    """Triton's perf_analyzer (a C++ client), fetched once by tools/perf_analyzer/setup.sh into a cache.

    `$NAIAD_TOOL_PERF_ANALYZER` names a binary directly. When it cannot be had (no network, not x86_64, no root to
    install libb64): the test fails under CI=true and is skipped, with setup.sh's own words, otherwise.
    """
    import pytest

    if os.environ.get("NAIAD_TOOL_PERF_ANALYZER"):
        path = Path(os.environ["NAIAD_TOOL_PERF_ANALYZER"])
        if path.exists():
            return path
        reason = f"NAIAD_TOOL_PERF_ANALYZER={path} does not exist"
    else:
        try:
            done = subprocess.run(
                ["bash", str(ROOT / "tools" / "perf_analyzer" / "setup.sh")],
                capture_output=True,
                text=True,
                timeout=900,
                env={**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)},
            )
            lines = done.stdout.strip().splitlines()
            if done.returncode == 0 and lines and Path(lines[-1]).exists():
                return Path(lines[-1])
            reason = f"tools/perf_analyzer/setup.sh exited {done.returncode}: {done.stderr.strip()[-600:]}"
        except (OSError, subprocess.SubprocessError) as exc:
            reason = f"tools/perf_analyzer/setup.sh could not run: {exc}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"perf_analyzer is required under CI: {reason}")
    pytest.skip(f"perf_analyzer unavailable: {reason}")
