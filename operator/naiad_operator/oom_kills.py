"""Server containers the kernel's OOM killer ended, read from a pool's pods (the kubelet's ``OOMKilled`` reason),
and the Loaded condition an InferenceModel gets when its load died with such a container."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .naming import SERVER_CONTAINER

#: the reason the kubelet gives a container the kernel's OOM killer ended (exit code 137)
OOM_KILLED = "OOMKilled"


@dataclass(frozen=True)
class OomKill:
    """A pod whose server container was last ended by the OOM killer."""

    pod: str
    restarts: int  # the container's restartCount when the pod was read
    memory_limit: str | None  # resources.limits.memory of the server container, as the pod spec writes it
    finished_at: str | None  # when the killed container ended (RFC 3339), as the kubelet reports it


def _server_container(items: Iterable[Mapping[str, Any]] | None) -> Mapping[str, Any]:
    return next((c for c in items or [] if c.get("name") == SERVER_CONTAINER), {})


def oom_kill(pod: Mapping[str, Any]) -> OomKill | None:
    """The pod's OOM kill: its server container is terminated with reason OOMKilled now, or was the last time it
    ended (``lastState``); None otherwise (never killed, or its last end had another reason)."""
    status = _server_container((pod.get("status") or {}).get("containerStatuses"))
    state = status.get("state") or {}
    terminated = state.get("terminated") or (status.get("lastState") or {}).get("terminated") or {}
    if terminated.get("reason") != OOM_KILLED:
        return None
    spec = _server_container((pod.get("spec") or {}).get("containers"))
    limit = ((spec.get("resources") or {}).get("limits") or {}).get("memory")
    return OomKill(
        pod=str((pod.get("metadata") or {}).get("name")),
        restarts=int(status.get("restartCount") or 0),
        memory_limit=str(limit) if limit is not None else None,
        finished_at=terminated.get("finishedAt"),
    )


def oom_kills(pods: Iterable[Mapping[str, Any]]) -> dict[str, OomKill]:
    """Pod name -> its OOM kill, for the pods of a pool whose server container the OOM killer ended last."""
    kills = {}
    for pod in pods:
        kill = oom_kill(pod)
        if kill is not None:
            kills[kill.pod] = kill
    return kills


def load_oom_message(kill: OomKill, model_name: str) -> str:
    """What the InferenceModel's status says of a load of `model_name` that died with the server container."""
    limit = f"memory limit {kill.memory_limit}" if kill.memory_limit else "no memory limit"
    when = f" at {kill.finished_at}" if kill.finished_at else ""
    return (
        f"pod {kill.pod}: the server container was OOM-killed{when} while loading model {model_name} "
        f"({limit}, restartCount {kill.restarts}): the model needs more memory than the container may use"
    )


def load_oom(kills: Mapping[str, OomKill], failed_pods: Iterable[str], model_name: str) -> str | None:
    """The message for a model whose load failed on a pod whose server container the OOM killer ended last (the
    load took the container's memory past its limit), or None when no failed pod was OOM-killed. Of several such
    pods, the one killed last."""
    found = [kills[pod] for pod in failed_pods if pod in kills]
    if not found:
        return None
    latest = max(found, key=lambda k: (k.finished_at or "", k.pod))
    return load_oom_message(latest, model_name)
