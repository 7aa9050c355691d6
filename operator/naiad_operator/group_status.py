"""What a grouped LLM model (a LeaderWorkerSet, leader_worker_set.py) has running, for its status: the groups the
LWS controller counts (`status.replicas`) and those whose every pod is ready (`status.readyReplicas`, the leader's
readiness being the model loaded over its workers' RPC servers), and each ready leader's queue and KV-cache use as
`status.copies`. No placement pass loads such a model: its leader loads it at start."""

from __future__ import annotations

from .kube import KubeClient
from .leader_worker_set import LWS_API, LWS_KIND
from .llm_gauges import GaugeReader, copy_status
from .model_resources import ModelIntent, model_selector_string
from .objects import Body
from .status import ModelObservation


def group_observation(lws: Body | None, wanted: int) -> ModelObservation:
    """The model's copies as its LeaderWorkerSet reports them (None: not created yet)."""
    status = (lws or {}).get("status") or {}
    groups = int(status.get("replicas") or 0)
    ready = int(status.get("readyReplicas") or 0)
    return ModelObservation(
        wanted=wanted,
        holding=groups,
        available=min(ready, wanted),
        loading=groups > ready,
        eligible_pods=wanted if lws is not None else 0,  # no set (yet): "no pod ... is ready" in status
    )


def ready_leaders(pods: list[Body]) -> dict[str, str]:
    """Leader pod name -> IP of the leaders that are Ready (their model loaded)."""
    out = {}
    for pod in pods:
        status = pod.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        if ready and status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
            out[pod["metadata"]["name"]] = status["podIP"]
    return out


async def read_group(
    kube: KubeClient, gauges: GaugeReader | None, namespace: str, intent: ModelIntent, wanted: int
) -> ModelObservation:
    observed = group_observation(await kube.get(LWS_API, LWS_KIND, namespace, intent.pool), wanted)
    leaders = ready_leaders(await kube.list("v1", "Pod", namespace, model_selector_string(intent)))
    readings = await gauges.read_all(leaders.values()) if gauges is not None else {}
    observed.copies = sorted(
        (
            copy_status(pod, (readings.get(ip) or {}).get(intent.model_name) if ip in readings else None)
            for pod, ip in leaders.items()
        ),
        key=lambda c: str(c["pod"]),
    )
    return observed
