"""Pure builders of the status of InferenceServers and InferenceModels: phase, counts, conditions, and whether a
status patch changes anything."""

from __future__ import annotations

import copy
import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Condition = dict[str, Any]


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def condition(kind: str, ok: bool | None, reason: str, message: str = "") -> Condition:
    return {
        "type": kind,
        "status": "Unknown" if ok is None else ("True" if ok else "False"),
        "reason": reason,
        "message": message,
    }


def merge_conditions(
    old: Sequence[Mapping[str, Any]] | None, new: Sequence[Condition], now: str, generation: int | None = None
) -> list[Condition]:
    """New conditions, keeping lastTransitionTime where the status did not change (so a steady state writes
    nothing new)."""
    previous = {c.get("type"): c for c in old or []}
    merged = []
    for cond in new:
        before = previous.get(cond["type"])
        changed = before is None or before.get("status") != cond["status"]
        item = dict(cond)
        item["lastTransitionTime"] = (
            now if changed or before is None else before.get("lastTransitionTime", now)
        )
        if generation is not None:
            item["observedGeneration"] = generation
        merged.append(item)
    return merged


# --- InferenceServer ----------------------------------------------------------------------------------------------


def _hpa_condition(hpa: Mapping[str, Any] | None, wanted: bool, delegated_to: str | None = None) -> Condition:
    if delegated_to is not None:
        return condition("AutoscalerReady", True, "Delegated", delegated_to)
    if not wanted:
        return condition("AutoscalerReady", True, "Disabled", "autoscaling is not configured")
    if hpa is None:
        return condition(
            "AutoscalerReady", False, "NotCreated", "the HorizontalPodAutoscaler does not exist yet"
        )
    problems = []
    seen = False
    for cond in (hpa.get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("AbleToScale", "ScalingActive"):
            seen = True
            if cond.get("status") != "True":
                problems.append(
                    f"{cond.get('type')}: {cond.get('reason', '')} {cond.get('message', '')}".strip()
                )
    if problems:
        return condition("AutoscalerReady", False, "MetricsUnavailable", "; ".join(problems))
    if not seen:
        return condition("AutoscalerReady", None, "Pending", "the autoscaler has not reported yet")
    return condition("AutoscalerReady", True, "ScalingActive", "the autoscaler reads its metrics")


def _workload_condition(deployment: Mapping[str, Any] | None, desired: int) -> Condition:
    if deployment is None:
        return condition("WorkloadReady", False, "NotCreated", "the Deployment does not exist yet")
    status = deployment.get("status") or {}
    ready = int(status.get("readyReplicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    if desired == 0:
        return condition("WorkloadReady", True, "ScaledToZero", "no pods wanted")
    if ready >= desired and updated >= desired:
        return condition("WorkloadReady", True, "PodsReady", f"{ready}/{desired} pods ready")
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return condition("WorkloadReady", False, "ProgressDeadlineExceeded", cond.get("message", ""))
    return condition("WorkloadReady", False, "PodsNotReady", f"{ready}/{desired} pods ready")


@dataclass(frozen=True)
class ModelCount:
    name: str
    model_name: str
    pods: int


def server_status(
    *,
    generation: int | None,
    selector: str,
    desired: int,
    deployment: Mapping[str, Any] | None,
    hpa: Mapping[str, Any] | None,
    hpa_wanted: bool,
    models: Sequence[ModelCount],
    problems: Sequence[str],
    old_conditions: Sequence[Mapping[str, Any]] | None,
    now: str,
    autoscaler_delegated_to: str | None = None,
) -> dict[str, Any]:
    """`autoscaler_delegated_to`: who scales the pool instead of its own HPA (KEDA, for a pool at zero pods)."""
    workload = _workload_condition(deployment, desired)
    autoscaler = _hpa_condition(hpa, hpa_wanted, autoscaler_delegated_to)
    if problems:
        ready = condition("Ready", False, "InvalidSpec", "; ".join(problems))
    elif workload["status"] == "True" and autoscaler["status"] == "True":
        ready = condition("Ready", True, "Ready", workload["message"])
    else:
        failing = workload if workload["status"] != "True" else autoscaler
        ready = condition("Ready", False, failing["reason"], failing["message"])
    deployment_status = (deployment or {}).get("status") or {}
    return {
        "observedGeneration": generation,
        "replicas": int(deployment_status.get("replicas") or 0),
        "readyReplicas": int(deployment_status.get("readyReplicas") or 0),
        "selector": selector,
        "modelCount": len(models),
        "models": [{"name": m.name, "modelName": m.model_name, "pods": m.pods} for m in models],
        "conditions": merge_conditions(old_conditions, [workload, autoscaler, ready], now, generation),
    }


# --- InferenceModel -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placement:
    pod: str
    state: str  # Loading, Loaded, Unloading, Failed
    ip: str | None = None
    version: str | None = None
    message: str | None = None
    variant: str | None = None  # stable or canary, for a model under a canary

    def as_dict(self) -> dict[str, str]:
        out = {"pod": self.pod, "state": self.state}
        if self.variant:
            out["variant"] = self.variant
        if self.ip:
            out["ip"] = self.ip
        if self.version:
            out["version"] = self.version
        if self.message:
            out["message"] = self.message
        return out


@dataclass
class ModelObservation:
    """What one pass saw and did for a model."""

    wanted: int
    holding: int  # pods with the model loaded (any revision)
    available: int  # pods with the current revision loaded, ready to serve
    placements: list[Placement] = field(default_factory=list)
    shortfall: int = 0
    loading: bool = False  # loads still in flight (status written before they finish)
    failure: dict[str, str] | None = None  # {"time", "pod", "message"} of the latest failed load in this pass
    # Pods where an earlier load of this revision failed and the retry waits out its back-off: pod -> error.
    retrying: dict[str, str] = field(default_factory=dict)
    eligible_pods: int = 0
    # status.variants of a model under a canary; None without one (the field is then removed).
    variants: list[dict[str, Any]] | None = None
    # status.copies of an LLM model: its ready pods with their queue and KV-cache use; None: not an LLM.
    copies: list[dict[str, Any]] | None = None
    # minReplicas: 0: None for a model that cannot scale to zero, else whether it is (and on how many pods the
    # Service then lets it load on demand, after how long idle).
    scaled_to_zero: bool | None = None
    on_demand_pods: int = 0
    idle_seconds: int = 0
    # A failed load that died with its server container, OOM-killed (oom_kills.load_oom's message); None: no such.
    oom_killed: str | None = None


def model_phase(
    *, problems: Sequence[str], suspended: bool, pool_found: bool, observed: ModelObservation
) -> str:
    if problems:
        return "Failed"
    if suspended:
        return "Suspended"
    if not pool_found:
        return "Pending"
    if observed.scaled_to_zero:
        return "ScaledToZero"
    if observed.wanted > 0 and observed.available >= observed.wanted:
        return "Available"
    if observed.available > 0:
        return "PartiallyAvailable"
    if observed.loading:
        return "Loading"
    if observed.failure is not None or observed.retrying:
        return "Failed"
    return "Pending"


def model_conditions(
    *, problems: Sequence[str], suspended: bool, pool: str, pool_found: bool, observed: ModelObservation
) -> list[Condition]:
    if problems:
        message = "; ".join(problems)
        return [
            condition("Scheduled", False, "InvalidSpec", message),
            condition("Loaded", False, "InvalidSpec", message),
            condition("ServiceReady", False, "InvalidSpec", message),
            condition("Ready", False, "InvalidSpec", message),
        ]
    if suspended:
        return [
            condition("Scheduled", False, "Suspended", "spec.suspended is true"),
            condition("Loaded", False, "Suspended", "unloaded from every pod"),
            condition("ServiceReady", False, "Suspended", "no pod holds the model"),
            condition("Ready", False, "Suspended", "spec.suspended is true"),
        ]
    if not pool_found:
        message = f"InferenceServer {pool} not found"
        scheduled = condition("Scheduled", False, "ServerNotFound", message)
    elif observed.wanted == 0:
        scheduled = condition("Scheduled", True, "ScaledToZero", "replicas is 0")
    elif observed.eligible_pods == 0:
        scheduled = condition("Scheduled", False, "NoReadyPods", f"no pod of {pool} is ready for loading")
    elif observed.shortfall:
        scheduled = condition(
            "Scheduled",
            False,
            "InsufficientCapacity",
            f"{observed.wanted - observed.shortfall}/{observed.wanted} replicas placed; no other pod of {pool} "
            "has room",
        )
    else:
        scheduled = condition("Scheduled", True, "Placed", f"{observed.wanted} replicas placed on {pool}")
    if observed.wanted > 0 and observed.available >= observed.wanted:
        loaded = condition(
            "Loaded", True, "Loaded", f"{observed.available}/{observed.wanted} replicas loaded"
        )
    elif observed.loading:
        loaded = condition(
            "Loaded", False, "Loading", f"{observed.available}/{observed.wanted} replicas loaded"
        )
    elif observed.oom_killed is not None and (observed.failure is not None or observed.retrying):
        loaded = condition("Loaded", False, "OOMKilled", observed.oom_killed)
    elif observed.failure is not None:
        loaded = condition(
            "Loaded", False, "LoadFailed", f"{observed.failure.get('pod')}: {observed.failure.get('message')}"
        )
    elif observed.retrying:
        pod, message = min(observed.retrying.items())
        loaded = condition("Loaded", False, "LoadFailed", f"{pod}: {message} (retrying after a back-off)")
    else:
        loaded = condition(
            "Loaded",
            observed.wanted == 0,
            "Unavailable" if observed.wanted else "ScaledToZero",
            f"{observed.available}/{observed.wanted} replicas loaded",
        )
    if observed.available > 0:
        service = condition(
            "ServiceReady", True, "Endpoints", f"{observed.available} pods behind the Service"
        )
    else:
        service = condition("ServiceReady", False, "NoEndpoints", "no pod holds the model yet")
    if observed.scaled_to_zero and pool_found:
        return _scaled_to_zero_conditions(pool, observed)
    if all(c["status"] == "True" for c in (scheduled, loaded, service)):
        ready = condition("Ready", True, "Ready", loaded["message"])
    else:
        # An OOM kill is the cause of whatever else fails (the pod it killed is avoided, so nothing is placed).
        order = (
            (loaded, scheduled, service) if loaded["reason"] == "OOMKilled" else (scheduled, loaded, service)
        )
        failing = next(c for c in order if c["status"] != "True")
        ready = condition("Ready", False, failing["reason"], failing["message"])
    out = [scheduled, loaded, service, ready]
    if observed.scaled_to_zero is not None:
        out.append(
            condition(
                "ScaledToZero",
                False,
                "Active",
                f"copies are kept while requests come within {observed.idle_seconds}s of each other",
            )
        )
    return out


def _scaled_to_zero_conditions(pool: str, observed: ModelObservation) -> list[Condition]:
    """minReplicas: 0 and idle: no copy anywhere, and the model's Service selects the pods that load it on
    demand; it serves (Ready), the first request waiting for the load."""
    on_demand = f"{observed.on_demand_pods} pods of {pool} load it on the next request (--load-on-demand)"
    return [
        condition(
            "Scheduled", True, "ScaledToZero", f"no request for {observed.idle_seconds}s: no copies kept"
        ),
        condition("Loaded", True, "ScaledToZero", "0 copies; " + on_demand),
        condition("ServiceReady", True, "OnDemand", on_demand),
        condition("Ready", True, "ScaledToZero", on_demand),
        condition("ScaledToZero", True, "Idle", f"no request for {observed.idle_seconds}s; " + on_demand),
    ]


def model_status(
    *,
    generation: int | None,
    pool: str,
    model_name: str,
    revision: str,
    selector: str,
    endpoint: Mapping[str, str],
    problems: Sequence[str],
    suspended: bool,
    pool_found: bool,
    observed: ModelObservation,
    old_status: Mapping[str, Any] | None,
    now: str,
) -> dict[str, Any]:
    old_status = old_status or {}
    conditions = model_conditions(
        problems=problems, suspended=suspended, pool=pool, pool_found=pool_found, observed=observed
    )
    status = {
        "observedGeneration": generation,
        "phase": model_phase(
            problems=problems, suspended=suspended, pool_found=pool_found, observed=observed
        ),
        "server": pool,
        "modelName": model_name,
        "revision": revision,
        "desiredReplicas": observed.wanted,
        "replicas": observed.holding,
        "availableReplicas": observed.available,
        "selector": selector,
        "placements": [p.as_dict() for p in sorted(observed.placements, key=lambda p: p.pod)],
        "endpoint": dict(endpoint),
        "conditions": merge_conditions(old_status.get("conditions"), conditions, now, generation),
    }
    failure = observed.failure or old_status.get("lastFailure")
    if failure:
        status["lastFailure"] = dict(failure)
    if observed.variants is not None:
        status["variants"] = observed.variants
    elif "variants" in old_status:
        status["variants"] = None  # merge patch: the canary is gone
    if observed.copies is not None:
        status["copies"] = observed.copies
    elif "copies" in old_status:
        status["copies"] = None
    return status


def merged_status(old: Mapping[str, Any] | None, patch: Mapping[str, Any]) -> dict[str, Any]:
    """The status after a merge patch (RFC 7386) of `patch` onto `old`."""
    out = copy.deepcopy(dict(old or {}))
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merged_status(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def status_changes(old: Mapping[str, Any] | None, patch: Mapping[str, Any]) -> bool:
    """Whether merge-patching `patch` onto the status `old` would change anything (`merged_status(old, patch) !=
    old`, without copying: a pass asks this of every model of its pool)."""
    if old is None:
        return True
    for key, value in patch.items():
        if value is None:
            if key in old:
                return True
        elif isinstance(value, Mapping) and isinstance(old.get(key), Mapping):
            if status_changes(old[key], value):
                return True
        elif key not in old or old[key] != value:
            return True
    return False
