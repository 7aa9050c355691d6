"""Pure readings of what the cluster and the servers report: pod facts, what a pod holds, rollout state, and the
label/annotation patch that makes a pod's metadata tell the truth about the models on it."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .control import IndexEntry
from .model_resources import ModelIntent
from .naming import (
    MODEL_LABEL_PREFIX,
    MODEL_LABEL_VALUE,
    MODELS_READY_CONDITION,
    PLACEMENTS_ANNOTATION,
    RESTARTS_ANNOTATION,
    SERVER_CONTAINER,
    model_label_key,
)
from .placement import PodState
from .scale_to_zero import runs_on_demand

REVISION_ANNOTATION = "deployment.kubernetes.io/revision"
TEMPLATE_HASH_LABEL = "pod-template-hash"


@dataclass(frozen=True)
class Held:
    """A model the operator loaded on a pod, as recorded in the pod's placements annotation."""

    model_name: str
    revision: str


@dataclass(frozen=True)
class PodFacts:
    name: str
    ip: str | None
    container_ready: bool
    restarts: int
    terminating: bool
    template_hash: str | None
    labels: Mapping[str, str]
    recorded: Mapping[str, Held]  # placements annotation: InferenceModel name -> what was loaded
    has_record: bool  # the placements annotation exists (even if empty)
    recorded_restarts: int | None
    gate: str | None  # status of the models-ready condition, None when absent
    node: str | None = None  # spec.nodeName
    load_on_demand: bool = False  # the server container runs with --load-on-demand

    @property
    def restarted(self) -> bool:
        """The server container restarted since the operator last confirmed its models: they are gone."""
        return self.recorded_restarts is not None and self.recorded_restarts != self.restarts

    @property
    def loadable(self) -> bool:
        return self.container_ready and bool(self.ip) and not self.terminating


def _parse_recorded(raw: str | None) -> dict[str, Held]:
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(data, Mapping):
        return {}
    out = {}
    for name, entry in data.items():
        if isinstance(entry, Mapping) and entry.get("model"):
            out[str(name)] = Held(str(entry["model"]), str(entry.get("revision") or ""))
    return out


def pod_facts(pod: Mapping[str, Any]) -> PodFacts:
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    annotations = meta.get("annotations") or {}
    container: Mapping[str, Any] = next(
        (c for c in status.get("containerStatuses") or [] if c.get("name") == SERVER_CONTAINER), {}
    )
    gate = next(
        (c.get("status") for c in status.get("conditions") or [] if c.get("type") == MODELS_READY_CONDITION),
        None,
    )
    recorded_restarts = annotations.get(RESTARTS_ANNOTATION)
    return PodFacts(
        name=meta["name"],
        ip=status.get("podIP") or None,
        container_ready=bool(container.get("ready")),
        restarts=int(container.get("restartCount") or 0),
        terminating=bool(meta.get("deletionTimestamp")),
        template_hash=(meta.get("labels") or {}).get(TEMPLATE_HASH_LABEL),
        labels=dict(meta.get("labels") or {}),
        recorded=_parse_recorded(annotations.get(PLACEMENTS_ANNOTATION)),
        has_record=PLACEMENTS_ANNOTATION in annotations,
        recorded_restarts=int(str(recorded_restarts)) if str(recorded_restarts or "").isdigit() else None,
        gate=gate,
        node=(pod.get("spec") or {}).get("nodeName") or None,
        load_on_demand=runs_on_demand(
            next(
                (
                    c.get("args") or []
                    for c in (pod.get("spec") or {}).get("containers") or []
                    if c.get("name") == SERVER_CONTAINER
                ),
                [],
            )
        ),
    )


def current_template_hash(
    deployment: Mapping[str, Any] | None, replicasets: Iterable[Mapping[str, Any]]
) -> str | None:
    """pod-template-hash of the Deployment's newest ReplicaSet; pods with another hash are leaving."""
    if deployment is None:
        return None
    revision = ((deployment.get("metadata") or {}).get("annotations") or {}).get(REVISION_ANNOTATION)
    if revision is None:
        return None
    for rs in replicasets:
        meta = rs.get("metadata") or {}
        if (meta.get("annotations") or {}).get(REVISION_ANNOTATION) == revision:
            return (meta.get("labels") or {}).get(TEMPLATE_HASH_LABEL)
    return None


def ready_entries(index: Iterable[IndexEntry]) -> dict[str, list[str]]:
    """Model name -> versions READY on the server."""
    out: dict[str, list[str]] = {}
    for entry in index:
        if entry.ready:
            out.setdefault(entry.name, []).append(entry.version)
    return out


