"""Pure renderers: an InferenceServer spec in, its pool's objects out (Deployment, Services, claim, control Secret,
NetworkPolicy, PodDisruptionBudget; the HPA and ServiceMonitor come from metrics_resources.py).

Nothing here talks to a cluster; the handlers apply what these functions return with server-side apply.
"""

from __future__ import annotations

import base64
import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .config import OperatorConfig
from .llm import LLAMACPP_ENGINE, LLM_ENGINE_LABEL
from .metrics_resources import render_server_hpa, render_service_monitor, service_monitor_wanted
from .naming import (
    GRPC_PORT,
    HTTP_PORT,
    METRICS_PORT,
    MODELS_READY_CONDITION,
    SERVER_CONTAINER,
    SERVICE_ROLE_LABEL,
    headless_service_name,
    models_claim_name,
)
from .objects import Body, Spec
from .ownership import Owner, child_metadata, pool_labels, pool_selector
from .pool_wake import (
    HTTP_SCALED_OBJECT_API,
    HTTP_SCALED_OBJECT_KIND,
    pool_scales_to_zero,
    render_http_scaled_object,
)
from .quantity import parse_quantity
from .security import (
    CONTROL_ENV,
    CREDENTIAL_HASH_ANNOTATION,
    CREDENTIAL_KEY,
    TLS_MOUNT,
    TLS_VOLUME,
    control_env,
    control_secret_name,
    credential_hash,
    tls_secret_name,
)
from .server_spec import (
    STORAGE_CACHE_PATH,
    desired_replicas,
    repository_claim,
    repository_path,
    repository_secret,
    repository_uri,
    server_args,
)

GPU_RESOURCE = "nvidia.com/gpu"

PROBE_DEFAULTS = {
    # The server starts without models (explicit mode), so startup is quick; allow 5 minutes for slow nodes.
    "startup": {"path": "/v2/health/live", "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 60},
    "readiness": {"path": "/v2/health/ready", "periodSeconds": 5, "timeoutSeconds": 3, "failureThreshold": 3},
    "liveness": {"path": "/v2/health/live", "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
}


# --- Deployment -------------------------------------------------------------------------------------------------


def _probe(kind: str, overrides: Mapping[str, Any] | None, tls: bool = False) -> Body:
    defaults = dict(PROBE_DEFAULTS[kind])
    path = defaults.pop("path")
    probe: Body = {"httpGet": {"path": path, "port": "http"}, **defaults}
    if tls:
        probe["httpGet"]["scheme"] = "HTTPS"
    for key, value in (overrides or {}).items():
        probe[key] = value
    return probe


def _requests_gpu(resources: Mapping[str, Any]) -> bool:
    for section in ("limits", "requests"):
        value = (resources.get(section) or {}).get(GPU_RESOURCE)
        if value is not None and parse_quantity(value) > 0:
            return True
    return False


def _tolerations(spec: Spec) -> list[Body]:
    """The user's tolerations, plus the usual GPU-node taint when the pod asks for GPUs and none covers it."""
    tolerations = [copy.deepcopy(t) for t in spec.get("tolerations") or []]
    if _requests_gpu(spec.get("resources") or {}) and not any(
        t.get("key") == GPU_RESOURCE for t in tolerations
    ):
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


SERVER_FS_GROUP = 10001  # the server image's group (Dockerfile.server)
# Seconds a deleted pod keeps serving before the server gets SIGTERM (and refuses new requests): the endpoint
# controllers and every node's kube-proxy (or a load balancer) forget the pod meanwhile, so a rollout or scale-down
# fails no request that was already on its way. The kubelet's own sleep action: no `sleep` binary in the image.
PRE_STOP_SLEEP_SECONDS = 5
# The server drains in-flight requests for up to 30 s after SIGTERM (--exit-timeout-secs); the grace period covers
# the preStop sleep and that drain.
TERMINATION_GRACE_PERIOD_SECONDS = PRE_STOP_SLEEP_SECONDS + 30 + 5


def server_image(spec: Spec, config: OperatorConfig) -> str:
    """The pool's own image, else the LLM image for a llama.cpp model's dedicated pool (its pods and a
    LeaderWorkerSet's rpc-server workers need llama.cpp), else the operator's default server image."""
    if spec.get("image"):
        return str(spec["image"])
    if (spec.get("podLabels") or {}).get(LLM_ENGINE_LABEL) == LLAMACPP_ENGINE:
        return config.llm_server_image
    return config.server_image


def _container(spec: Spec, config: OperatorConfig, server: str = "", restricted: bool = False) -> Body:
    tls = tls_secret_name(spec) is not None
    probes = spec.get("probes") or {}
    container: Body = {
        "name": SERVER_CONTAINER,
        "image": server_image(spec, config),
        "imagePullPolicy": spec.get("imagePullPolicy") or config.server_image_pull_policy,
        "command": ["naiad"],
        "args": server_args(spec, restricted),
        "ports": [
            {"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": METRICS_PORT, "protocol": "TCP"},
        ],
        "startupProbe": _probe("startup", probes.get("startup"), tls),
        "readinessProbe": _probe("readiness", probes.get("readiness"), tls),
        "livenessProbe": _probe("liveness", probes.get("liveness"), tls),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SLEEP_SECONDS}}},
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
            "runAsNonRoot": True,
        },
    }
    env = [
        e
        for e in copy.deepcopy(list(spec.get("env") or []))
        if not (restricted and e.get("name") == CONTROL_ENV)
    ]
    if restricted:
        env.append(control_env(server))
    if env:
        container["env"] = env
    secret = repository_secret(spec)
    if secret:
        # Every key of the Secret (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN,
        # AWS_DEFAULT_REGION, AWS_ENDPOINT_URL, ...) becomes a variable the AWS SDK reads in the server.
        container["envFrom"] = [{"secretRef": {"name": secret}}]
    if spec.get("resources"):
        container["resources"] = copy.deepcopy(dict(spec["resources"]))
    mounts: list[Body] = []
    repository = spec.get("modelRepository") or {}
    if repository.get("uri"):
        mounts.append({"name": "model-cache", "mountPath": STORAGE_CACHE_PATH})
    elif repository.get("claimName") or repository.get("create"):
        mount: Body = {"name": "models", "mountPath": repository_path(spec), "readOnly": True}
        sub_path = repository.get("subPath")
        if sub_path:
            mount["subPath"] = sub_path.strip("/")
        mounts.append(mount)
    if spec.get("shmSize") is not None:
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if tls:
        mounts.append({"name": TLS_VOLUME, "mountPath": TLS_MOUNT, "readOnly": True})
    if mounts:
        container["volumeMounts"] = mounts
    return container


