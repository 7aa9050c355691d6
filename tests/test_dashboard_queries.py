"""Every query of dashboards/naiad.json and the prometheus-adapter autoscaling rule, run on real data.

A real Prometheus (Debian's package) scrapes a Naiad under load: two python models with dynamic batching, one
with three instances and a quarter of its requests failing. The scrape job relabels as the Prometheus Operator
does for the chart's ServiceMonitor (namespace, pod, service, job, container, endpoint from the target's
Kubernetes metadata). Each panel expression, with the dashboard variables substituted as Grafana does, must
parse and return the series its panel shows with plausible values; the GPU panels are checked for parse only
when there is no GPU.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import requests
import yaml
from helpers import ROOT, NaiadProcess, free_ports

PROMETHEUS = shutil.which("prometheus")

NAMESPACE = "naiad-test"
POD = "pool-a-5d8f7c9b6-x2x9k"
MODELS = ("dash_ok", "dash_flaky")
SCRAPE_S = 1
# Grafana: $__rate_interval = max($__interval + scrape interval, 4 * scrape interval); $__interval 7s is what a
# one-hour range gives a ~500-point panel.
RATE_INTERVAL = f"{max(7 + SCRAPE_S, 4 * SCRAPE_S)}s"
LOAD_S = 24.0
RATES = {"dash_ok": 30.0, "dash_flaky": 20.0}  # requests per second sent to each model
FAIL_EVERY = 4  # every 4th request to dash_flaky has a negative input, which the model answers with an error

MODEL_PY = """
import time
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.003)
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            if (x < 0).any():
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError("negative input")))
            else:
                responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUTPUT0", x)]))
        return responses
"""

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 8
input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 2000 }}
instance_group [ {{ count: {count} kind: KIND_CPU }} ]
"""

# The relabelling the Prometheus Operator generates for a ServiceMonitor endpoint, fed with the metadata that
# Kubernetes service discovery would attach to the pool pod's target.
SCRAPE_CONFIG = """
global:
  scrape_interval: {scrape}s
  evaluation_interval: {scrape}s
scrape_configs:
  - job_name: serviceMonitor/{ns}/naiad-servers/0
    metrics_path: /metrics
    static_configs:
      - targets: ['{target}']
        labels:
          __meta_kubernetes_namespace: {ns}
          __meta_kubernetes_service_name: pool-a
          __meta_kubernetes_pod_name: {pod}
          __meta_kubernetes_pod_container_name: naiad
          __meta_kubernetes_endpoint_port_name: metrics
    relabel_configs:
      - source_labels: [__meta_kubernetes_endpoint_port_name]
        regex: metrics
        action: keep
      - source_labels: [__meta_kubernetes_namespace]
        target_label: namespace
      - source_labels: [__meta_kubernetes_service_name]
        target_label: service
      - source_labels: [__meta_kubernetes_pod_name]
        target_label: pod
      - source_labels: [__meta_kubernetes_pod_container_name]
        target_label: container
      - source_labels: [__meta_kubernetes_service_name]
        target_label: job
      - target_label: endpoint
        replacement: metrics
"""


def grafana_regex(values: list[str] | None) -> str:
    """A multi-value variable as Grafana interpolates it into a Prometheus regex: All is the allValue `.*`."""
    if values is None:
        return ".*"
    escaped = [re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr: str, namespace=None, model=None, pod=None) -> str:
    out = expr.replace("$__rate_interval", RATE_INTERVAL)
    for name, values in (("namespace", namespace), ("model", model), ("pod", pod)):
        out = out.replace("$" + name, grafana_regex(values))
    assert "$" not in out, f"a variable the test does not substitute: {out}"
    return out


