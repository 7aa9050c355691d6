"""Names, labels and annotation keys shared by the renderers, the placement loop and the handlers."""

from __future__ import annotations

import hashlib
import re

GROUP = "naiad.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
SERVER_KIND = "InferenceServer"
MODEL_KIND = "InferenceModel"
SERVER_PLURAL = "inferenceservers"
MODEL_PLURAL = "inferencemodels"

FIELD_MANAGER = "naiad-operator"

# Pool membership: every object of a pool carries it; the pods are selected by it.
SERVER_LABEL = f"{GROUP}/server"
# Which Service of a pool an object is (pool, headless, model): keeps the ServiceMonitor on the pool Service only.
SERVICE_ROLE_LABEL = f"{GROUP}/service-role"
# An InferenceServer the operator created for an InferenceModel without serverRef.
DEDICATED_FOR_LABEL = f"{GROUP}/dedicated-for"
MODEL_LABEL_PREFIX = f"{GROUP}/model-"
MODEL_LABEL_VALUE = "loaded"

# Pod annotation: JSON {inference-model-name: {"model": modelName, "revision": hash}} of what the operator loaded.
PLACEMENTS_ANNOTATION = f"{GROUP}/placements"
# Pod annotation: server-container restart count when the placements above were last confirmed.
RESTARTS_ANNOTATION = f"{GROUP}/observed-restarts"
# Pod readiness gate: True once the operator has loaded the models placed on the pod.
MODELS_READY_CONDITION = f"{GROUP}/models-ready"

# Labels the LeaderWorkerSet controller puts on every pod of a set (its name) and of a group (0: the leader).
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"

SERVER_CONTAINER = "server"
HTTP_PORT = 8000
GRPC_PORT = 8001
METRICS_PORT = 8002
MODEL_REPOSITORY_PATH = "/models"

DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
MAX_SERVER_NAME = 54
MAX_MODEL_NAME = 47


def model_label_key(model: str) -> str:
    """Pod label that marks a pod as holding the InferenceModel `model` (selected by the model's Service)."""
    return MODEL_LABEL_PREFIX + model


def dedicated_server_name(model: str) -> str:
    return f"{model}-server"


def leader_selector(leader_worker_set: str) -> dict[str, str]:
    """The group leaders of a LeaderWorkerSet: a grouped model's endpoints."""
    return {LWS_NAME_LABEL: leader_worker_set, LWS_WORKER_INDEX_LABEL: "0"}


def headless_service_name(name: str) -> str:
    return f"{name}-headless"


def models_claim_name(server: str) -> str:
    return f"{server}-models"


def name_problems(name: str, limit: int) -> list[str]:
    """Why `name` cannot name a pool or a model (Services and label keys are derived from it)."""
    problems = []
    if len(name) > limit:
        problems.append(f"name {name!r} is longer than {limit} characters")
    if not DNS_1035_LABEL.match(name):
        problems.append(
            f"name {name!r} must be a DNS-1035 label (lower-case letters, digits and '-', starting with a letter)"
        )
    return problems


def short_hash(text: str, length: int = 12) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:length]


def selector_string(labels: dict[str, str]) -> str:
    """A label selector in the `k=v,k2=v2` form used by status.selector and list calls."""
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))
