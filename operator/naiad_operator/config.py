"""Operator settings read once from the environment (the Helm chart sets them on the operator Deployment)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_SERVER_IMAGE = "ghcr.io/naiad-dev/naiad-server:0.1.0"
# The server image with llama.cpp (Dockerfile.llm): the pods of `llm.engine: llamacpp` models and their RPC workers.
DEFAULT_LLM_SERVER_IMAGE = "ghcr.io/naiad-dev/naiad-server:0.1.0-llm"
DEFAULT_QUEUE_METRIC = "naiad_queue_time_per_request_us"
# prometheus-adapter's names for vllm:num_requests_waiting and vllm:kv_cache_usage_perc (an LLM model's HPA).
DEFAULT_LLM_WAITING_METRIC = "naiad_llm_requests_waiting"
DEFAULT_LLM_KV_CACHE_METRIC = "naiad_llm_kv_cache_usage"


@dataclass(frozen=True)
class OperatorConfig:
    server_image: str = DEFAULT_SERVER_IMAGE
    server_image_pull_policy: str = "IfNotPresent"
    llm_server_image: str = DEFAULT_LLM_SERVER_IMAGE
    # Seconds between self-healing passes over each pool (index of every pod compared with placements).
    resync_seconds: float = 15.0
    # Timeouts of calls to the servers' model-control API: index/health, and load (large models load slowly).
    request_timeout_seconds: float = 10.0
    load_timeout_seconds: float = 600.0
    # Custom metric served by prometheus-adapter for the default autoscaling rule.
    queue_metric_name: str = DEFAULT_QUEUE_METRIC
    # "auto": create ServiceMonitors when the monitoring.coreos.com API exists; "false": never.
    service_monitors: str = "auto"
    # Seconds before retrying a load that failed on a pod with the same revision (doubles up to 16x).
    load_retry_seconds: float = 30.0
    # Where the installation's control-credential Secret lives (the operator's own namespace).
    operator_namespace: str = "naiad-system"
    # A NetworkPolicy per pool: metrics port only from the operator's namespace and `metrics_from` (Prometheus).
    network_policy: bool = False
    metrics_from: tuple[Any, ...] = field(default_factory=tuple)
    # Custom metrics of an LLM model's default autoscaling rule (requests waiting, KV-cache use per pod).
    llm_waiting_metric_name: str = DEFAULT_LLM_WAITING_METRIC
    llm_kv_cache_metric_name: str = DEFAULT_LLM_KV_CACHE_METRIC
    # "auto": an InferencePool per LLM model when the cluster serves inference.networking.k8s.io/v1; "false": never.
    inference_pools: str = "auto"
    # Seconds a copy leaving a pod that stays waits, at most, for the model's Service endpoints to drop the pod
    # before it is unloaded (it is unloaded as soon as they do; draining.py).
    unload_delay_seconds: float = 5.0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> OperatorConfig:
        env = os.environ if env is None else env
        defaults = cls()

        def number(key: str, default: float) -> float:
            raw = env.get(key)
            if raw is None or raw == "":
                return default
            try:
                value = float(raw)
            except ValueError as error:
                raise ValueError(f"{key} must be a number of seconds, got {raw!r}") from error
            if value <= 0:
                raise ValueError(f"{key} must be positive, got {raw!r}")
            return value

        monitors = env.get("NAIAD_SERVICE_MONITORS", defaults.service_monitors).lower()
        if monitors not in ("auto", "false"):
            raise ValueError(f"NAIAD_SERVICE_MONITORS must be 'auto' or 'false', got {monitors!r}")
        namespace = env.get("NAIAD_OPERATOR_NAMESPACE") or service_account_namespace()
        try:
            metrics_from = tuple(json.loads(env.get("NAIAD_NETWORK_POLICY_METRICS_FROM") or "[]"))
        except (ValueError, TypeError) as error:
            raise ValueError(f"NAIAD_NETWORK_POLICY_METRICS_FROM must be a JSON list: {error}") from error
        policy = (env.get("NAIAD_NETWORK_POLICY") or "false").lower()
        if policy not in ("true", "false"):
            raise ValueError(f"NAIAD_NETWORK_POLICY must be 'true' or 'false', got {policy!r}")
        pools = (env.get("NAIAD_INFERENCE_POOLS") or defaults.inference_pools).lower()
        if pools not in ("auto", "false"):
            raise ValueError(f"NAIAD_INFERENCE_POOLS must be 'auto' or 'false', got {pools!r}")
        return cls(
            inference_pools=pools,
            llm_waiting_metric_name=env.get("NAIAD_LLM_WAITING_METRIC") or defaults.llm_waiting_metric_name,
            llm_kv_cache_metric_name=env.get("NAIAD_LLM_KV_CACHE_METRIC")
            or defaults.llm_kv_cache_metric_name,
            operator_namespace=namespace or defaults.operator_namespace,
            network_policy=policy == "true",
            metrics_from=metrics_from,
            server_image=env.get("NAIAD_SERVER_IMAGE") or defaults.server_image,
            llm_server_image=env.get("NAIAD_LLM_SERVER_IMAGE") or defaults.llm_server_image,
            server_image_pull_policy=env.get("NAIAD_SERVER_IMAGE_PULL_POLICY")
            or defaults.server_image_pull_policy,
            resync_seconds=number("NAIAD_RESYNC_SECONDS", defaults.resync_seconds),
            request_timeout_seconds=number("NAIAD_REQUEST_TIMEOUT_SECONDS", defaults.request_timeout_seconds),
            load_timeout_seconds=number("NAIAD_LOAD_TIMEOUT_SECONDS", defaults.load_timeout_seconds),
            queue_metric_name=env.get("NAIAD_QUEUE_METRIC") or defaults.queue_metric_name,
            service_monitors=monitors,
            load_retry_seconds=number("NAIAD_LOAD_RETRY_SECONDS", defaults.load_retry_seconds),
            unload_delay_seconds=number("NAIAD_UNLOAD_DELAY_SECONDS", defaults.unload_delay_seconds),
        )


def service_account_namespace() -> str | None:
    """The namespace the operator's pod runs in, as the service-account mount tells it."""
    try:
        return Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text().strip() or None
    except OSError:
        return None