class Prometheus:
    def __init__(self, target: str, workdir: Path):
        (port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{port}"
        config = workdir / "prometheus.yml"
        config.write_text(SCRAPE_CONFIG.format(scrape=SCRAPE_S, ns=NAMESPACE, pod=POD, target=target))
        check = subprocess.run(
            [shutil.which("promtool") or "promtool", "check", "config", str(config)],
            capture_output=True,
            text=True,
        )
        assert check.returncode == 0, check.stdout + check.stderr
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError("prometheus did not become ready")

    def query(self, promql: str, at: float) -> list[tuple[dict, float]]:
        """An instant query; a parse error fails the test with Prometheus' message."""
        r = requests.get(f"{self.url}/api/v1/query", params={"query": promql, "time": at}, timeout=10).json()
        assert r["status"] == "success", f"{promql}: {r.get('errorType')}: {r.get('error')}"
        assert r["data"]["resultType"] == "vector", promql
        return [(s["metric"], float(s["value"][1])) for s in r["data"]["result"]]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class Load:
    """Paced requests to both models from threads; remembers when each request finished and how."""

    def __init__(self, http: str):
        self.http = http
        self.done: list[tuple[str, bool, float]] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()

    def run(self, model: str, rate: float, fail_every: int) -> None:
        import tritonclient.http as httpclient
        from tritonclient.utils import InferenceServerException

        client = httpclient.InferenceServerClient(self.http)
        start, i = time.monotonic(), 0
        while not self.stop.is_set():
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            i += 1
            failing = bool(fail_every) and i % fail_every == 0
            inp = httpclient.InferInput("INPUT0", [1, 4], "FP32")
            inp.set_data_from_numpy(np.full((1, 4), -1.0 if failing else 1.0, dtype=np.float32))
            try:
                client.infer(model, [inp])
                ok = True
            except InferenceServerException:
                ok = False
            assert ok != failing, f"{model}: request {i} {'succeeded' if ok else 'failed'}"
            with self.lock:
                self.done.append((model, ok, time.time()))
        client.close()

    def rate(self, model: str, ok: bool, start: float, end: float) -> float:
        with self.lock:
            n = sum(1 for m, o, t in self.done if m == model and o == ok and start < t <= end)
        return n / (end - start)


def panels() -> dict[str, dict]:
    dashboard = json.loads((ROOT / "dashboards" / "naiad.json").read_text())
    return {p["title"]: p for p in dashboard["panels"] if p.get("targets")}


def near(value: float, expected: float, rel: float = 0.3) -> bool:
    return abs(value - expected) <= rel * expected + 0.5


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    assert PROMETHEUS is not None, "Debian's prometheus is not installed (make test-deps installs it)"
    repo = tmp_path_factory.mktemp("dash")
    for name, count in (("dash_ok", 1), ("dash_flaky", 3)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(MODEL_PY)
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, count=count))
    naiad = NaiadProcess(repo, "--metrics-interval-ms", "500").start()
    workdir = Path(tempfile.mkdtemp(prefix="naiad-dash-"))
    prom = Prometheus(naiad.metrics, workdir)
    load = Load(naiad.http)
    threads = [
        threading.Thread(target=load.run, args=(m, RATES[m] / 2, FAIL_EVERY if m == "dash_flaky" else 0))
        for m in MODELS
        for _ in range(2)
    ]
    try:
        for t in threads:
            t.start()
        time.sleep(LOAD_S)
        at = time.time() - 1.0  # a moment the last scrape has certainly covered
        yield prom, load, naiad, at
    finally:
        load.stop.set()
        for t in threads:
            t.join(10)
        prom.stop()
        naiad.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _by_model(result, label="model") -> dict[str, float]:
    out = {}
    for metric, value in result:
        out[metric.get(label, "")] = value
    return out


