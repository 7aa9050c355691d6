"""The sweep: start a Naiad, reload the model with each config variant (no restarts), measure each load level."""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

from . import loadgen


@dataclass
class Variant:
    """One point of the search space; `None` everywhere is the model's own config (Model Analyzer's default)."""

    max_batch_size: int | None = None
    dynamic_batching: bool | None = None
    instance_count: int | None = None

    @property
    def name(self) -> str:
        if self.max_batch_size is None and self.dynamic_batching is None and self.instance_count is None:
            return "default"
        parts = []
        if self.max_batch_size is not None:
            parts.append(f"mbs{self.max_batch_size}")
        if self.dynamic_batching is not None:
            parts.append("dyn" if self.dynamic_batching else "nodyn")
        if self.instance_count is not None:
            parts.append(f"inst{self.instance_count}")
        return "_".join(parts)

    def apply(self, config: dict) -> dict:
        """The model's config (the `/config` JSON) with this variant's settings."""
        out = copy.deepcopy(config)
        if self.max_batch_size is not None and out.get("max_batch_size", 0) > 0:
            out["max_batch_size"] = self.max_batch_size
        if self.dynamic_batching is True and out.get("max_batch_size", 0) > 0:
            # keep the queue delay; preferred sizes are re-derived by the server from the new max_batch_size
            delay = (out.get("dynamic_batching") or {}).get("max_queue_delay_microseconds", 0)
            out["dynamic_batching"] = {"max_queue_delay_microseconds": delay}
        elif self.dynamic_batching is False:
            out.pop("dynamic_batching", None)
        if self.instance_count is not None:
            groups = out.get("instance_group") or [{"kind": "KIND_CPU"}]
            for g in groups:
                g["count"] = self.instance_count
                g["kind"] = "KIND_CPU"
                g.pop("gpus", None)
            out["instance_group"] = groups
        return out


@dataclass
class Result:
    variant: Variant
    config: dict
    measurements: list[loadgen.Measurement] = field(default_factory=list)
    cpu_utilization: float = float("nan")  # mean of /metrics' nv_cpu_utilization (the host's), 0..1
    memory_bytes: float = float("nan")  # mean of /metrics' nv_cpu_memory_used_bytes (the host's)
    server_cpu: float = float(
        "nan"
    )  # cores the server's processes (python stubs included) used while measuring
    server_rss: float = float("nan")  # their resident memory after the sweep, bytes
    client_cpu: float = float("nan")  # cores the load generator (this process) used while measuring

    @property
    def other_cpu(self) -> float:
        """Cores busy with neither the server nor the load generator: other work on the host."""
        return self.cpu_utilization * (os.cpu_count() or 1) - self.server_cpu - self.client_cpu

    error: str = ""

    def best(self, budget_ms: float) -> loadgen.Measurement | None:
        """The load level with the most throughput whose p99 is within the budget."""
        ok = [m for m in self.measurements if m.errors == 0 and m.requests > 0 and m.p99_ms <= budget_ms]
        return max(ok, key=lambda m: m.throughput, default=None)


def variants(max_batch_sizes: list[int], dynamic: list[bool], instances: list[int]) -> list[Variant]:
    """The default config, then every combination (brute search, as Model Analyzer's `brute` mode)."""
    out = [Variant()]
    for mbs, dyn, inst in itertools.product(max_batch_sizes, dynamic, instances):
        out.append(Variant(mbs, dyn, inst))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`naiad serve` in explicit model-control mode on free local ports, started and stopped by the analyzer."""

    def __init__(self, repository: Path, model: str, extra: list[str] | None = None):
        self.http_port, self.grpc_port, self.metrics_port = _free_port(), _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.http_port}"
        self.metrics_url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        self.model = model
        self.log = tempfile.NamedTemporaryFile(prefix="naiad-analyze-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "naiad.cli", "serve", "--model-repository", str(repository)]
        cmd += ["--model-control-mode", "explicit", "--load-model", model]
        cmd += [
            "--http-address",
            "127.0.0.1",
            "--grpc-address",
            "127.0.0.1",
            "--metrics-address",
            "127.0.0.1",
        ]
        cmd += [f"--http-port={self.http_port}", f"--grpc-port={self.grpc_port}"]
        cmd += [f"--metrics-port={self.metrics_port}", "--metrics-interval-ms=500", *(extra or [])]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=os.environ.copy())

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"naiad exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                if requests.get(f"{self.url}/v2/health/ready", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"naiad not ready after {timeout:.0f}s:\n{self.output()[-3000:]}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def load(self, config: dict) -> None:
        """Reload the model with `config` through the repository API (a live reload, the server keeps running)."""
        body = {"parameters": {"config": json.dumps(config)}}
        r = requests.post(f"{self.url}/v2/repository/models/{self.model}/load", json=body, timeout=300)
        if r.status_code != 200:
            raise RuntimeError(r.json().get("error", r.text) if r.content else f"HTTP {r.status_code}")

    def config(self) -> dict:
        return requests.get(f"{self.url}/v2/models/{self.model}/config", timeout=10).json()

    def metadata(self) -> dict:
        return requests.get(f"{self.url}/v2/models/{self.model}", timeout=10).json()

    def cpu_metrics(self) -> tuple[float, float]:
        """(nv_cpu_utilization, nv_cpu_memory_used_bytes) from the server's Prometheus endpoint."""
        text = requests.get(self.metrics_url, timeout=10).text
        values = {}
        for name in ("nv_cpu_utilization", "nv_cpu_memory_used_bytes"):
            m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
            values[name] = float(m.group(1)) if m else float("nan")
        return values["nv_cpu_utilization"], values["nv_cpu_memory_used_bytes"]

    def _processes(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def usage(self) -> tuple[float, float]:
        """(CPU seconds so far, resident bytes now) of the server and its child processes (python stubs)."""
        cpu = rss = 0.0
        for p in self._processes():
            try:
                t = p.cpu_times()
                cpu += t.user + t.system
                rss += p.memory_info().rss
            except psutil.NoSuchProcess:
                continue
        return cpu, rss

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)
