"""An LLM InferenceModel larger than a node (llm.parallelism over llm.gpusPerNode): the group size, the problems,
and the LeaderWorkerSet rendered in its dedicated pool's place (leader: Naiad with the model and its workers as
llama.cpp RPC servers; workers: rpc-server), with the model's Services and InferencePool on the leaders only."""

from __future__ import annotations

import json

import pytest

from naiad_operator.config import OperatorConfig
from naiad_operator.inference_pool import render_inference_pool
from naiad_operator.leader_worker_set import (
    GROUP_ROLE_LABEL,
    LWS_API,
    RAY_GROUP,
    RAY_PORT,
    RPC_PORT,
    RPC_SERVERS_ENV,
    render_group_control_secret,
    render_group_network_policy,
    render_leader_worker_set,
)
from naiad_operator.llm import ENGINE_TYPE_LABEL, GPU_RESOURCE, llm_spec
from naiad_operator.model_resources import (
    grouped,
    model_intent,
    model_labels,
    model_selector,
    render_model_services,
)
from naiad_operator.naming import LWS_NAME_LABEL, LWS_WORKER_INDEX_LABEL, SERVER_LABEL
from naiad_operator.ownership import Owner
from naiad_operator.security import CONTROL_ENV

OWNER = Owner("naiad.dev/v1alpha1", "InferenceModel", "big", "uid-b", "ml")
CONFIG = OperatorConfig()


def big_model(tensor: int = 1, pipeline: int = 3, per_node: int = 1, **extra):
    return {
        "modelName": "tiny",
        "storage": {"uri": "pvc://models/repository"},
        "replicas": 2,
        "llm": {
            "engine": "llamacpp",
            "parallelism": {"tensor": tensor, "pipeline": pipeline},
            "gpusPerNode": per_node,
        },
        **extra,
    }


@pytest.mark.parametrize(
    "gpus, per_node, size, per_pod",
    [(1, None, 1, 1), (4, None, 1, 4), (4, 8, 1, 4), (8, 8, 1, 8), (9, 8, 2, 5), (16, 8, 2, 8), (3, 1, 3, 1)],
)
def test_group_size_is_ceil_of_gpus_over_gpus_per_node(gpus, per_node, size, per_pod):
    block = {"engine": "vllm", "parallelism": {"tensor": gpus}}
    if per_node is not None:
        block["gpusPerNode"] = per_node
    llm = llm_spec("m", {"llm": block})
    assert llm is not None and llm.group_size == size and llm.gpus_per_pod == per_pod


def test_problems_of_a_copy_larger_than_a_node():
    assert not model_intent("big", big_model()).problems
    (problem,) = model_intent("big", big_model(per_node=0)).problems
    assert "llm.gpusPerNode must be a positive integer" in problem
    vllm = big_model(tensor=4, pipeline=2, per_node=4)
    vllm["llm"]["engine"] = "vllm"
    assert not model_intent("big", vllm).problems  # vLLM's groups: Ray, any GPUs per node
    transformers = big_model()
    transformers["llm"]["engine"] = "transformers"
    (problem,) = model_intent("big", transformers).problems
    assert "needs a group of pods" in problem and "llamacpp" in problem and "vllm and triton (Ray)" in problem
    triton = big_model(tensor=8, pipeline=2, per_node=8)
    triton["llm"]["engine"] = "triton"
    assert not model_intent("big", triton).problems  # a Triton LLM repository's vLLM: Ray too
    (problem,) = model_intent("big", big_model(tensor=2, pipeline=2, per_node=2)).problems
    assert "gpusPerNode must be 1" in problem
    shared = big_model(serverRef={"name": "pool"})
    assert any("remove serverRef" in p for p in model_intent("big", shared).problems)
    # llama.cpp on one pod still runs one device
    one_pod = big_model(pipeline=2, per_node=4)
    (problem,) = model_intent("big", one_pod).problems
    assert "runs a copy on one device" in problem and "gpusPerNode" in problem