def test_every_dashboard_query_returns_plausible_series(loaded):
    prom, load, _, at = loaded
    window = float(RATE_INTERVAL[:-1])
    succ = {m: load.rate(m, True, at - window, at) for m in MODELS}
    fail = {m: load.rate(m, False, at - window, at) for m in MODELS}
    assert succ["dash_ok"] > 10 and fail["dash_flaky"] > 1, (succ, fail)  # the load really ran
    selected = dict(namespace=[NAMESPACE], model=list(MODELS), pod=[POD])
    checked = set()

    def run(title: str, ref: str, **variables) -> list[tuple[dict, float]]:
        target = next(t for t in panels()[title]["targets"] if t["refId"] == ref)
        checked.add((title, ref))
        result = prom.query(substitute(target["expr"], **(variables or selected)), at)
        # the same query with every variable at All shows the same series here (one namespace, one pod)
        everything = prom.query(substitute(target["expr"]), at)
        assert sorted(map(lambda r: sorted(r[0].items()), everything)) == sorted(
            map(lambda r: sorted(r[0].items()), result)
        ), title
        return result

    def per_model(title: str, ref: str = "A") -> dict[str, float]:
        values = _by_model(run(title, ref))
        assert set(values) == set(MODELS), f"{title} {ref}: series {values}"
        assert all(math.isfinite(v) for v in values.values()), f"{title} {ref}: {values}"
        return values

    v = per_model("Request rate")
    for m in MODELS:
        assert near(v[m], succ[m]), f"request rate {m}: {v[m]} vs {succ[m]} sent and answered"
    v = per_model("Failures")
    assert v["dash_ok"] == 0 and near(v["dash_flaky"], fail["dash_flaky"], 0.5), (v, fail)
    v = per_model("Success ratio")
    assert v["dash_ok"] == 1.0
    expected = succ["dash_flaky"] / (succ["dash_flaky"] + fail["dash_flaky"])
    assert 0 < v["dash_flaky"] < 1 and abs(v["dash_flaky"] - expected) < 0.15, (v, expected)
    for title in ("Request latency p50 / p99", "Compute latency p50 / p99"):
        p50, p99 = per_model(title, "A"), per_model(title, "B")
        for m in MODELS:
            assert 0 < p50[m] <= p99[m] < 5, f"{title} {m}: p50 {p50[m]} p99 {p99[m]}"
        assert p50["dash_ok"] >= 0.002, p50  # the model sleeps 3 ms per execution: seconds, not ms or us
    avg, p99 = per_model("Queue time", "A"), per_model("Queue time", "B")
    for m in MODELS:
        assert 0 <= avg[m] < 1e6 and 0 <= p99[m] < 1e6, f"queue time {m} (us): avg {avg[m]} p99 {p99[m]}"
    v = per_model("Average batch size")
    assert all(1 <= v[m] <= 8 for m in MODELS), v
    v = per_model("Pending requests")
    assert all(0 <= v[m] <= 100 for m in MODELS), v

    v = _by_model(run("Request rate per pod", "A"), "pod")
    assert list(v) == [POD] and near(v[POD], sum(succ.values())), (v, succ)
    v = _by_model(run("Queue time per pod", "A"), "pod")
    assert list(v) == [POD] and 0 <= v[POD] < 1e6, v
    v = _by_model(run("CPU utilisation", "A"), "pod")
    assert list(v) == [POD] and 0 <= v[POD] <= 1, v
    v = _by_model(run("CPU memory used", "A"), "pod")
    assert list(v) == [POD] and v[POD] > 100 * 2**20, v
    for title in ("GPU utilisation", "GPU memory used"):
        result = run(title, "A")  # parses; a GPU host also gets its series
        for metric, value in result:
            assert metric["pod"] == POD and "gpu_uuid" in metric and value >= 0, (title, result)
        if title == "GPU utilisation":
            assert all(v <= 1 for _, v in result), result

    # the LLM row's queries run in test_dashboard_llm_queries.py, against an LLM engine
    every = {
        (t, tgt["refId"]) for t, p in panels().items() for tgt in p["targets"] if "vllm:" not in tgt["expr"]
    }
    assert checked == every, f"panels this test does not check: {sorted(every - checked)}"
    assert len(every) == 17


