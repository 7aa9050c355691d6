"""Triton's Model Analyzer, unchanged, against Naiad: `local` launch mode with `naiad-tritonserver` as the server
binary, `remote` mode against a running Naiad in explicit model control, and `model-analyzer report`."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from build_models import MLP_CONFIG, export_onnx, mlp
from helpers import ROOT, NaiadProcess, free_ports

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Short windows on a shared, loaded machine: 50 requests per window and any spread between windows accepted.
PA_FLAGS = {
    "measurement-mode": "count_windows",
    "measurement-request-count": 50,
    "stability-percentage": 999,
    "max-trials": 6,
}


@pytest.fixture(scope="module")
def ma_bin() -> Path:
    """The bin directory of Model Analyzer's own venv (tools/model_analyzer/setup.sh), perf_analyzer in it."""
    done = subprocess.run(
        ["bash", str(ROOT / "tools" / "model_analyzer" / "setup.sh")],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines or not (Path(lines[-1]) / "model-analyzer").exists():
        pytest.fail(f"tools/model_analyzer/setup.sh exited {done.returncode}: {done.stderr[-1500:]}")
    return Path(lines[-1])


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """The python backend identity example and an ONNX MLP (the test repository's mlp_onnx)."""
    out = tmp_path_factory.mktemp("ma") / "models"
    shutil.copytree(ROOT / "examples" / "src" / "identity_python", out / "identity_python")
    (out / "mlp_onnx" / "1").mkdir(parents=True)
    export_onnx(mlp(), out / "mlp_onnx" / "1" / "model.onnx", 16)
    (out / "mlp_onnx" / "config.pbtxt").write_text(MLP_CONFIG)
    return out


@pytest.fixture(scope="module")
def tritonserver(tmp_path_factory) -> Path:
    """`naiad-tritonserver` of this checkout: the tritonserver command line on Naiad."""
    path = tmp_path_factory.mktemp("bin") / "naiad-tritonserver"
    code = "import sys; from naiad.cli import tritonserver_main; sys.exit(tritonserver_main())"
    path.write_text(f"#!/bin/sh\nPYTHONPATH={ROOT / 'server'} exec {sys.executable} -c '{code}' \"$@\"\n")
    path.chmod(0o755)
    return path


def model_analyzer(ma_bin: Path, *args: str, cwd: Path, timeout: float = 540) -> str:
    env = {**os.environ, "PATH": f"{ma_bin}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)  # its own venv, its own packages
    done = subprocess.run(
        [str(ma_bin / "model-analyzer"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    return out


def write_config(path: Path, work: Path, repo: Path, model: str, **extra) -> Path:
    config = {
        "model_repository": str(repo),
        "output_model_repository_path": str(work / "output_repo"),
        "override_output_model_repository": True,
        "export_path": str(work / "export"),
        "checkpoint_directory": str(work / "checkpoints"),
        "client_protocol": "grpc",
        "run_config_search_mode": "quick",
        "run_config_search_max_instance_count": 2,
        "run_config_search_max_concurrency": 4,
        "run_config_search_max_model_batch_size": 4,
        "perf_analyzer_flags": dict(PA_FLAGS),
        "profile_models": {model: {"cpu_only": True}},
        **extra,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def inference_rows(export: Path) -> list[dict]:
    with open(export / "results" / "metrics-model-inference.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_local_mode_quick_search_python_backend(ma_bin, repo, tritonserver, tmp_path):
    """Model Analyzer launches naiad-tritonserver itself, sweeps variants of the python identity model, and
    reports them; `model-analyzer report` then writes a detailed report with its plots."""
    http, grpc, metrics = free_ports(3)
    config = write_config(
        tmp_path / "config.yaml",
        tmp_path,
        repo,
        "identity_python",
        triton_launch_mode="local",
        triton_server_path=str(tritonserver),
        triton_output_path=str(tmp_path / "server.log"),
        triton_http_endpoint=f"localhost:{http}",
        triton_grpc_endpoint=f"localhost:{grpc}",
        triton_metrics_url=f"http://localhost:{metrics}/metrics",
        collect_cpu_metrics=True,
        perf_analyzer_flags={**PA_FLAGS, "shape": "INPUT0:16"},
    )
    out = model_analyzer(ma_bin, "profile", "-f", str(config), cwd=tmp_path)
    assert "Profile complete" in out, out[-3000:]
    server_log = (tmp_path / "server.log").read_text()
    assert "MODE_EXPLICIT" in server_log and "unrecognized arguments" not in server_log, server_log[-2000:]
    rows = inference_rows(tmp_path / "export")
    configs = {r["Model Config Path"] for r in rows}
    assert "identity_python_config_default" in configs and len(configs) >= 3, rows
    assert all(float(r["Throughput (infer/sec)"]) > 0 for r in rows), rows
    # the variants Model Analyzer wrote: dynamic batching on, instance counts and max_batch_size swept
    variant = (tmp_path / "output_repo" / "identity_python_config_0" / "config.pbtxt").read_text()
    assert "dynamic_batching" in variant and "KIND_CPU" in variant, variant
    summary = tmp_path / "export" / "reports" / "summaries" / "identity_python" / "result_summary.html"
    assert summary.exists()
    assert (
        tmp_path / "export" / "plots" / "simple" / "identity_python" / "throughput_v_latency.png"
    ).exists()

    report = tmp_path / "report.yaml"
    report.write_text(
        yaml.safe_dump(
            {
                "export_path": str(tmp_path / "export"),
                "checkpoint_directory": str(tmp_path / "checkpoints"),
                "report_model_configs": ["identity_python_config_0"],
            }
        )
    )
    model_analyzer(ma_bin, "report", "-f", str(report), cwd=tmp_path, timeout=300)
    detailed = (
        tmp_path / "export" / "reports" / "detailed" / "identity_python_config_0" / "detailed_report.html"
    )
    assert detailed.exists()
    assert (
        tmp_path / "export" / "plots" / "detailed" / "identity_python_config_0" / "latency_breakdown.png"
    ).exists()


def test_remote_mode_quick_search_onnx(ma_bin, repo, tmp_path):
    """Against a running Naiad in explicit model control: Model Analyzer loads each variant of the ONNX model
    through the repository API with a config override and measures it."""
    with NaiadProcess(repo, "--model-control-mode", "explicit") as naiad:
        config = write_config(
            tmp_path / "config.yaml",
            tmp_path,
            repo,
            "mlp_onnx",
            triton_launch_mode="remote",
            triton_http_endpoint=naiad.http,
            triton_grpc_endpoint=naiad.grpc,
            triton_metrics_url=f"http://{naiad.metrics}/metrics",
        )
        out = model_analyzer(ma_bin, "profile", "-f", str(config), cwd=tmp_path)
        log = naiad.output()
    assert "Profile complete" in out, out[-3000:]
    rows = inference_rows(tmp_path / "export")
    groups = {r["Instance Group"] for r in rows}
    batch_sizes = {r["Max Batch Size"] for r in rows}
    assert {"1:CPU", "2:CPU"} <= groups, rows
    assert len(batch_sizes) >= 2, rows
    assert log.count("successfully loaded 'mlp_onnx'") >= 3, log[-3000:]


def test_triton_server_flags_model_analyzer_offers(repo, tritonserver, tmp_path):
    """Of the tritonserver flags Model Analyzer lets `triton_server_flags` set, the deprecated trace spellings map
    onto --trace-config, and the ones Naiad has no use for are refused by name (docs/model-analyzer.md)."""
    trace = tmp_path / "trace.json"
    args = [f"--trace-file={trace}", "--trace-level=TIMESTAMPS", "--trace-rate=1", "--exit-timeout-secs=5"]
    with NaiadProcess(repo, "--model-control-mode", "explicit", *args) as naiad:
        import requests

        settings = requests.get(f"{naiad.url}/v2/trace/setting", timeout=10).json()
    assert settings["trace_file"] == str(trace) and settings["trace_level"] == ["TIMESTAMPS"], settings
    assert settings["trace_rate"] == "1", settings
    done = subprocess.run(
        [str(tritonserver), f"--model-repository={repo}", "--http-thread-count=4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "unrecognized arguments: --http-thread-count=4" in done.stderr, (
        done.stderr
    )