def test_a_grouped_model_is_served_by_its_leaders():
    intent = model_intent("big", big_model())
    assert grouped(intent) and intent.pool == "big-server"
    assert model_selector(intent) == {LWS_NAME_LABEL: "big-server", LWS_WORKER_INDEX_LABEL: "0"}
    service, headless = render_model_services(OWNER, intent)
    assert service["spec"]["selector"] == headless["spec"]["selector"] == model_selector(intent)
    assert any(p["name"] == "openai" for p in service["spec"]["ports"])
    assert intent.llm is not None
    pool = render_inference_pool(OWNER, intent.llm, model_selector(intent), model_labels(intent))
    assert pool["spec"]["selector"]["matchLabels"] == model_selector(intent)
    # a model that fits a node keeps its pool
    assert not grouped(model_intent("big", big_model(pipeline=1)))
    assert SERVER_LABEL in model_selector(model_intent("big", big_model(pipeline=1)))


def env_of(container):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env") or []}


def test_leader_worker_set_rendering():
    spec = big_model(server={"env": [{"name": "CUDA_VISIBLE_DEVICES", "value": ""}], "image": "naiad:test"})
    intent = model_intent("big", spec)
    lws = render_leader_worker_set(OWNER, spec, intent, CONFIG)
    assert lws["apiVersion"] == LWS_API and lws["kind"] == "LeaderWorkerSet"
    assert lws["metadata"]["name"] == "big-server" and lws["metadata"]["namespace"] == "ml"
    assert lws["metadata"]["ownerReferences"][0]["uid"] == "uid-b"
    assert lws["spec"]["replicas"] == 2
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 3 and template["restartPolicy"] == "RecreateGroupOnPodRestart"

    leader = template["leaderTemplate"]
    assert leader["metadata"]["labels"][GROUP_ROLE_LABEL] == "leader"
    assert leader["metadata"]["labels"][ENGINE_TYPE_LABEL] == "vllm"
    assert SERVER_LABEL not in leader["metadata"]["labels"]  # no pool's pass manages the group
    assert "readinessGates" not in leader["spec"]
    (server,) = leader["spec"]["containers"]
    assert server["image"] == "naiad:test" and server["command"] == ["naiad"]
    args = server["args"]
    assert args[0] == "serve" and "--load-model=tiny" in args and "--strict-readiness=true" in args
    assert "--strict-readiness=false" not in args and "--model-control-mode=explicit" in args
    env = env_of(server)
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env[RPC_SERVERS_ENV] == (
        f"$(POD_NAME)-1.big-server.ml:{RPC_PORT},$(POD_NAME)-2.big-server.ml:{RPC_PORT}"
    )
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    # POD_NAME comes before the variable that expands it (Kubernetes expands only earlier variables)
    names = [e["name"] for e in server["env"]]
    assert names.index("POD_NAME") < names.index(RPC_SERVERS_ENV)
    assert server["resources"]["limits"][GPU_RESOURCE] == 1
    assert any(m["name"] == "models" for m in server["volumeMounts"])
    assert any(v["name"] == "models" for v in leader["spec"]["volumes"])

    worker = template["workerTemplate"]
    assert worker["metadata"]["labels"][GROUP_ROLE_LABEL] == "worker"
    (rpc,) = worker["spec"]["containers"]
    assert rpc["command"] == ["rpc-server"] and rpc["image"] == "naiad:test"
    assert rpc["args"] == ["--host", "$(POD_IP)", "--port", str(RPC_PORT)]
    assert env_of(rpc)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert rpc["resources"]["limits"][GPU_RESOURCE] == 1
    assert rpc["readinessProbe"]["tcpSocket"]["port"] == "rpc"
    assert "volumes" not in worker["spec"]
    # GPU pods tolerate the GPU taint, leaders and workers alike
    for pod in (leader, worker):
        assert any(t["key"] == GPU_RESOURCE for t in pod["spec"]["tolerations"])


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_group_workers_admit_only_their_groups_pods():
    """llama.cpp's rpc-server authenticates no one: the workers' NetworkPolicy admits the model's group pods and
    nobody else (the leaders stay open to clients: it does not select them)."""
    spec = big_model()
    intent = model_intent("big", spec)
    template = render_leader_worker_set(OWNER, spec, intent, CONFIG)["spec"]["leaderWorkerTemplate"]
    leader, worker = (template[k]["metadata"]["labels"] for k in ("leaderTemplate", "workerTemplate"))
    policy = render_group_network_policy(OWNER, intent)
    assert policy["kind"] == "NetworkPolicy" and policy["metadata"]["name"] == "big-server-workers"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-b"
    selector, (rule,) = policy["spec"]["podSelector"], policy["spec"]["ingress"]
    assert policy["spec"]["policyTypes"] == ["Ingress"] and set(rule) == {
        "from"
    }  # every port, from the peers
    assert _selects(selector, worker) and not _selects(selector, leader)
    (peer,) = rule["from"]
    assert set(peer) == {"podSelector"}  # this namespace only
    assert _selects(peer["podSelector"], leader) and _selects(peer["podSelector"], worker)
    other = render_leader_worker_set(OWNER, big_model(), model_intent("other", big_model()), CONFIG)
    other_worker = other["spec"]["leaderWorkerTemplate"]["workerTemplate"]["metadata"]["labels"]
    assert not _selects(peer["podSelector"], other_worker)  # another model's groups are outsiders


