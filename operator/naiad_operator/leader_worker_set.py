"""Pure renderer of a LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) for an LLM InferenceModel whose copy needs
more GPUs than one node has (`llm.parallelism` over `llm.gpusPerNode`): one group of pods per copy, a leader running
Naiad with the model, and workers that lend it their GPUs: llama.cpp's `rpc-server`, which the leader's llama.cpp
backend offloads the layers to, or Ray nodes of the leader's Ray cluster, on which the leader's vLLM engine places
its tensor- and pipeline-parallel workers (`naiad.llm.ray_group`, as the LWS project's vLLM example does; also for
`engine: triton`, whose vllm_backend model.json names the sizes and Ray's executor itself). The LWS
controller creates the pods, gives them LWS_LEADER_ADDRESS / LWS_GROUP_SIZE / LWS_WORKER_INDEX, the headless
Service that names them, and restarts a group as a whole; only the leaders are the model's endpoints."""

from __future__ import annotations

import copy
import json

from .config import OperatorConfig
from .llm import ENGINE_TYPE, ENGINE_TYPE_LABEL, GPU_RESOURCE, LLAMACPP_ENGINE, LLM_ENGINE_LABEL, LLMSpec
from .model_resources import ModelIntent, render_dedicated_server
from .naming import GROUP, SERVER_CONTAINER
from .objects import Body, Spec
from .ownership import Owner, child_metadata
from .pool_resources import render_control_secret, render_deployment
from .security import CONTROL_ENV

LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_KIND = "LeaderWorkerSet"
LWS_PLURAL = "leaderworkersets"
# Which part of a group a pod is, for people and dashboards (the LWS labels say the same by index).
GROUP_ROLE_LABEL = f"{GROUP}/group-role"
LWS_MISSING = (
    "the model needs more GPUs than one node has (llm.gpusPerNode) and runs as a LeaderWorkerSet, but the "
    "cluster does not serve leaderworkerset.x-k8s.io/v1: install the LWS controller"
)
RPC_PORT = 50052
RPC_CONTAINER = "rpc-server"
# Read by the leader's llama.cpp backend (naiad.backends.llamacpp.rpc): its workers' rpc-server addresses.
RPC_SERVERS_ENV = "NAIAD_LLAMACPP_RPC_SERVERS"
RAY_PORT = 6379  # the Ray head's port on the leader (naiad.llm.ray_group.RAY_PORT)
RAY_CONTAINER = "ray-worker"
RAY_GROUP = "naiad-ray-group"  # the console script of naiad.llm.ray_group


def worker_addresses(name: str, namespace: str, llm: LLMSpec) -> str:
    """The workers of the leader's own group, through the set's headless Service (named after the set): the leader
    is `<set>-<group>` and its workers `<set>-<group>-<index>`, so `$(POD_NAME)` (the Downward API) names them."""
    return ",".join(
        f"$(POD_NAME)-{index}.{name}.{namespace}:{RPC_PORT}" for index in range(1, llm.group_size)
    )


def _field_env(name: str, path: str) -> Body:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _leader_container(container: Body, intent: ModelIntent, name: str, namespace: str, llm: LLMSpec) -> Body:
    """The pool's server container, loading the model at start (with its load config, as a load pass would):
    ready (strict readiness) once it is loaded, since no operator pass loads it. llama.cpp: the group's workers
    are its RPC servers. vLLM: the server starts once the group's Ray cluster has formed, and its engine joins it."""
    out = copy.deepcopy(container)
    args = [a for a in out["args"] if not a.startswith("--strict-readiness")]
    load = [f"--load-model={intent.model_name}"]
    if intent.load_config is not None:
        load.append(
            f"--load-model-config={intent.model_name}={json.dumps(intent.load_config, sort_keys=True)}"
        )
    out["args"] = [*args[:1], *load, "--strict-readiness=true", *args[1:]]
    env = [e for e in out.get("env") or [] if e.get("name") not in ("POD_NAME", RPC_SERVERS_ENV)]
    out["env"] = [_field_env("POD_NAME", "metadata.name"), *env]
    if llm.engine == LLAMACPP_ENGINE:
        out["env"].append({"name": RPC_SERVERS_ENV, "value": worker_addresses(name, namespace, llm)})
    else:
        out["args"] = [
            "leader",
            "--size=$(LWS_GROUP_SIZE)",
            *_ray_node_options(container, llm),
            "--",
            *out.get("command", ["naiad"]),
            *out["args"],
        ]
        out["command"] = [RAY_GROUP]
        out["env"].insert(1, _field_env("POD_IP", "status.podIP"))
        out["ports"] = [*out.get("ports", []), {"name": "ray", "containerPort": RAY_PORT, "protocol": "TCP"}]
    return out


