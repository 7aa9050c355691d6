"""A real Prometheus (Debian's package) scrapes Naiad; PromQL gives the expected rate, queue time and p99."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.http as httpclient
from helpers import NaiadProcess, free_ports

PROMETHEUS = shutil.which("prometheus")
pytestmark = pytest.mark.skipif(
    PROMETHEUS is None,
    reason="Debian's prometheus is not installed (make test installs it with apt-get when it can)",
)


@pytest.fixture()
def stack(model_repo):
    naiad = NaiadProcess(model_repo, "--model-control-mode", "explicit", "--load-model", "slow").start()
    (port,) = free_ports(1)
    workdir = Path(tempfile.mkdtemp(prefix="naiad-prom-"))
    (workdir / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: naiad\n    static_configs:\n"
        f"      - targets: ['{naiad.metrics}']\n"
    )
    prom = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={workdir / 'prometheus.yml'}",
            f"--storage.tsdb.path={workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/-/ready", timeout=1).status_code == 200:
                break
        except requests.RequestException:
            time.sleep(0.2)
    yield naiad, url
    prom.terminate()
    prom.wait(10)
    naiad.stop()
    shutil.rmtree(workdir, ignore_errors=True)


def query(url: str, promql: str) -> float | None:
    r = requests.get(f"{url}/api/v1/query", params={"query": promql}, timeout=5).json()
    assert r["status"] == "success", r
    result = r["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def wait_for(url: str, promql: str, predicate, timeout: float = 20.0) -> float:
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = query(url, promql)
        if value is not None and predicate(value):
            return value
        time.sleep(0.5)
    raise AssertionError(f"{promql} = {value}")


def test_promql_rate_queue_time_and_p99(stack):
    naiad, url = stack
    wait_for(url, 'up{job="naiad"}', lambda v: v == 1)
    client = httpclient.InferenceServerClient(naiad.http, concurrency=8)
    # 24 requests of 60 ms on 4 instances, 8 at a time: each waits in the queue about one round.
    inp = httpclient.InferInput("SECONDS", [1], "FP32")
    inp.set_data_from_numpy(np.array([0.06], dtype=np.float32))
    pending = [client.async_infer("slow", [inp]) for _ in range(24)]
    for p in pending:
        p.get_result()
    stats = client.get_inference_statistics("slow")["model_stats"][0]["inference_stats"]
    expected_queue_us = stats["queue"]["ns"] / stats["queue"]["count"] / 1000
    assert expected_queue_us > 10_000  # the load really queued

    success = wait_for(url, 'nv_inference_request_success{model="slow"}', lambda v: v == 24)
    assert success == 24
    rate = wait_for(url, 'rate(nv_inference_request_success{model="slow"}[1m])', lambda v: v > 0)
    assert rate > 0
    avg_queue_us = wait_for(
        url,
        'nv_inference_queue_duration_us{model="slow"} / nv_inference_request_success{model="slow"}',
        lambda v: v > 0,
    )
    assert abs(avg_queue_us - expected_queue_us) <= 1 + 1e-3 * expected_queue_us  # us rounding
    p99 = wait_for(
        url,
        'histogram_quantile(0.99, sum by (le) (nv_inference_request_duration_seconds_bucket{model="slow"}))',
        lambda v: v > 0,
    )
    # every request took 60 ms plus up to one queue round: the 99th percentile is within (0.05, 0.25]
    assert 0.05 < p99 <= 0.25
    meta = requests.get(f"{url}/api/v1/metadata", params={"metric": "nv_inference_request_success"}).json()
    assert meta["data"]["nv_inference_request_success"][0]["type"] == "counter"