def held_models(
    facts: PodFacts, index: Iterable[IndexEntry], intents: Iterable[ModelIntent]
) -> dict[str, str]:
    """InferenceModel name -> revision held on the pod: the model is READY on the server, and the revision is the
    one the operator recorded when it loaded it. "" marks a copy to reload in place: loaded by someone else,
    lost in a restart and reloaded, or READY in another version than the spec asks for."""
    ready = ready_entries(index)
    out = {}
    for intent in intents:
        versions = ready.get(intent.model_name)
        if not versions:
            continue
        recorded = None if facts.restarted else facts.recorded.get(intent.name)
        # The version the recorded variant asks for (a canary's may differ from the model's).
        wanted = intent.variant(recorded.revision)[2] if recorded is not None else intent.version
        right_version = wanted is None or wanted in versions
        known = recorded is not None and recorded.model_name == intent.model_name and right_version
        if recorded is None and intent.scales_to_zero and intent.load_config is None:
            # Loaded on demand from the repository as it is: what the operator would load itself, so it is
            # adopted as it stands rather than reloaded under the requests that brought it.
            out[intent.name] = intent.revision
            continue
        out[intent.name] = recorded.revision if known and recorded is not None else ""
    return out


def pod_state(
    facts: PodFacts,
    index: Sequence[IndexEntry] | None,
    intents: Iterable[ModelIntent],
    current_hash: str | None,
) -> PodState:
    """Placement's view of a pod; a pod whose index could not be read is not loadable this pass."""
    reachable = index is not None
    return PodState(
        name=facts.name,
        ip=facts.ip,
        ready=facts.loadable and reachable,
        leaving=current_hash is not None
        and facts.template_hash is not None
        and facts.template_hash != current_hash,
        held=held_models(facts, index or [], intents) if reachable else {},
        loaded_count=len(ready_entries(index or [])),
        node=facts.node,
    )


def highest_version(versions: Sequence[str]) -> str | None:
    """The highest of some versions (numeric order when they are numbers)."""
    if not versions:
        return None
    return max(versions, key=lambda v: (0, int(v), "") if v.isdigit() else (1, 0, v))


def version_of(index: Iterable[IndexEntry], model_name: str) -> str | None:
    """Highest READY version of a model."""
    return highest_version(ready_entries(index).get(model_name) or [])


@dataclass
class PodTruth:
    """What should be written on a pod after a pass."""

    held: dict[str, Held] = field(default_factory=dict)
    restarts: int = 0
    gate: bool | None = None  # None: leave the readiness gate as it is
    # Models scaled to zero that this pod loads on demand: labelled like held ones (their Services select it),
    # not recorded as placements.
    routes: set[str] = field(default_factory=set)
    # Held models whose copy here waits to be unloaded: their label goes first (draining.py), the record stays.
    unrouted: set[str] = field(default_factory=set)


def metadata_patch(facts: PodFacts, truth: PodTruth) -> dict[str, Any] | None:
    """Merge patch for labels and annotations, or None when the pod already says the truth."""
    labels: dict[str, str | None] = {}
    labelled = (set(truth.held) - truth.unrouted) | truth.routes
    for key in facts.labels:
        if key.startswith(MODEL_LABEL_PREFIX) and key[len(MODEL_LABEL_PREFIX) :] not in labelled:
            labels[key] = None
    for name in labelled:
        if facts.labels.get(model_label_key(name)) != MODEL_LABEL_VALUE:
            labels[model_label_key(name)] = MODEL_LABEL_VALUE
    annotations: dict[str, str] = {}
    recorded = json.dumps(
        {n: {"model": h.model_name, "revision": h.revision} for n, h in sorted(truth.held.items())},
        sort_keys=True,
        separators=(",", ":"),
    )
    current = json.dumps(
        {n: {"model": h.model_name, "revision": h.revision} for n, h in sorted(facts.recorded.items())},
        sort_keys=True,
        separators=(",", ":"),
    )
    if recorded != current or not facts.has_record:
        annotations[PLACEMENTS_ANNOTATION] = recorded
    if facts.recorded_restarts != truth.restarts:
        annotations[RESTARTS_ANNOTATION] = str(truth.restarts)
    patch: dict[str, Any] = {}
    if labels:
        patch["labels"] = labels
    if annotations:
        patch["annotations"] = annotations
    return {"metadata": patch} if patch else None


def gate_patch(facts: PodFacts, ready: bool, now: str, message: str) -> dict[str, Any] | None:
    """Strategic-merge patch of pods/status setting the models-ready readiness gate, or None if unchanged."""
    wanted = "True" if ready else "False"
    if facts.gate == wanted:
        return None
    return {
        "status": {
            "conditions": [
                {
                    "type": MODELS_READY_CONDITION,
                    "status": wanted,
                    "reason": "ModelsLoaded" if ready else "ModelsLoading",
                    "message": message,
                    "lastTransitionTime": now,
                }
            ]
        }
    }
