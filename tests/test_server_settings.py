"""Seed 000's server settings through their observable effects: --log-file and batch-composition lines,
rotation, the logging extension's log_file, the start-up options table, memory-pool flags, and the
tritonserver-compatible command line."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests
from helpers import ROOT, NaiadProcess, free_ports

MODELS = ROOT / "tests" / "models"


@pytest.fixture(scope="module")
def batching_repo(tmp_path_factory) -> Path:
    repo = tmp_path_factory.mktemp("settings") / "models"
    shutil.copytree(MODELS / "identity_fp32", repo / "identity_fp32")
    cfg = repo / "identity_fp32" / "config.pbtxt"
    cfg.write_text(cfg.read_text() + "dynamic_batching { max_queue_delay_microseconds: 200000 }\n")
    return repo


def infer(url: str, value: float = 1.0) -> int:
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [value, value]}]}
    return requests.post(f"{url}/v2/models/identity_fp32/infer", json=body, timeout=30).status_code


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    return predicate()


def test_log_file_shows_batch_composition_and_survives_rotation(batching_repo, tmp_path):
    log_file = tmp_path / "naiad.log"
    with NaiadProcess(batching_repo, f"--log-file={log_file}", "--log-verbose=1") as server:
        with ThreadPoolExecutor(6) as pool:
            assert list(pool.map(lambda i: infer(server.url, i), range(6))) == [200] * 6
        lines = wait_for(lambda: [ln for ln in log_file.read_text().splitlines() if "executing" in ln])
        # Triton's line (python_be.cc) plus the batch size it ran: grep 'executing' shows the composition.
        pattern = (
            r"model identity_fp32, instance identity_fp32_0, executing (\d+) requests \(batch size (\d+)\)"
        )
        counts = [tuple(map(int, m.groups())) for m in (re.search(pattern, ln) for ln in lines) if m]
        assert counts and sum(n for n, _ in counts) == 6 and max(n for n, _ in counts) > 1, lines
        assert all(n == b for n, b in counts)  # one row per request here
        assert re.match(r"^I\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ \S+:\d+\] \"", lines[0]), lines[0]
        assert "executing" not in server.output()

        # logrotate moves the file away: the next lines go to a new file at the configured path
        log_file.rename(tmp_path / "naiad.log.1")
        assert infer(server.url) == 200
        assert wait_for(lambda: log_file.exists() and "executing" in log_file.read_text())

        # SIGHUP reopens the file (copytruncate-style tools and manual rotation)
        (tmp_path / "naiad.log").rename(tmp_path / "naiad.log.2")
        server.proc.send_signal(signal.SIGHUP)
        assert wait_for(log_file.exists)
        assert infer(server.url) == 200
        assert wait_for(lambda: "executing" in log_file.read_text())


def test_logging_extension_reports_and_changes_the_log_file(batching_repo, tmp_path):
    first, second = tmp_path / "first.log", tmp_path / "second.log"
    with NaiadProcess(batching_repo, f"--log-file={first}", "--log-verbose=1", "--log-format=ISO8601") as s:
        settings = requests.get(f"{s.url}/v2/logging", timeout=10).json()
        assert settings["log_file"] == str(first) and settings["log_format"] == "ISO8601"
        assert settings["log_verbose_level"] == 1
        r = requests.post(f"{s.url}/v2/logging", json={"log_file": str(second)}, timeout=10)
        assert r.status_code == 200 and r.json()["log_file"] == str(second)
        assert infer(s.url) == 200
        text = wait_for(lambda: second.exists() and "executing" in second.read_text() and second.read_text())
        assert re.search(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ I \d+ ", text, re.M), text[:300]
        assert "executing" not in first.read_text()
        bad = requests.post(f"{s.url}/v2/logging", json={"log_file": "/nonexistent-dir/x.log"}, timeout=10)
        assert bad.status_code == 400 and "nonexistent-dir" in bad.json()["error"]
        assert requests.get(f"{s.url}/v2/logging", timeout=10).json()["log_file"] == str(second)
        # verbose 0: no execution lines
        requests.post(f"{s.url}/v2/logging", json={"log_verbose_level": 0}, timeout=10)
        size = second.stat().st_size
        assert infer(s.url) == 200
        time.sleep(0.3)
        assert "executing" not in second.read_text()[size:]


def test_options_table_and_memory_pools(batching_repo):
    args = (
        "--pinned-memory-pool-byte-size=1000",
        "--cuda-memory-pool-byte-size=0:5000",
        "--exit-timeout-secs=7",
    )
    with NaiadProcess(batching_repo, *args) as server:
        out = wait_for(lambda: "cache_enabled" in server.output() and server.output())
    rows = dict(re.findall(r"^\| (\S+)\s+\| (.*?)\s*\|$", out, re.M))
    assert rows["server_id"] == "naiad" and rows["model_control_mode"] == "MODE_NONE"
    assert rows["pinned_memory_pool_byte_size"] == "1000"
    assert rows["cuda_memory_pool_byte_size{0}"] == "5000"
    assert rows["exit_timeout"] == "7" and rows["strict_readiness"] == "1" and rows["cache_enabled"] == "0"
    assert rows["model_repository_path[0]"] == str(batching_repo)
    assert "system_shared_memory" in rows["server_extensions"]
    assert rows["min_supported_compute_capability"] == "6.0" and rows["rate_limit"] == "OFF"


@pytest.mark.parametrize(
    "flag, message",
    [
        ("--cuda-memory-pool-byte-size=zero:5", "expected <integer gpu>:<integer bytes>"),
        ("--cuda-memory-pool-byte-size=0:-5", "both non-negative"),
        ("--pinned-memory-pool-byte-size=-1", "must be non-negative"),
        ("--log-file=/nonexistent-dir/naiad.log", "cannot open log file"),
    ],
)
def test_bad_settings_fail_clearly(batching_repo, flag, message):
    http, grpc, metrics = free_ports(3)
    cmd = [sys.executable, "-m", "naiad.cli", "serve", "--model-repository", str(batching_repo), flag]
    cmd += ["--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "server"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]


def test_tritonserver_command_line_as_seed_000_writes_it(batching_repo, tmp_path):
    """`tritonserver --log-file="$LOG_FILE" --log-verbose=1` with naiad-tritonserver, flags in Triton's form."""
    script = Path(sys.executable).parent / "naiad-tritonserver"
    assert script.exists(), "naiad-tritonserver is installed with the package (pip install -e .)"
    http, grpc, metrics = free_ports(3)
    log_file = tmp_path / "triton.log"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "server"))
    argv = [str(script), f"--model-repository={batching_repo}", f"--log-file={log_file}", "--log-verbose=1"]
    argv += [f"--http-port={http}", f"--grpc-port={grpc}", f"--metrics-port={metrics}"]
    argv += ["--model-control-mode=explicit", "--load-model=identity_fp32", "--strict-model-config=false"]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{http}"
        assert wait_for(lambda: _ready(url), timeout=60), "naiad-tritonserver did not become ready"
        assert infer(url) == 200
        assert wait_for(lambda: "executing 1 requests" in log_file.read_text())
        assert "MODE_EXPLICIT" in log_file.read_text()
    finally:
        proc.terminate()
        proc.wait(30)
    unknown = subprocess.run(
        [str(script), f"--model-repository={batching_repo}", "--no-such-flag=1"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert unknown.returncode == 2 and "unrecognized arguments: --no-such-flag=1" in unknown.stderr


def _ready(url: str) -> bool:
    try:
        return requests.get(f"{url}/v2/health/ready", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def test_pinned_pool_is_a_budget_with_pageable_fallback():
    from naiad.memory import MemoryPools

    pools = MemoryPools(pinned_bytes=1000)
    assert pools.reserve_pinned(600) and not pools.reserve_pinned(600)  # over budget: caller uses pageable
    pools.release_pinned(600)
    assert pools.reserve_pinned(1000) and pools.pinned_used == 1000
    with pytest.raises(ValueError, match="non-negative"):
        MemoryPools(pinned_bytes=-1)


def _gpu_reason() -> str | None:
    import gpu_models

    return gpu_models.cuda_device_reason()


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_reason() is not None, reason=str(_gpu_reason()))
def test_cuda_memory_pool_sizes_the_device_pool():
    from naiad import memory

    assert memory.apply_cuda_pools({0: 12_345_678}) == {}
    assert memory.cuda_pool_threshold(0) == 12_345_678


def test_serve_needs_no_optional_extra():
    """`naiad serve`'s command line loads without the packages only extras bring (the images install the base
    dependencies and a few extras): `naiad analyze`'s requests and matplotlib, boto3, OpenTelemetry."""
    blocked = [
        "requests",
        "matplotlib",
        "boto3",
        "opentelemetry",
        "xgboost",
        "lightgbm",
        "torch",
        "onnxruntime",
    ]
    code = (
        "import sys\n"
        f"for name in {blocked!r}:\n"
        "    sys.modules[name] = None\n"
        "from naiad.cli import build_parser\n"
        "args = build_parser().parse_args(['serve', '--model-repository', '/models'])\n"
        "print(args.command)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(ROOT / "server"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "serve", done.stderr[-2000:]


async def test_not_ready_until_every_listener_is_up(tmp_path, monkeypatch):
    """While the gRPC listener opens, the HTTP port is up but the server is not ready (a readiness probe on the HTTP
    port must not send clients to a gRPC port that is not listening yet, or never will be); after it, ready."""
    from naiad import cli
    from naiad.app import App
    from naiad.frontends.grpc.frontend import GrpcFrontend

    http_port, grpc_port = free_ports(2)
    args = cli.build_parser().parse_args(
        ["serve", "--model-repository", str(tmp_path), "--http-address", "127.0.0.1", "--grpc-address",
         "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(grpc_port), "--allow-metrics", "false"]
    )  # fmt: skip
    app = App(cli._options(args, True), args)
    seen = {}
    start = GrpcFrontend.start

    async def probing_start(self, *a, **kw):
        seen["ready"] = app.server.ready()
        loop = asyncio.get_running_loop()
        url = f"http://127.0.0.1:{http_port}/v2/health/ready"
        seen["http"] = await loop.run_in_executor(None, lambda: requests.get(url, timeout=5).status_code)
        await start(self, *a, **kw)

    monkeypatch.setattr(GrpcFrontend, "start", probing_start)
    await app.start()
    try:
        assert seen == {"ready": False, "http": 400}
        assert app.server.ready()
    finally:
        await app.stop(0)
