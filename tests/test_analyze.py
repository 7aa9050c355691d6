"""`naiad analyze` on the python identity example: a small sweep, its table, chart, HTML report and winning config."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def analyze(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "server")}
    return subprocess.run(
        [sys.executable, "-m", "naiad.cli", "analyze", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("analyze") / "models"
    shutil.copytree(ROOT / "examples" / "src" / "identity_python", out / "identity_python")
    return out


def test_sweep_writes_table_chart_report_and_winning_config(repo, tmp_path):
    from naiad import config as model_config

    out = tmp_path / "out"
    done = analyze(
        "--model-repository",
        str(repo),
        "--model",
        "identity_python",
        "--latency-budget-ms",
        "500",
        "--output",
        str(out),
        "--max-batch-sizes",
        "1,8",
        "--dynamic-batching",
        "on",
        "--instance-counts",
        "1,2",
        "--concurrency",
        "1,4",
        "--measurement-seconds",
        "0.5",
        "--warmup-seconds",
        "0.2",
        "--shape",
        "INPUT0:16",
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # the progress bar: one step per (config, concurrency), 5 configs x 2 load levels
    assert "10/10" in done.stderr, done.stderr
    table = (out / "results.txt").read_text()
    for name in ("default", "mbs1_dyn_inst1", "mbs1_dyn_inst2", "mbs8_dyn_inst1", "mbs8_dyn_inst2"):
        assert name in table, table
    assert "failed" not in table, table
    ranking = json.loads((out / "ranking.json").read_text())
    assert ranking and all(r["p99_ms"] <= 500 and r["throughput"] > 0 for r in ranking), ranking
    assert ranking == sorted(ranking, key=lambda r: r["throughput"], reverse=True)
    assert (out / "throughput_vs_latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and ranking[0]["config"] in html
    # the winning config.pbtxt parses as a model config and carries the winner's settings
    winner = model_config.parse_text((out / "config.pbtxt").read_text())
    assert winner.name == "identity_python" and winner.backend == "python"
    name = ranking[0]["config"]
    if name != "default":
        assert f"mbs{winner.max_batch_size}" in name and f"inst{winner.instance_group[0].count}" in name
        assert winner.HasField("dynamic_batching")


def test_unreachable_budget_is_reported(repo, tmp_path):
    done = analyze(
        "--model-repository",
        str(repo),
        "--model",
        "identity_python",
        "--latency-budget-ms",
        "0.0001",
        "--output",
        str(tmp_path),
        "--max-batch-sizes",
        "4",
        "--dynamic-batching",
        "off",
        "--instance-counts",
        "1",
        "--concurrency",
        "1",
        "--measurement-seconds",
        "0.3",
        "--shape",
        "INPUT0:4",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no configuration met a p99 of 0.0001 ms" in done.stdout
    assert (tmp_path / "report.html").exists() and not (tmp_path / "config.pbtxt").exists()


def test_bad_arguments_are_refused(repo, tmp_path):
    done = analyze("--model-repository", str(repo), "--model", "nope", "--latency-budget-ms", "5")
    assert done.returncode == 2 and "no model 'nope'" in done.stderr
    done = analyze(
        "--model-repository",
        str(repo),
        "--model",
        "identity_python",
        "--latency-budget-ms",
        "5",
        "--instance-counts",
        "0",
    )
    assert done.returncode == 2 and "expected positive integers" in done.stderr
