"""Generate the Grafana dashboard for Naiad (dashboards/naiad.json and the Helm chart's copy).

Panels read Triton's metric names, so the dashboard also works on a Triton fleet: request rate, success and
failure, latency percentiles from the histograms, queue time, batch size, GPU/CPU utilisation and memory, per
model and per pod; an LLM row reads vLLM's token metrics (TTFT, inter-token latency, tokens/s, queue, KV cache). Run `python dashboards/generate.py` after editing; a test fails when the JSON is stale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUTPUTS = [ROOT / "dashboards" / "naiad.json", ROOT / "helm" / "naiad" / "dashboards" / "naiad.json"]

SEL = 'namespace=~"$namespace", model=~"$model", pod=~"$pod"'
# The LLM engines' token metrics carry vLLM's label, model_name, for the same model.
LLM_SEL = 'namespace=~"$namespace", model_name=~"$model", pod=~"$pod"'
POD_SEL = 'namespace=~"$namespace", pod=~"$pod"'
RATE = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


def target(expr: str, legend: str, ref: str = "A") -> dict[str, Any]:
    return {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref, "range": True}


def timeseries(
    title: str, targets: list[dict[str, Any]], unit: str, description: str = "", stack: bool = False
) -> dict[str, Any]:
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "targets": targets,
        "fieldConfig": {
            "defaults": {
                "unit": unit,
                "custom": {
                    "drawStyle": "line",
                    "lineWidth": 1,
                    "fillOpacity": 10 if stack else 0,
                    "stacking": {"mode": "normal" if stack else "none", "group": "A"},
                },
            },
            "overrides": [],
        },
        "options": {
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    }


def row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "panels": []}


def quantile(q: float, histogram: str, by: str, sel: str = SEL) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (rate({histogram}_bucket{{{sel}}}[{RATE}])))"


def llm_panels() -> list[dict[str, Any]]:
    """The LLM row: vLLM's token metrics, which every Naiad engine (llamacpp, vllm, transformers) publishes."""
    ttft, itl = "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"
    return [
        row("LLM tokens"),
        timeseries(
            "Time to first token p50 / p99",
            [
                target(quantile(0.5, ttft, "model_name", LLM_SEL), "p50 {{model_name}}", "A"),
                target(quantile(0.99, ttft, "model_name", LLM_SEL), "p99 {{model_name}}", "B"),
            ],
            "s",
            "From a request's arrival to its first generated token (queueing and prefill).",
        ),
        timeseries(
            "Inter-token latency p50 / p99",
            [
                target(quantile(0.5, itl, "model_name", LLM_SEL), "p50 {{model_name}}", "A"),
                target(quantile(0.99, itl, "model_name", LLM_SEL), "p99 {{model_name}}", "B"),
            ],
            "s",
            "Between two generated tokens of one request (decode steps).",
        ),
        timeseries(
            "Tokens per second",
            [
                target(
                    f"sum by (model_name) (rate(vllm:generation_tokens_total{{{LLM_SEL}}}[{RATE}]))",
                    "generated {{model_name}}",
                    "A",
                ),
                target(
                    f"sum by (model_name) (rate(vllm:prompt_tokens_total{{{LLM_SEL}}}[{RATE}]))",
                    "prompt {{model_name}}",
                    "B",
                ),
            ],
            "short",
            "Tokens generated and prompt tokens processed per second.",
        ),
        timeseries(
            "Requests waiting and running per pod",
            [
                target(f"sum by (pod) (vllm:num_requests_waiting{{{LLM_SEL}}})", "waiting {{pod}}", "A"),
                target(f"sum by (pod) (vllm:num_requests_running{{{LLM_SEL}}})", "running {{pod}}", "B"),
            ],
            "short",
            "The engines' queue (what the LLM autoscaler and the endpoint picker read) and running sequences.",
        ),
        timeseries(
            "KV-cache use per pod",
            [target(f"max by (pod) (vllm:kv_cache_usage_perc{{{LLM_SEL}}})", "{{pod}}")],
            "percentunit",
            "Share of the KV cache the running sequences hold.",
        ),
    ]


