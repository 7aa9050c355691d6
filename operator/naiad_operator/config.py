"""Operator settings read once from the environment (the Helm chart sets them on the operator Deployment)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_SERVER_IMAGE = "ghcr.io/naiad-dev/naiad-server:0.1.0"
DEFAULT_QUEUE_METRIC = "naiad_queue_time_per_request_us"


@dataclass(frozen=True)
class OperatorConfig:
    server_image: str = DEFAULT_SERVER_IMAGE
    server_image_pull_policy: str = "IfNotPresent"
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
        return cls(
            server_image=env.get("NAIAD_SERVER_IMAGE") or defaults.server_image,
            server_image_pull_policy=env.get("NAIAD_SERVER_IMAGE_PULL_POLICY")
            or defaults.server_image_pull_policy,
            resync_seconds=number("NAIAD_RESYNC_SECONDS", defaults.resync_seconds),
            request_timeout_seconds=number("NAIAD_REQUEST_TIMEOUT_SECONDS", defaults.request_timeout_seconds),
            load_timeout_seconds=number("NAIAD_LOAD_TIMEOUT_SECONDS", defaults.load_timeout_seconds),
            queue_metric_name=env.get("NAIAD_QUEUE_METRIC") or defaults.queue_metric_name,
            service_monitors=monitors,
            load_retry_seconds=number("NAIAD_LOAD_RETRY_SECONDS", defaults.load_retry_seconds),
        )