def test_model_variable_filters(loaded):
    prom, _, _, at = loaded
    target = panels()["Request rate"]["targets"][0]
    result = prom.query(substitute(target["expr"], namespace=[NAMESPACE], model=["dash_ok"], pod=[POD]), at)
    assert [m["model"] for m, _ in result] == ["dash_ok"]
    result = prom.query(substitute(target["expr"], namespace=["elsewhere"], model=None, pod=None), at)
    assert result == []


def test_variable_queries(loaded):
    """The templating variables' label_values(...) queries list this namespace, both models and the pod."""
    prom, _, _, at = loaded
    dashboard = json.loads((ROOT / "dashboards" / "naiad.json").read_text())
    expected = {"namespace": [NAMESPACE], "model": sorted(MODELS), "pod": [POD]}
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["query"]["query"])
        assert m, var["query"]
        series, label = substitute(m.group(1), namespace=[NAMESPACE]), m.group(2)
        r = requests.get(
            f"{prom.url}/api/v1/label/{label}/values",
            params={"match[]": series, "start": at - 60, "end": at},
            timeout=10,
        ).json()
        assert r["status"] == "success", r
        assert sorted(r["data"]) == expected[var["name"]], (var["name"], r["data"])


def adapter_rules() -> list[dict]:
    """The chart's prometheus-adapter ConfigMap, rendered with the chart's default values."""
    values = yaml.safe_load((ROOT / "helm" / "naiad" / "values.yaml").read_text())

    def value(m: re.Match) -> str:
        v = values
        for key in m.group(1).split("."):
            v = v[key]
        return json.dumps(v) if m.group(2) else str(v)

    text = (ROOT / "helm" / "naiad" / "templates" / "prometheus-adapter-rules.yaml").read_text()
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("{{-"))
    text = re.sub(r"\{\{ include [^}]*\}\}", "x", text)
    text = re.sub(r"\{\{ \.Release\.[^}]*\}\}", "x", text)
    text = re.sub(r"\{\{ \.Values\.([\w.]+)( \| quote)? \}\}", value, text)
    assert "{{" not in text, text
    config = yaml.safe_load(yaml.safe_load(text)["data"]["config.yaml"])
    return config["rules"]


def test_prometheus_adapter_rule(loaded):
    """The rule the HPA reads: its series query finds the pod, and its metrics query (as prometheus-adapter
    fills it for a Pods metric with the InferenceModel's model selector) gives the average queue time."""
    prom, _, naiad, at = loaded
    (rule,) = [r for r in adapter_rules() if "nv_inference" in r["seriesQuery"]]
    r = requests.get(
        f"{prom.url}/api/v1/series", params={"match[]": rule["seriesQuery"], "start": at - 60, "end": at}
    ).json()
    assert r["status"] == "success", r
    assert {(s["namespace"], s["pod"]) for s in r["data"]} == {(NAMESPACE, POD)}
    assert {s["model"] for s in r["data"]} == set(MODELS)
    for model in MODELS:
        query = (
            rule["metricsQuery"]
            .replace("<<.LabelMatchers>>", f'namespace="{NAMESPACE}",pod=~"{POD}",model="{model}"')
            .replace("<<.GroupBy>>", "pod")
        )
        result = prom.query(query, at)
        assert [m for m, _ in result] == [{"pod": POD}], result
        value = result[0][1]
        stats = requests.get(f"{naiad.url}/v2/models/{model}/stats").json()["model_stats"][0][
            "inference_stats"
        ]
        average_us = stats["queue"]["ns"] / stats["queue"]["count"] / 1000
        # the rule's window (1m) covers the whole run: close to the average the statistics extension reports
        assert 0 <= value < 1e6 and abs(value - average_us) <= 0.5 * average_us + 200, (
            model,
            value,
            average_us,
        )