def panels() -> list[dict[str, Any]]:
    per_model = [
        row("Requests per model"),
        timeseries(
            "Request rate",
            [
                target(f"sum by (model) (rate(nv_inference_request_success{{{SEL}}}[{RATE}]))", "{{model}}"),
            ],
            "reqps",
            "Successful inference requests per second.",
        ),
        timeseries(
            "Failures",
            [
                target(f"sum by (model) (rate(nv_inference_request_failure{{{SEL}}}[{RATE}]))", "{{model}}"),
            ],
            "reqps",
            "Failed inference requests per second.",
        ),
        timeseries(
            "Success ratio",
            [
                target(
                    f"sum by (model) (rate(nv_inference_request_success{{{SEL}}}[{RATE}])) / ("
                    f"sum by (model) (rate(nv_inference_request_success{{{SEL}}}[{RATE}])) + "
                    f"sum by (model) (rate(nv_inference_request_failure{{{SEL}}}[{RATE}])))",
                    "{{model}}",
                ),
            ],
            "percentunit",
        ),
        timeseries(
            "Request latency p50 / p99",
            [
                target(quantile(0.5, "nv_inference_request_duration_seconds", "model"), "p50 {{model}}", "A"),
                target(
                    quantile(0.99, "nv_inference_request_duration_seconds", "model"), "p99 {{model}}", "B"
                ),
            ],
            "s",
            "End-to-end server latency from the request-duration histogram.",
        ),
        timeseries(
            "Compute latency p50 / p99",
            [
                target(
                    quantile(0.5, "nv_inference_compute_infer_duration_seconds", "model"),
                    "p50 {{model}}",
                    "A",
                ),
                target(
                    quantile(0.99, "nv_inference_compute_infer_duration_seconds", "model"),
                    "p99 {{model}}",
                    "B",
                ),
            ],
            "s",
            "Time spent executing the model.",
        ),
        timeseries(
            "Queue time",
            [
                target(
                    f"sum by (model) (rate(nv_inference_queue_duration_us{{{SEL}}}[{RATE}])) / "
                    f"clamp_min(sum by (model) (rate(nv_inference_request_success{{{SEL}}}[{RATE}])), 0.001)",
                    "avg {{model}}",
                    "A",
                ),
                target(
                    f"1e6 * {quantile(0.99, 'nv_inference_queue_duration_seconds', 'model')}",
                    "p99 {{model}}",
                    "B",
                ),
            ],
            "µs",
            "Average queue time per request (the default autoscaling metric) and its p99.",
        ),
        timeseries(
            "Average batch size",
            [
                target(
                    f"sum by (model) (rate(nv_inference_count{{{SEL}}}[{RATE}])) / "
                    f"clamp_min(sum by (model) (rate(nv_inference_exec_count{{{SEL}}}[{RATE}])), 0.001)",
                    "{{model}}",
                ),
            ],
            "short",
            "Inferences per model execution: how well the dynamic batcher fills batches.",
        ),
        timeseries(
            "Pending requests",
            [
                target(f"sum by (model) (nv_inference_pending_request_count{{{SEL}}})", "{{model}}"),
            ],
            "short",
            "Requests waiting in the scheduler queue.",
        ),
    ]
    per_pod = [
        row("Pods"),
        timeseries(
            "Request rate per pod",
            [
                target(f"sum by (pod) (rate(nv_inference_request_success{{{SEL}}}[{RATE}]))", "{{pod}}"),
            ],
            "reqps",
            "How evenly the Services spread traffic.",
            stack=True,
        ),
        timeseries(
            "Queue time per pod",
            [
                target(
                    f"sum by (pod) (rate(nv_inference_queue_duration_us{{{SEL}}}[{RATE}])) / "
                    f"clamp_min(sum by (pod) (rate(nv_inference_request_success{{{SEL}}}[{RATE}])), 0.001)",
                    "{{pod}}",
                ),
            ],
            "µs",
            "What the autoscaler sees for each pod.",
        ),
        timeseries(
            "GPU utilisation",
            [
                target(f"avg by (pod, gpu_uuid) (nv_gpu_utilization{{{POD_SEL}}})", "{{pod}} {{gpu_uuid}}"),
            ],
            "percentunit",
        ),
        timeseries(
            "GPU memory used",
            [
                target(
                    f"sum by (pod, gpu_uuid) (nv_gpu_memory_used_bytes{{{POD_SEL}}})", "{{pod}} {{gpu_uuid}}"
                ),
            ],
            "bytes",
        ),
        timeseries(
            "CPU utilisation",
            [
                target(f"avg by (pod) (nv_cpu_utilization{{{POD_SEL}}})", "{{pod}}"),
            ],
            "percentunit",
        ),
        timeseries(
            "CPU memory used",
            [
                target(f"sum by (pod) (nv_cpu_memory_used_bytes{{{POD_SEL}}})", "{{pod}}"),
            ],
            "bytes",
        ),
    ]
    laid_out = []
    y = 0
    for group in (per_model, per_pod, llm_panels()):
        header, *charts = group
        laid_out.append({**header, "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}})
        y += 1
        for i, chart in enumerate(charts):
            laid_out.append({**chart, "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": y + 8 * (i // 2)}})
        y += 8 * ((len(charts) + 1) // 2)
    for panel_id, panel in enumerate(laid_out, start=1):
        panel["id"] = panel_id
    return laid_out


def variable(name: str, query: str, label: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "sort": 1,
    }


def dashboard() -> dict[str, Any]:
    return {
        "uid": "naiad-inference",
        "title": "Naiad inference",
        "description": "Naiad / Triton inference servers: traffic, latency, queueing, batching and resources.",
        "tags": ["naiad", "triton", "inference"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                variable("namespace", "label_values(nv_inference_request_success, namespace)", "Namespace"),
                variable(
                    "model",
                    'label_values(nv_inference_request_success{namespace=~"$namespace"}, model)',
                    "Model",
                ),
                variable(
                    "pod", 'label_values(nv_inference_request_success{namespace=~"$namespace"}, pod)', "Pod"
                ),
            ]
        },
        "panels": panels(),
        "annotations": {"list": []},
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


def main() -> int:
    text = render()
    for path in OUTPUTS:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