def _ray_node_options(container: Body, llm: LLMSpec) -> list[str]:
    """`ray start` options of every node of a group: token authentication from the control credential when the
    pods have it (else anyone who reaches port 6379 could run code on the group's GPUs), the pod's IP as the node's
    address (Ray's own guess, the address that reaches the internet, is not always it) and the pod's GPUs (as the
    device plugin gave them)."""
    restricted = any(e.get("name") == CONTROL_ENV for e in container.get("env") or [])
    token = [f"--token-from-env={CONTROL_ENV}"] if restricted else []
    gpus = [] if llm.gpus_per_pod is None else [f"--num-gpus={llm.gpus_per_pod}"]
    return [*token, "--node-ip-address=$(POD_IP)", *gpus]


def _worker_base(container: Body, name: str, command: str, args: list[str]) -> Body:
    """A worker's container from the server container's image and security context."""
    return {
        "name": name,
        "image": container["image"],
        "imagePullPolicy": container.get("imagePullPolicy", "IfNotPresent"),
        "command": [command],
        "args": args,
        "securityContext": copy.deepcopy(container.get("securityContext") or {}),
    }


def _ray_worker_container(container: Body, llm: LLMSpec) -> Body:
    """A Ray node of the leader's cluster from the server's image, with the server container's resources, env
    and mounts (the engine's workers read the weights at the leader's paths), in the foreground while it lives."""
    args = [
        "worker",
        "--leader=$(LWS_LEADER_ADDRESS)",
        f"--port={RAY_PORT}",
        *_ray_node_options(container, llm),
    ]
    worker = _worker_base(container, RAY_CONTAINER, RAY_GROUP, args)
    for key in ("env", "envFrom", "volumeMounts", "resources"):
        if container.get(key):
            worker[key] = copy.deepcopy(container[key])
    env = [e for e in worker.get("env") or [] if e.get("name") != "POD_IP"]
    worker["env"] = [_field_env("POD_IP", "status.podIP"), *env]
    return worker


def _worker_container(container: Body, llm: LLMSpec) -> Body:
    """llama.cpp's rpc-server from the server's image, on the pod's IP, with the pod's share of the GPUs."""
    worker = _worker_base(
        container, RPC_CONTAINER, "rpc-server", ["--host", "$(POD_IP)", "--port", str(RPC_PORT)]
    )
    worker["env"] = [_field_env("POD_IP", "status.podIP")]
    worker["ports"] = [{"name": "rpc", "containerPort": RPC_PORT, "protocol": "TCP"}]
    worker["readinessProbe"] = {"tcpSocket": {"port": "rpc"}, "periodSeconds": 5, "failureThreshold": 3}
    if llm.gpus_per_pod is not None:
        worker["resources"] = {"limits": {GPU_RESOURCE: llm.gpus_per_pod}}
    return worker


def _pool_owner(owner: Owner, intent: ModelIntent) -> Owner:
    """The model as the owner of what is named after its pool (`<model>-server`)."""
    return Owner(owner.api_version, owner.kind, intent.pool, owner.uid, owner.namespace)


def render_group_control_secret(owner: Owner, intent: ModelIntent, credential: str) -> Body:
    """The group's copy of the control credential (named as its pool's would be), read by its leaders."""
    secret = render_control_secret(_pool_owner(owner, intent), credential)
    secret["metadata"] = child_metadata(secret["metadata"]["name"], owner, group_labels(intent))
    return secret


