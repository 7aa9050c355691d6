"""Pure renderers of the objects built on the servers' metrics: HorizontalPodAutoscalers (queue time per request)
and ServiceMonitors (Prometheus Operator)."""

from __future__ import annotations

import copy
from collections.abc import Mapping

from .config import OperatorConfig
from .naming import API_VERSION, SERVER_KIND, SERVICE_ROLE_LABEL
from .objects import Body, Spec
from .ownership import Owner, child_metadata, pool_labels, pool_selector
from .security import server_hostname, tls_secret_name
from .server_spec import autoscaling_active

# --- autoscaling ------------------------------------------------------------------------------------------------


def queue_time_metric(config: OperatorConfig, target_us: int, model: str | None = None) -> Body:
    """Pods metric: average queue time per request (microseconds) from prometheus-adapter."""
    metric: Body = {"name": config.queue_metric_name}
    if model is not None:
        metric["selector"] = {"matchLabels": {"model": model}}
    return {
        "type": "Pods",
        "pods": {"metric": metric, "target": {"type": "AverageValue", "averageValue": str(target_us)}},
    }


def render_hpa(
    owner: Owner,
    target_kind: str,
    target_name: str,
    spec: Spec,
    config: OperatorConfig,
    labels: Mapping[str, str],
    model: str | None = None,
    default_metrics: list[Body] | None = None,
) -> Body | None:
    """autoscaling/v2 HPA on the scale subresource of an InferenceServer or InferenceModel, or None.
    `default_metrics` replace the queue-time metric when `autoscaling.metrics` is empty (an LLM's token gauges)."""
    if not autoscaling_active(spec):
        return None
    autoscaling = spec.get("autoscaling") or {}
    metrics = (
        copy.deepcopy(list(autoscaling.get("metrics") or []))
        or default_metrics
        or [queue_time_metric(config, int(autoscaling.get("targetQueueTimeMicroseconds") or 20000), model)]
    )
    hpa_spec: Body = {
        "scaleTargetRef": {"apiVersion": API_VERSION, "kind": target_kind, "name": target_name},
        "minReplicas": int(spec.get("minReplicas") or 1),
        "maxReplicas": int(spec["maxReplicas"]),
        "metrics": metrics,
    }
    if autoscaling.get("behavior"):
        hpa_spec["behavior"] = copy.deepcopy(dict(autoscaling["behavior"]))
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": child_metadata(target_name, owner, labels),
        "spec": hpa_spec,
    }


def render_server_hpa(owner: Owner, spec: Spec, config: OperatorConfig) -> Body | None:
    return render_hpa(owner, SERVER_KIND, owner.name, spec, config, pool_labels(owner.name))


# --- monitoring -------------------------------------------------------------------------------------------------


def service_monitor_wanted(spec: Spec, config: OperatorConfig) -> bool:
    return config.service_monitors != "false" and (spec.get("monitoring") or {}).get("serviceMonitor", True)


def render_service_monitor(owner: Owner, spec: Spec) -> Body:
    """ServiceMonitor on the pool Service only (model Services select the same pods and would double-count)."""
    monitoring = spec.get("monitoring") or {}
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": child_metadata(owner.name, owner, pool_labels(owner.name)),
        "spec": {
            "selector": {"matchLabels": {**pool_selector(owner.name), SERVICE_ROLE_LABEL: "pool"}},
            "namespaceSelector": {"matchNames": [owner.namespace]},
            "endpoints": [_metrics_endpoint(owner, spec, monitoring.get("interval") or "15s")],
        },
    }


def _metrics_endpoint(owner: Owner, spec: Spec, interval: str) -> Body:
    endpoint: Body = {"port": "metrics", "path": "/metrics", "interval": interval}
    secret = tls_secret_name(spec)
    if secret:
        endpoint["scheme"] = "https"
        endpoint["tlsConfig"] = {
            "ca": {"secret": {"name": secret, "key": "ca.crt"}},
            "serverName": server_hostname(owner.name, owner.namespace),
        }
    return endpoint