def _volumes(server: str, spec: Spec) -> list[Body]:
    volumes = []
    claim = repository_claim(server, spec)
    if claim is not None:
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
    if repository_uri(spec):
        volumes.append({"name": "model-cache", "emptyDir": {}})
    if spec.get("shmSize") is not None:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec["shmSize"]}})
    secret = tls_secret_name(spec)
    if secret:
        # cert-manager (or anyone) may rotate the Secret: the kubelet updates the files and the server reloads them
        volumes.append({"name": TLS_VOLUME, "secret": {"secretName": secret, "defaultMode": 0o440}})
    return volumes


def pod_annotations(spec: Spec, credential: str | None = None) -> dict[str, str]:
    annotations = {
        **{str(k): str(v) for k, v in (spec.get("podAnnotations") or {}).items()},
        "kubectl.kubernetes.io/default-container": SERVER_CONTAINER,
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(METRICS_PORT),
        "prometheus.io/path": "/metrics",
    }
    if tls_secret_name(spec):
        annotations["prometheus.io/scheme"] = "https"
    if credential:
        # A hash (never the credential): a rotation changes the template, so the pods roll onto the new one.
        annotations[CREDENTIAL_HASH_ANNOTATION] = credential_hash(credential)
    return annotations


def default_spread(server: str) -> list[Body]:
    """Spread a pool's pods over nodes (soft, so a one-node cluster still schedules them all); pods of the
    ReplicaSet being rolled out are counted on their own (matchLabelKeys), as the scheduler docs advise."""
    return [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": pool_selector(server)},
            "matchLabelKeys": ["pod-template-hash"],
        }
    ]