def group_labels(intent: ModelIntent) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "naiad-model-group",
        "app.kubernetes.io/instance": intent.name,
        "app.kubernetes.io/managed-by": "naiad-operator",
    }


def group_network_policy_name(intent: ModelIntent) -> str:
    return f"{intent.pool}-workers"


def render_group_network_policy(owner: Owner, intent: ModelIntent) -> Body:
    """Ingress to a group's workers only from the pods of the model's groups: llama.cpp's rpc-server takes
    commands from whoever connects (no authentication of its own), and a Ray worker node's ports are the group's
    business alone. Always rendered (nothing outside the group has a reason to reach a worker); it takes effect
    where the cluster's network plugin enforces NetworkPolicy."""
    group = group_labels(intent)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_metadata(group_network_policy_name(intent), owner, group),
        "spec": {
            "podSelector": {"matchLabels": {**group, GROUP_ROLE_LABEL: "worker"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": group}}]}],
        },
    }


def render_leader_worker_set(
    owner: Owner, spec: Spec, intent: ModelIntent, config: OperatorConfig, credential: str | None = None
) -> Body:
    """The model's LeaderWorkerSet, named like its dedicated pool would be: `replicas` groups of
    `llm.group_size` pods, the leader's pod spec the one its pool's pods would get (image, repository, volumes,
    env, resources, scheduling), the workers' the same placement with rpc-server. A restart of any pod recreates
    its group (the leader's llama.cpp cannot reconnect a lost RPC server)."""
    llm = intent.llm
    if llm is None:
        raise ValueError(f"InferenceModel {intent.name} is not an LLM")
    name = intent.pool
    server = render_dedicated_server(owner, spec, intent)
    pool_owner = _pool_owner(owner, intent)
    # with the credential, the leader's control APIs are restricted to it as a pool's pods' are (the group's
    # control Secret: render_group_control_secret), and a vLLM group's Ray cluster takes a token derived from it
    template = render_deployment(pool_owner, server["spec"], config, credential)["spec"]["template"]
    pod_spec = template["spec"]
    # the pool's: the operator's readiness gate (set by its load passes) and the spread over the pool's pods
    pod_spec.pop("readinessGates", None)
    if not (spec.get("server") or {}).get("topologySpreadConstraints"):
        pod_spec.pop("topologySpreadConstraints", None)
    (container,) = [c for c in pod_spec["containers"] if c["name"] == SERVER_CONTAINER]
    labels = {
        **{str(k): str(v) for k, v in ((spec.get("server") or {}).get("podLabels") or {}).items()},
        **group_labels(intent),
        ENGINE_TYPE_LABEL: ENGINE_TYPE,
        LLM_ENGINE_LABEL: llm.engine,
    }
    leader_spec = copy.deepcopy(pod_spec)
    leader_spec["containers"] = [_leader_container(container, intent, name, owner.namespace, llm)]
    worker_spec = copy.deepcopy(pod_spec)
    if llm.engine == LLAMACPP_ENGINE:
        worker_spec["containers"] = [_worker_container(container, llm)]
        worker_spec.pop("volumes", None)  # the weights reach the workers over RPC
    else:
        worker_spec["containers"] = [_ray_worker_container(container, llm)]
    return {
        "apiVersion": LWS_API,
        "kind": LWS_KIND,
        "metadata": child_metadata(name, owner, {**group_labels(intent), GROUP_ROLE_LABEL: "set"}),
        "spec": {
            "replicas": server["spec"]["replicas"],
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": llm.group_size,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {
                    "metadata": {
                        "labels": {**labels, GROUP_ROLE_LABEL: "leader"},
                        "annotations": dict(template["metadata"].get("annotations") or {}),
                    },
                    "spec": leader_spec,
                },
                "workerTemplate": {
                    "metadata": {"labels": {**labels, GROUP_ROLE_LABEL: "worker"}},
                    "spec": worker_spec,
                },
            },
        },
    }