def test_a_vllm_copy_over_a_group_joins_the_pods_with_ray():
    """engine: vllm over two nodes of 4 GPUs: the leader starts Ray's head, waits for the group and serves the
    model loaded with the parallel sizes and Ray's executor; the workers are Ray nodes with the server's mounts."""
    spec = big_model(tensor=4, pipeline=2, per_node=4, server={"image": "naiad-vllm:test"})
    spec["llm"]["engine"] = "vllm"
    intent = model_intent("big", spec)
    assert not intent.problems
    lws = render_leader_worker_set(OWNER, spec, intent, CONFIG, credential="s3cret")
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    (server,) = template["leaderTemplate"]["spec"]["containers"]
    assert server["command"] == [RAY_GROUP] and server["image"] == "naiad-vllm:test"
    args = server["args"]
    node = [f"--token-from-env={CONTROL_ENV}", "--node-ip-address=$(POD_IP)", "--num-gpus=4"]
    assert args[:6] == ["leader", "--size=$(LWS_GROUP_SIZE)", *node, "--"]
    assert (
        args[6:8] == ["naiad", "serve"] and "--load-model=tiny" in args and "--strict-readiness=true" in args
    )
    # the leader's control APIs are restricted to the credential, read from the group's control Secret
    assert any(a.startswith("--http-restricted-api=model-repository") for a in args)
    assert env_of(server)[CONTROL_ENV] == {
        "secretKeyRef": {"name": "big-server-control", "key": "credential"}
    }
    secret = render_group_control_secret(OWNER, intent, "s3cret")
    assert secret["kind"] == "Secret" and secret["metadata"]["name"] == "big-server-control"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-b"
    assert "s3cret" not in json.dumps(lws)  # the pods read it from the Secret, never from their spec
    (config_arg,) = [a for a in args if a.startswith("--load-model-config=")]
    name, _, config = config_arg[len("--load-model-config=") :].partition("=")
    config = json.loads(config)
    assert name == "tiny" and config["instance_group"] == [{"kind": "KIND_MODEL", "count": 1}]
    assert config["parameters"] == {
        "tensor_parallel_size": {"string_value": "4"},
        "pipeline_parallel_size": {"string_value": "2"},
        "distributed_executor_backend": {"string_value": "ray"},
    }
    assert RPC_SERVERS_ENV not in env_of(server)
    assert env_of(server)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert {"name": "ray", "containerPort": RAY_PORT, "protocol": "TCP"} in server["ports"]
    assert server["resources"]["limits"][GPU_RESOURCE] == 4
    worker = template["workerTemplate"]
    (ray,) = worker["spec"]["containers"]
    assert ray["command"] == [RAY_GROUP] and ray["image"] == "naiad-vllm:test"
    assert ray["args"] == ["worker", "--leader=$(LWS_LEADER_ADDRESS)", f"--port={RAY_PORT}", *node]
    assert CONTROL_ENV in env_of(ray)  # the token's secret
    assert env_of(ray)["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert ray["resources"]["limits"][GPU_RESOURCE] == 4
    # the engine's workers read the weights where the leader does
    assert ray["volumeMounts"] == server["volumeMounts"]
    assert any(v["name"] == "models" for v in worker["spec"]["volumes"])


def test_a_triton_llm_repository_over_a_group_joins_the_pods_with_ray_as_it_is():
    """engine: triton (Triton's python vllm_backend, whose model.json sizes the engine and names Ray's executor):
    the same Ray group as engine: vllm, and the model loads with its repository's own config (no override)."""
    spec = big_model(tensor=8, pipeline=2, per_node=8, server={"image": "naiad-vllm:test"})
    spec["llm"]["engine"] = "triton"
    intent = model_intent("big", spec)
    assert not intent.problems and intent.backend is None and intent.load_config is None
    lws = render_leader_worker_set(OWNER, spec, intent, CONFIG, credential="s3cret")
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    (server,) = template["leaderTemplate"]["spec"]["containers"]
    node = [f"--token-from-env={CONTROL_ENV}", "--node-ip-address=$(POD_IP)", "--num-gpus=8"]
    assert server["command"] == [RAY_GROUP]
    assert server["args"][:6] == ["leader", "--size=$(LWS_GROUP_SIZE)", *node, "--"]
    assert "--load-model=tiny" in server["args"]
    assert not [a for a in server["args"] if a.startswith("--load-model-config=")]
    assert server["resources"]["limits"][GPU_RESOURCE] == 8
    (ray,) = template["workerTemplate"]["spec"]["containers"]
    assert ray["args"] == ["worker", "--leader=$(LWS_LEADER_ADDRESS)", f"--port={RAY_PORT}", *node]


def test_leader_and_workers_run_the_llm_image_unless_the_template_names_one():
    """rpc-server and llama-cpp-python are in the LLM image (Dockerfile.llm), not in the default server image."""
    config = OperatorConfig(server_image="registry/naiad:1", llm_server_image="registry/naiad:1-llm")
    spec = big_model()
    template = render_leader_worker_set(OWNER, spec, model_intent("big", spec), config)["spec"]
    template = template["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        (container,) = template[role]["spec"]["containers"]
        assert container["image"] == "registry/naiad:1-llm"


def test_suspended_grouped_model_has_no_groups():
    spec = big_model(suspended=True)
    lws = render_leader_worker_set(OWNER, spec, model_intent("big", spec), CONFIG)
    assert lws["spec"]["replicas"] == 0


def test_status_of_a_grouped_model_follows_its_leader_worker_set():
    from naiad_operator.group_status import group_observation
    from naiad_operator.status import model_phase

    def phase(lws, wanted=2):
        observed = group_observation(lws, wanted)
        return model_phase(problems=[], suspended=False, pool_found=True, observed=observed), observed

    assert phase(None)[0] == "Pending"  # the LWS controller has not seen it yet
    loading, observed = phase({"status": {"replicas": 2, "readyReplicas": 0}})
    assert loading == "Loading" and observed.holding == 2 and observed.available == 0
    assert phase({"status": {"replicas": 2, "readyReplicas": 1}})[0] == "PartiallyAvailable"
    available, observed = phase({"status": {"replicas": 2, "readyReplicas": 2}})
    assert available == "Available" and observed.available == 2
    # scaling down: more ready groups than wanted still count as the wanted number
    assert phase({"status": {"replicas": 3, "readyReplicas": 3}})[1].available == 2


def test_ready_leaders_are_the_copies():
    from naiad_operator.group_status import ready_leaders

    def pod(name, ip, ready, deleting=False):
        meta = {"name": name, **({"deletionTimestamp": "now"} if deleting else {})}
        conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
        return {"metadata": meta, "status": {"podIP": ip, "conditions": conditions}}

    pods = [pod("big-server-0", "10.0.0.1", True), pod("big-server-1", "10.0.0.2", False)]
    pods += [pod("big-server-2", "10.0.0.3", True, deleting=True), pod("big-server-3", None, True)]
    assert ready_leaders(pods) == {"big-server-0": "10.0.0.1"}