def render_deployment(
    owner: Owner, spec: Spec, config: OperatorConfig, credential: str | None = None
) -> Body:
    """`credential`: the installation's control credential; the pods get it through the pool's control Secret
    (see render_control_secret), and the control APIs are restricted to it."""
    server = owner.name
    labels = pool_labels(server)
    pod_spec: Body = {
        "containers": [_container(spec, config, server, restricted=credential is not None)],
        # Set True by the operator once the models placed on the pod are loaded, so a new pod (a rollout, an
        # autoscaler replica) receives traffic only when it can serve.
        "readinessGates": [{"conditionType": MODELS_READY_CONDITION}],
        "terminationGracePeriodSeconds": TERMINATION_GRACE_PERIOD_SECONDS,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # fsGroup: the image's group (Dockerfile.server's naiad, 10001) owns the Secret volumes, whose files are
        # 0440 (the TLS key): without it the non-root server could not read them.
        "securityContext": {
            "runAsNonRoot": True,
            "fsGroup": SERVER_FS_GROUP,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    volumes = _volumes(server, spec)
    if volumes:
        pod_spec["volumes"] = volumes
    tolerations = _tolerations(spec)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    for field in ("nodeSelector", "affinity", "topologySpreadConstraints", "imagePullSecrets"):
        if spec.get(field):
            pod_spec[field] = copy.deepcopy(spec[field])
    if spec.get("topologySpreadConstraints") is None:
        pod_spec["topologySpreadConstraints"] = default_spread(server)
    for field in ("runtimeClassName", "priorityClassName", "serviceAccountName"):
        if spec.get(field):
            pod_spec[field] = spec[field]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": child_metadata(server, owner, labels),
        "spec": {
            "replicas": desired_replicas(spec),
            "selector": {"matchLabels": pool_selector(server)},
            # One new pod at a time and none removed before it is Ready (models loaded): serving never dips.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "revisionHistoryLimit": 3,
            "template": {
                "metadata": {
                    "labels": {
                        **{str(k): str(v) for k, v in (spec.get("podLabels") or {}).items()},
                        **labels,
                    },
                    "annotations": pod_annotations(spec, credential),
                },
                "spec": pod_spec,
            },
        },
    }


# --- Services ---------------------------------------------------------------------------------------------------


def _service_ports(metrics: bool) -> list[Body]:
    ports = [
        {"name": "http", "port": HTTP_PORT, "targetPort": "http", "protocol": "TCP"},
        {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "protocol": "TCP"},
    ]
    if metrics:
        ports.append({"name": "metrics", "port": METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"})
    return ports


def render_pool_service(owner: Owner, spec: Spec) -> Body:
    service = spec.get("service") or {}
    labels = {**pool_labels(owner.name), SERVICE_ROLE_LABEL: "pool"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(owner.name, owner, labels, service.get("annotations")),
        "spec": {
            "type": service.get("type") or "ClusterIP",
            "selector": pool_selector(owner.name),
            "ports": _service_ports(metrics=True),
        },
    }


def render_headless_service(owner: Owner) -> Body:
    """Headless Service: one DNS record per Ready pod, for gRPC clients that balance across pods themselves."""
    labels = {**pool_labels(owner.name), SERVICE_ROLE_LABEL: "headless"}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_metadata(headless_service_name(owner.name), owner, labels),
        "spec": {
            "clusterIP": "None",
            "selector": pool_selector(owner.name),
            "ports": _service_ports(metrics=False),
            "publishNotReadyAddresses": False,
        },
    }


# --- model repository claim ------------------------------------------------------------------------------------


def render_claim(owner: Owner, spec: Spec) -> Body | None:
    create = (spec.get("modelRepository") or {}).get("create")
    if not create:
        return None
    claim_spec: Body = {
        "accessModes": list(create.get("accessModes") or ["ReadOnlyMany"]),
        "resources": {"requests": {"storage": create["size"]}},
    }
    if create.get("storageClassName"):
        claim_spec["storageClassName"] = create["storageClassName"]
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": child_metadata(
            models_claim_name(owner.name),
            owner,
            pool_labels(owner.name),
            owned=not create.get("retain", False),
        ),
        "spec": claim_spec,
    }


# --- the control credential and network policy -----------------------------------------------------------------


