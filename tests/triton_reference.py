"""Helpers for running a *real* NVIDIA Triton as a reference oracle.

This is not a test module (it defines no tests). The real server comes from
the ``nvidia-pytriton`` wheel installed by ``tools/triton/setup.sh`` and is
started through the wrapper ``tools/triton/tritonserver``. Nothing here
installs anything: use :func:`triton_available` to skip comparisons when the
oracle has not been set up.

Example::

    from tests.triton_reference import triton_available, tritonserver

    if triton_available():
        with tritonserver(TRITON_MODELS, 18000, 18001, 18002) as t:
            requests.get(t.http_url + "/v2")
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
WRAPPER = REPO_ROOT / "tools" / "triton" / "tritonserver"
#: The comparison model repository (identity_fp32, add_sub, ...).
TRITON_MODELS = REPO_ROOT / "tools" / "triton" / "models"


def triton_venv() -> Path:
    return Path(os.environ.get("NAIAD_TRITON_VENV", str(REPO_ROOT / ".venv-triton")))


def _tritonserver_dir() -> Path:
    return triton_venv() / "lib" / "python3.11" / "site-packages" / "pytriton" / "tritonserver"


def triton_available() -> bool:
    """True when setup.sh has been run: wrapper, binary and CPU stub exist."""
    ts = _tritonserver_dir()
    return (
        WRAPPER.is_file()
        and os.access(WRAPPER, os.X_OK)
        and (ts / "bin" / "tritonserver").is_file()
        and (ts / "backends" / "python" / "libtriton_python.so").is_file()
        and (ts / "backends" / "python" / "triton_python_backend_stub").is_file()
    )


@dataclasses.dataclass
class TritonProcess:
    process: subprocess.Popen
    http_port: int
    grpc_port: int
    metrics_port: int
    log_path: Path

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def _stop(proc: subprocess.Popen, grace: float) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    # Whatever is left in the server's own process group (python backend
    # stubs included) is killed.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


@contextlib.contextmanager
def tritonserver(
    repo_path: str | os.PathLike,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    extra_args: Sequence[str] = (),
    *,
    timeout: float = 60.0,
    wait_for: str = "ready",
    log_path: str | os.PathLike | None = None,
) -> Iterator[TritonProcess]:
    """Run the real tritonserver on ``repo_path`` for the duration of the block.

    Waits until ``GET /v2/health/<wait_for>`` answers 200 (``wait_for`` is
    "ready" or "live"; use "live" when a model is expected to fail to load
    with strict readiness). Raises RuntimeError, with the server log, if the
    server exits or does not become ready within ``timeout`` seconds. The
    server (and its python-backend stub processes) is terminated on exit.
    """
    if wait_for not in ("ready", "live"):
        raise ValueError("wait_for must be 'ready' or 'live'")
    if not triton_available():
        raise RuntimeError("real Triton is not installed; run tools/triton/setup.sh")
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
        os.close(fd)
        log_file = Path(name)
    else:
        log_file = Path(log_path)
    cmd = [
        str(WRAPPER),
        f"--model-repository={Path(repo_path).resolve()}",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        *extra_args,
    ]
    with open(log_file, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    handle = TritonProcess(proc, http_port, grpc_port, metrics_port, log_file)
    try:
        url = f"{handle.http_url}/v2/health/{wait_for}"
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"tritonserver exited with {proc.returncode} before becoming "
                    f"{wait_for}:\n{handle.log()[-4000:]}"
                )
            if _status(url) == 200:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"tritonserver not {wait_for} after {timeout:.0f}s:\n{handle.log()[-4000:]}"
                )
            time.sleep(0.25)
        yield handle
    finally:
        _stop(proc, grace=35.0)
