"""A vllm InferenceModel's `llm.parallelism` reaches the engine through the load config (the parallel sizes as config
parameters, one KIND_MODEL instance), on the intent and on the load request a pass sends; other engines' loads are
left as they were."""

from __future__ import annotations

import pytest
from operator_fakes import NS, FakeKube, FakeServers

from naiad_operator.config import OperatorConfig
from naiad_operator.llm import GPU_RESOURCE
from naiad_operator.load_backoff import LoadBackoff
from naiad_operator.model_resources import model_intent, render_dedicated_server
from naiad_operator.ownership import Owner
from naiad_operator.placement_pass import reconcile_pool
from naiad_operator.pool_snapshot import PoolContext

OWNER = Owner("naiad.dev/v1alpha1", "InferenceModel", "llama", "uid-l", "ml")
STORAGE = {"uri": "pvc://models/repository"}


def sizes(tensor: int, pipeline: int = 1) -> dict:
    return {
        "tensor_parallel_size": {"string_value": str(tensor)},
        "pipeline_parallel_size": {"string_value": str(pipeline)},
    }


def spec_of(engine: str = "vllm", **extra) -> dict:
    llm = {"engine": engine}
    if "parallelism" in extra:
        llm["parallelism"] = extra.pop("parallelism")
    return {"modelName": "tiny", "storage": STORAGE, "llm": llm, **extra}


def test_vllm_tensor_2_loads_with_the_parallel_sizes_and_kind_model():
    spec = spec_of(parallelism={"tensor": 2})
    intent = model_intent("llama", spec)
    assert intent.problems == []
    assert intent.load_config == {
        "backend": "vllm",
        "instance_group": [{"kind": "KIND_MODEL", "count": 1}],
        "parameters": sizes(2),
    }
    server = render_dedicated_server(OWNER, spec, intent)
    assert server["spec"]["resources"]["limits"][GPU_RESOURCE] == 2
    bigger = model_intent("llama", spec_of(parallelism={"tensor": 2, "pipeline": 2}))
    assert bigger.load_config["parameters"] == sizes(2, 2)
    assert bigger.revision != intent.revision  # a change of parallelism reloads the copies


def test_other_engines_and_single_gpu_copies_load_as_before():
    assert model_intent("llama", spec_of("llamacpp", parallelism={"tensor": 1})).load_config is None
    group = spec_of("llamacpp", parallelism={"tensor": 2})
    group["llm"]["gpusPerNode"] = 1  # a LeaderWorkerSet group over llama.cpp's RPC workers
    intent = model_intent("llama", group)
    assert intent.problems == [] and intent.load_config is None
    assert model_intent("llama", spec_of("triton", parallelism={"tensor": 2})).load_config is None
    assert model_intent("llama", spec_of(parallelism={"tensor": 1})).load_config is None
    assert model_intent("llama", spec_of(version=2)).load_config == {
        "version_policy": {"specific": {"versions": [2]}}
    }


def test_the_models_own_config_is_kept_and_a_gpu_instance_group_is_a_problem():
    own = {
        "backend": "vllm",
        "max_batch_size": 0,
        "instance_group": [{"kind": "KIND_MODEL"}],
        "parameters": {"REPORT_CUSTOM_METRICS": {"string_value": "true"}, **sizes(8)},
    }
    intent = model_intent("llama", spec_of(parallelism={"tensor": 4}, config=own, version=3))
    assert intent.problems == []
    assert intent.load_config == {
        "backend": "vllm",
        "max_batch_size": 0,
        "instance_group": [{"kind": "KIND_MODEL"}],
        "parameters": {"REPORT_CUSTOM_METRICS": {"string_value": "true"}, **sizes(4)},
        "version_policy": {"specific": {"versions": [3]}},
    }
    assert own["parameters"]["tensor_parallel_size"] == {"string_value": "8"}  # the spec is not changed
    gpu = {"instance_group": [{"kind": "KIND_GPU", "count": 2}]}
    (problem,) = model_intent("llama", spec_of(parallelism={"tensor": 2}, config=gpu)).problems
    assert "config.instance_group must be KIND_MODEL, got KIND_GPU" in problem
    (problem,) = model_intent(
        "llama", spec_of(parallelism={"tensor": 2}, config={"parameters": [1]})
    ).problems
    assert "config.parameters must be a map" in problem


def test_a_canary_gets_the_parallel_sizes_too():
    spec = spec_of(parallelism={"tensor": 2}, canary={"version": 2, "trafficPercent": 10})
    intent = model_intent("llama", spec)
    assert intent.problems == [] and intent.canary is not None
    assert intent.canary.load_config["parameters"] == sizes(2)
    assert intent.canary.load_config["version_policy"] == {"specific": {"versions": [2]}}


@pytest.mark.asyncio(loop_scope="session")
async def test_the_load_request_carries_the_parallel_sizes_for_vllm_only():
    kube, servers = FakeKube(), FakeServers()
    kube.add(
        {
            "apiVersion": "naiad.dev/v1alpha1",
            "kind": "InferenceServer",
            "metadata": {"name": "gpus"},
            "spec": {"replicas": 1, "resources": {"limits": {GPU_RESOURCE: "2"}}},
        }
    )
    kube.add(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "gpus-0", "labels": {"naiad.dev/server": "gpus"}},
            "status": {
                "podIP": "10.0.0.0",
                "containerStatuses": [{"name": "server", "ready": True, "restartCount": 0}],
            },
        }
    )
    for name, engine in (("big", "vllm"), ("small", "llamacpp")):
        parallelism = {"tensor": 2} if engine == "vllm" else {"tensor": 1}
        kube.add(
            {
                "apiVersion": "naiad.dev/v1alpha1",
                "kind": "InferenceModel",
                "metadata": {"name": name, "creationTimestamp": "2024-01-01T00:00:00Z"},
                "spec": {
                    "serverRef": {"name": "gpus"},
                    "replicas": 1,
                    "llm": {"engine": engine, "parallelism": parallelism},
                },
            }
        )
    ctx = PoolContext(kube=kube, control=servers, config=OperatorConfig(), backoff=LoadBackoff(30.0))
    await reconcile_pool(ctx, NS, "gpus")
    assert servers.configs[("10.0.0.0", "big")] == {
        "backend": "vllm",
        "instance_group": [{"kind": "KIND_MODEL", "count": 1}],
        "parameters": sizes(2),
    }
    assert servers.configs[("10.0.0.0", "small")] is None