def render_control_secret(owner: Owner, credential: str) -> Body:
    """The pool's copy of the installation's control credential, read by its pods through CONTROL_ENV."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": child_metadata(control_secret_name(owner.name), owner, pool_labels(owner.name)),
        "type": "Opaque",
        "data": {CREDENTIAL_KEY: base64.b64encode(credential.encode()).decode()},
    }


def render_network_policy(owner: Owner, config: OperatorConfig) -> Body:
    """Ingress to a pool's pods: the HTTP and gRPC ports from anywhere (inference; the control APIs on the same
    ports need the credential), the metrics port only from the operator's namespace and the configured peers
    (Prometheus)."""
    metrics_from: list[Body] = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": config.operator_namespace}}}
    ]
    metrics_from += [copy.deepcopy(dict(peer)) for peer in config.metrics_from]
    serving: Body = {"ports": [{"port": "http", "protocol": "TCP"}, {"port": "grpc", "protocol": "TCP"}]}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(owner.name, owner, pool_labels(owner.name)),
        "spec": {
            "podSelector": {"matchLabels": pool_selector(owner.name)},
            "policyTypes": ["Ingress"],
            "ingress": [
                serving,
                {"from": metrics_from, "ports": [{"port": "metrics", "protocol": "TCP"}]},
            ],
        },
    }


# --- everything for one pool ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolObjects:
    """The children of one InferenceServer; `absent` lists kinds that must not exist (e.g. HPA turned off)."""

    apply: list[Body]
    absent: list[tuple[str, str, str]]  # (apiVersion, kind, name)


def render_disruption_budget(owner: Owner, spec: Spec) -> Body | None:
    """policy/v1 PodDisruptionBudget over the pool's pods (None when turned off)."""
    budget = spec.get("disruptionBudget") or {}
    if budget.get("enabled") is False:
        return None
    max_unavailable = budget.get("maxUnavailable", 1)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_metadata(owner.name, owner, pool_labels(owner.name)),
        "spec": {
            "maxUnavailable": max_unavailable,
            "selector": {"matchLabels": pool_selector(owner.name)},
            # A pod that is not Ready (still loading, or broken) may always be evicted: it serves nothing, and
            # keeping it would block a drain forever.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def render_pool(
    owner: Owner,
    spec: Spec,
    config: OperatorConfig,
    monitoring_api: bool,
    credential: str | None = None,
    wake_api: bool = False,
) -> PoolObjects:
    """`credential`: the installation's control credential (None: the control APIs stay open). `wake_api`: the
    cluster serves KEDA's HTTPScaledObject (a pool with minReplicas 0 then gets one instead of the HPA)."""
    apply: list[Body] = []
    absent: list[tuple[str, str, str]] = []
    claim = render_claim(owner, spec)
    if claim is not None:
        apply.append(claim)
    if credential is not None:
        apply.append(render_control_secret(owner, credential))  # before the Deployment whose pods read it
    apply += [
        render_deployment(owner, spec, config, credential),
        render_pool_service(owner, spec),
        render_headless_service(owner),
    ]
    budget = render_disruption_budget(owner, spec)
    if budget is not None:
        apply.append(budget)
    else:
        absent.append(("policy/v1", "PodDisruptionBudget", owner.name))
    waking = pool_scales_to_zero(spec) and wake_api
    hpa = None if waking else render_server_hpa(owner, spec, config)  # KEDA's own HPA scales a waking pool
    if hpa is not None:
        apply.append(hpa)
    else:
        absent.append(("autoscaling/v2", "HorizontalPodAutoscaler", owner.name))
    if waking:
        apply.append(render_http_scaled_object(owner, spec))
    elif wake_api:
        absent.append((HTTP_SCALED_OBJECT_API, HTTP_SCALED_OBJECT_KIND, owner.name))
    if monitoring_api:
        if service_monitor_wanted(spec, config):
            apply.append(render_service_monitor(owner, spec))
        else:
            absent.append(("monitoring.coreos.com/v1", "ServiceMonitor", owner.name))
    if config.network_policy:
        apply.append(render_network_policy(owner, config))
    else:
        absent.append(("networking.k8s.io/v1", "NetworkPolicy", owner.name))
    return PoolObjects(apply, absent)
