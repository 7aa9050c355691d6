"""What a grouped LLM model (a LeaderWorkerSet, leader_worker_set.py) has running, for its status: the groups the
LWS controller counts (`status.replicas`) and those whose every pod is ready (`status.readyReplicas`, the leader's
readiness being the model loaded over its workers' RPC servers). No placement pass loads such a model: its leader
loads it at start."""

from __future__ import annotations

from .kube import KubeClient
from .leader_worker_set import LWS_API, LWS_KIND
from .model_resources import ModelIntent
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
        eligible_pods=wanted,
    )


async def read_group(kube: KubeClient, namespace: str, intent: ModelIntent, wanted: int) -> ModelObservation:
    return group_observation(await kube.get(LWS_API, LWS_KIND, namespace, intent.pool), wanted)
