"""The Helm chart's files that can be checked without helm: values against values.schema.json, generated copies
(CRDs, dashboard) in sync, and a dashboard whose queries use only the metrics Naiad exports. `helm lint` and
`helm template` (tests/operator/test_helm_chart.py) cover the templates when a helm binary is available."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")  # in the test extra

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "naiad"

# Triton's metric names (and Naiad's histograms) that the server exports.
KNOWN_METRICS = {
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_queue_duration_us",
    "nv_inference_request_duration_us",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_pending_request_count",
    "nv_gpu_utilization",
    "nv_gpu_memory_used_bytes",
    "nv_cpu_utilization",
    "nv_cpu_memory_used_bytes",
    "nv_inference_request_duration_seconds_bucket",
    "nv_inference_queue_duration_seconds_bucket",
    "nv_inference_compute_infer_duration_seconds_bucket",
}


def values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def test_chart_metadata():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "naiad" and chart["type"] == "application"
    assert re.match(r"^\d+\.\d+\.\d+$", chart["version"])


def test_default_values_match_the_schema():
    jsonschema.validate(values(), schema())


@pytest.mark.parametrize(
    "change",
    [
        {"rbac": {"create": True, "scope": "galaxy"}},
        {"operator": {"resyncSeconds": 0}},
        {"operator": {"serviceMonitors": "yes"}},
        {"unknownKey": 1},
        {"image": {"repository": "", "pullPolicy": "Always"}},
        {"rbac": {"create": True, "scope": "namespace"}},  # namespace scope needs watchNamespaces
        {"watchNamespaces": ["Not_A_Namespace"]},
        {"autoscaling": {"metricName": "has spaces"}},
    ],
)
def test_schema_rejects_bad_values(change):
    bad = copy.deepcopy(values())
    bad.update(change)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema())


def test_namespace_scope_with_namespaces_is_valid():
    good = copy.deepcopy(values())
    good["rbac"]["scope"] = "namespace"
    good["watchNamespaces"] = ["ml", "team-a"]
    jsonschema.validate(good, schema())


def test_chart_crds_are_the_generated_ones():
    for path in (ROOT / "crds").glob("*.yaml"):
        assert (CHART / "crds" / path.name).read_text() == path.read_text()


def load_dashboard_generator():
    spec = importlib.util.spec_from_file_location("dashboard_generate", ROOT / "dashboards" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dashboard_json_is_generated_and_copied_into_the_chart():
    text = load_dashboard_generator().render()
    assert (ROOT / "dashboards" / "naiad.json").read_text() == text, "run python dashboards/generate.py"
    assert (CHART / "dashboards" / "naiad.json").read_text() == text


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((ROOT / "dashboards" / "naiad.json").read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_queries_use_only_exported_metrics():
    used = set()
    for expr in dashboard_exprs():
        used |= set(re.findall(r"\b(nv_[a-z_]+)", expr))
    assert used <= KNOWN_METRICS | {
        "nv_inference_request_duration_seconds",
        "nv_inference_queue_duration_seconds",
        "nv_inference_compute_infer_duration_seconds",
    }
    for needed in (
        "nv_inference_request_duration_seconds_bucket",
        "nv_inference_count",
        "nv_inference_exec_count",
        "nv_gpu_utilization",
        "nv_cpu_memory_used_bytes",
        "nv_inference_queue_duration_us",
    ):
        assert needed in used or needed.removesuffix("_bucket") in used, needed


def test_dashboard_panels_cover_the_requested_views():
    dashboard = json.loads((ROOT / "dashboards" / "naiad.json").read_text())
    titles = {p["title"] for p in dashboard["panels"]}
    for title in (
        "Request rate",
        "Failures",
        "Request latency p50 / p99",
        "Queue time",
        "Average batch size",
        "GPU utilisation",
        "GPU memory used",
        "CPU utilisation",
        "CPU memory used",
        "Request rate per pod",
    ):
        assert title in titles
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = [v["name"] for v in dashboard["templating"]["list"]]
    assert variables == ["datasource", "namespace", "model", "pod"]
    for expr in dashboard_exprs():
        assert expr.count("(") == expr.count(")"), expr


def test_adapter_rule_matches_the_operator_metric_and_formula():
    text = (CHART / "templates" / "prometheus-adapter-rules.yaml").read_text()
    assert "nv_inference_queue_duration_us{<<.LabelMatchers>>}" in text
    assert "nv_inference_request_success{<<.LabelMatchers>>}" in text
    assert ".Values.autoscaling.metricName" in text
    from naiad_operator.config import DEFAULT_QUEUE_METRIC

    assert values()["autoscaling"]["metricName"] == DEFAULT_QUEUE_METRIC
