"""Renderers of an LLM InferenceModel: the `llm` block, GPUs per copy, the OpenAI port, the InferencePool, the HPA
on token gauges, and status.copies from the engines' gauges."""

from __future__ import annotations

import pytest
from operator_fakes import NS, FakeKube, FakeServers

from naiad_operator.config import OperatorConfig
from naiad_operator.inference_pool import inference_pool_wanted, render_inference_pool
from naiad_operator.llm import ENGINE_TYPE_LABEL, GPU_RESOURCE, LLM_ENGINE_LABEL, llm_spec
from naiad_operator.llm_gauges import EngineGauges, GaugeReader, copy_status, parse_gauges
from naiad_operator.load_backoff import LoadBackoff
from naiad_operator.model_resources import (
    endpoint,
    model_intent,
    model_labels,
    model_selector,
    pool_problems,
    render_dedicated_server,
    render_model_hpa,
    render_model_services,
)
from naiad_operator.naming import DEDICATED_FOR_LABEL, SERVER_LABEL
from naiad_operator.ownership import Owner
from naiad_operator.placement_pass import reconcile_pool
from naiad_operator.pool_resources import render_deployment
from naiad_operator.pool_snapshot import PoolContext
from naiad_operator.status import ModelObservation, model_status

OWNER = Owner("naiad.dev/v1alpha1", "InferenceModel", "llama", "uid-l", "ml")
CONFIG = OperatorConfig()
STORAGE = {"uri": "pvc://models/repository"}


def llm_model(**llm):
    return {"modelName": "tiny", "storage": STORAGE, "llm": {"engine": "vllm", **llm}}


def test_engine_names_the_backend_and_bad_engines_are_problems():
    assert model_intent("llama", llm_model()).backend == "vllm"
    assert model_intent("llama", {"llm": {"engine": "llamacpp"}}).backend == "llamacpp"
    assert (
        model_intent("llama", {"llm": {"engine": "triton"}, "backend": "tensorrtllm"}).backend
        == "tensorrtllm"
    )
    assert model_intent("llama", {"llm": {"engine": "triton"}}).backend is None
    (problem,) = model_intent("llama", {"llm": {"engine": "sglang"}}).problems
    assert "llm.engine must be one of" in problem
    (problem,) = model_intent("llama", {"llm": {"engine": "vllm"}, "backend": "python"}).problems
    assert "runs backend 'vllm'" in problem
    assert model_intent("llama", {}).llm is None


def test_gpus_per_copy_are_tensor_times_pipeline_on_the_dedicated_pool():
    spec = llm_model(parallelism={"tensor": 2, "pipeline": 2})
    intent = model_intent("llama", spec)
    assert not intent.problems and intent.llm is not None and intent.llm.gpus == 4
    server = render_dedicated_server(OWNER, spec, intent)
    assert server["metadata"]["labels"][DEDICATED_FOR_LABEL] == "llama"
    assert server["spec"]["resources"]["limits"][GPU_RESOURCE] == 4
    labels = server["spec"]["podLabels"]
    assert labels[ENGINE_TYPE_LABEL] == "vllm" and labels[LLM_ENGINE_LABEL] == "vllm"


def test_no_parallelism_adds_no_gpus_and_keeps_the_template_resources():
    spec = {
        "llm": {"engine": "llamacpp"},
        "storage": STORAGE,
        "server": {"resources": {"limits": {"cpu": "2"}}},
    }
    intent = model_intent("llama", spec)
    server = render_dedicated_server(OWNER, spec, intent)
    assert server["spec"]["resources"] == {"limits": {"cpu": "2"}}
    assert server["spec"]["podLabels"][ENGINE_TYPE_LABEL] == "vllm"  # Naiad publishes vLLM's metric names


@pytest.mark.parametrize(
    "engine, template, image",
    [
        ("llamacpp", {}, "registry/naiad:1-llm"),  # llama-cpp-python is in the LLM image only
        ("llamacpp", {"image": "mine:2"}, "mine:2"),  # the model's server template wins
        ("vllm", {}, "registry/naiad:1"),
    ],
)
def test_llamacpp_pools_run_the_llm_server_image(engine, template, image):
    config = OperatorConfig(server_image="registry/naiad:1", llm_server_image="registry/naiad:1-llm")
    spec = {**llm_model(), "llm": {"engine": engine}, "server": template}
    server = render_dedicated_server(OWNER, spec, model_intent("llama", spec))
    pool_owner = Owner(
        OWNER.api_version, "InferenceServer", server["metadata"]["name"], "uid-s", OWNER.namespace
    )
    pod = render_deployment(pool_owner, server["spec"], config)["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == image


def test_gpu_template_that_disagrees_with_the_parallelism_is_a_problem():
    spec = {**llm_model(parallelism={"tensor": 2}), "server": {"resources": {"limits": {GPU_RESOURCE: 1}}}}
    (problem,) = model_intent("llama", spec).problems
    assert "needs 2 per copy" in problem
    spec["server"]["resources"]["limits"][GPU_RESOURCE] = 2
    assert model_intent("llama", spec).problems == []


def test_single_device_engines_refuse_multi_gpu_parallelism():
    for engine in ("llamacpp", "transformers"):
        (problem,) = model_intent("llama", {"llm": {"engine": engine, "parallelism": {"tensor": 2}}}).problems
        assert "runs a copy on one device" in problem
    assert model_intent("llama", {"llm": {"engine": "llamacpp", "parallelism": {"tensor": 1}}}).problems == []
    (problem,) = model_intent("llama", llm_model(parallelism={"tensor": 0})).problems
    assert "positive integer" in problem


def test_shared_pool_needs_enough_gpus_per_pod():
    spec = {**llm_model(parallelism={"tensor": 2}), "serverRef": {"name": "gpus"}}
    spec.pop("storage")
    intent = model_intent("llama", spec)
    pool = {"metadata": {"name": "gpus"}, "spec": {"resources": {"limits": {GPU_RESOURCE: "1"}}}}
    (problem,) = pool_problems(intent, pool)
    assert "gives each pod 1 nvidia.com/gpu" in problem
    pool["spec"]["resources"]["limits"][GPU_RESOURCE] = "4"
    assert pool_problems(intent, pool) == []


def test_openai_port_on_the_model_service_and_in_the_endpoint():
    intent = model_intent("llama", llm_model())
    service, headless = render_model_services(OWNER, intent)
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["openai"]["port"] == 80 and ports["openai"]["targetPort"] == "http"
    # a headless Service resolves to the pods, which serve /v1 on their HTTP port: no port mapping there
    assert "openai" not in {p["name"] for p in headless["spec"]["ports"]}
    assert endpoint(intent, "ml")["openai"] == "http://llama.ml.svc:80/v1"
    plain = model_intent("llama", {"storage": STORAGE})
    assert "openai" not in {p["name"] for p in render_model_services(OWNER, plain)[0]["spec"]["ports"]}
    assert "openai" not in endpoint(plain, "ml")


def test_inference_pool_selects_the_model_pods_on_the_http_port():
    intent = model_intent("llama", llm_model())
    assert intent.llm is not None
    pool = render_inference_pool(OWNER, intent.llm, model_selector(intent), model_labels(intent))
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["kind"] == "InferencePool"
    assert pool["metadata"]["name"] == "llama"
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "uid-l"
    spec = pool["spec"]
    assert spec["selector"]["matchLabels"] == {
        SERVER_LABEL: "llama-server",
        "naiad.dev/model-llama": "loaded",
    }
    assert spec["targetPorts"] == [{"number": 8000}]
    assert spec["endpointPickerRef"] == {
        "group": "",
        "kind": "Service",
        "name": "llama-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    custom = llm_spec(
        "llama",
        {
            "llm": {
                "engine": "vllm",
                "inferencePool": {
                    "endpointPicker": {"name": "gie-epp", "port": 9003, "failureMode": "FailOpen"}
                },
            }
        },
    )
    assert custom is not None
    ref = render_inference_pool(OWNER, custom, {}, {})["spec"]["endpointPickerRef"]
    assert (ref["name"], ref["port"], ref["failureMode"]) == ("gie-epp", {"number": 9003}, "FailOpen")


def test_inference_pool_only_where_the_api_is_served_and_wanted():
    llm = llm_spec("llama", {"llm": {"engine": "vllm"}})
    off = llm_spec("llama", {"llm": {"engine": "vllm", "inferencePool": {"enabled": False}}})
    assert inference_pool_wanted(llm, True, "auto")
    assert not inference_pool_wanted(llm, False, "auto")
    assert not inference_pool_wanted(llm, True, "false")
    assert not inference_pool_wanted(off, True, "auto")
    assert not inference_pool_wanted(None, True, "auto")


def test_hpa_of_an_llm_scales_on_requests_waiting_and_kv_cache():
    spec = {
        **llm_model(),
        "maxReplicas": 4,
        "autoscaling": {"targetRequestsWaiting": 3, "targetKVCacheUsagePercent": 80},
    }
    hpa = render_model_hpa(OWNER, spec, model_intent("llama", spec), CONFIG)
    assert hpa is not None
    waiting, kv = hpa["spec"]["metrics"]
    assert waiting["pods"]["metric"] == {
        "name": "naiad_llm_requests_waiting",
        "selector": {"matchLabels": {"model_name": "tiny"}},
    }
    assert waiting["pods"]["target"] == {"type": "AverageValue", "averageValue": "3"}
    assert kv["pods"]["metric"]["name"] == "naiad_llm_kv_cache_usage"
    assert kv["pods"]["target"]["averageValue"] == "800m"
    default = {**llm_model(), "maxReplicas": 4}
    (only,) = render_model_hpa(OWNER, default, model_intent("llama", default), CONFIG)["spec"]["metrics"]
    assert only["pods"]["target"]["averageValue"] == "2"
    own = {**default, "autoscaling": {"metrics": [{"type": "Resource"}]}}
    assert render_model_hpa(OWNER, own, model_intent("llama", own), CONFIG)["spec"]["metrics"] == [
        {"type": "Resource"}
    ]


METRICS = """# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="tiny"} 3
vllm:num_requests_running{model_name="tiny"} 4
vllm:kv_cache_usage_perc{model_name="tiny"} 0.4375
vllm:num_requests_waiting{model_name="other"} 1
vllm:lora_requests_info{max_lora="2",model_name="tiny",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 100
vllm:lora_requests_info{max_lora="2",model_name="tiny",running_lora_adapters="old",waiting_lora_adapters=""} 50
vllm:kv_cache_usage_perc{model_name="nan"} NaN
nv_inference_request_success{model="tiny",version="1"} 9
"""


def test_gauges_parsed_per_model_and_copy_status():
    gauges = parse_gauges(METRICS)
    tiny = gauges["tiny"]
    assert (tiny.waiting, tiny.running, tiny.kv_cache_usage) == (3, 4, 0.4375)
    assert tiny.lora_adapters == ["sql", "chat"]  # the newest series
    assert gauges["other"].kv_cache_usage is None
    assert "nan" not in gauges  # a NaN sample says nothing
    assert copy_status("p1", tiny) == {
        "pod": "p1",
        "requestsWaiting": 3,
        "requestsRunning": 4,
        "kvCacheUsagePercent": 43.8,
        "loraAdapters": ["sql", "chat"],
    }
    assert copy_status("p2", None) == {"pod": "p2"}


def _status(copies, old=None):
    intent = model_intent("llama", llm_model())
    observed = ModelObservation(wanted=1, holding=1, available=1, copies=copies)
    return model_status(
        generation=1,
        pool=intent.pool,
        model_name=intent.model_name,
        revision=intent.revision,
        selector="x",
        endpoint=endpoint(intent, "ml"),
        problems=[],
        suspended=False,
        pool_found=True,
        observed=observed,
        old_status=old,
        now="2026-01-01T00:00:00Z",
    )


def test_status_copies_are_written_and_removed():
    status = _status([{"pod": "p1", "requestsWaiting": 2}])
    assert status["copies"] == [{"pod": "p1", "requestsWaiting": 2}]
    assert status["endpoint"]["openai"].endswith("/v1")
    assert _status(None, old={"copies": []})["copies"] is None  # merge patch: gone
    assert "copies" not in _status(None, old={})


class FixedGauges(GaugeReader):
    """The gauges each pod's metrics port would answer (a pod missing here does not answer)."""

    def __init__(self, texts: dict[str, str]):
        super().__init__(session=None, timeout=1)  # type: ignore[arg-type]
        self.texts = texts
        self.read_from: list[str] = []

    async def read(self, ip: str) -> dict[str, EngineGauges] | None:
        self.read_from.append(ip)
        return parse_gauges(self.texts[ip]) if ip in self.texts else None


@pytest.mark.asyncio(loop_scope="session")
async def test_a_pass_reports_each_copy_with_its_gauges():
    kube, servers = FakeKube(), FakeServers()
    kube.add(
        {
            "apiVersion": "naiad.dev/v1alpha1",
            "kind": "InferenceServer",
            "metadata": {"name": "cpu"},
            "spec": {"replicas": 3},
        }
    )
    for i in range(3):
        kube.add(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": f"cpu-{i}", "labels": {"naiad.dev/server": "cpu"}},
                "status": {
                    "podIP": f"10.0.0.{i}",
                    "containerStatuses": [{"name": "server", "ready": True, "restartCount": 0}],
                },
            }
        )
    for name, spec in (
        (
            "llama",
            {"serverRef": {"name": "cpu"}, "modelName": "tiny", "replicas": 2, "llm": {"engine": "llamacpp"}},
        ),
        ("bert", {"serverRef": {"name": "cpu"}, "replicas": 1}),
    ):
        kube.add(
            {
                "apiVersion": "naiad.dev/v1alpha1",
                "kind": "InferenceModel",
                "metadata": {"name": name, "creationTimestamp": "2024-01-01T00:00:00Z"},
                "spec": spec,
            }
        )
    gauges = FixedGauges({"10.0.0.0": METRICS, "10.0.0.1": METRICS})
    ctx = PoolContext(
        kube=kube, control=servers, config=OperatorConfig(), backoff=LoadBackoff(30.0), gauges=gauges
    )
    await reconcile_pool(ctx, NS, "cpu")
    status = kube.obj("naiad.dev/v1alpha1", "InferenceModel", "llama")["status"]
    holders = sorted(ip for ip, models in servers.loaded.items() if "tiny" in models)
    assert status["phase"] == "Available" and len(status["copies"]) == 2
    for entry in status["copies"]:
        ip = "10.0.0." + entry["pod"][-1]
        if ip in gauges.texts:
            assert entry["requestsWaiting"] == 3 and entry["kvCacheUsagePercent"] == 43.8
        else:
            assert entry == {"pod": entry["pod"]}  # its metrics could not be read
    assert sorted(gauges.read_from) == holders  # only pods holding an LLM are scraped
    assert status["endpoint"]["openai"] == "http://llama.ml.svc:80/v1"
    assert "copies" not in kube.obj("naiad.dev/v1alpha1", "InferenceModel", "bert")["status"]


def test_bad_endpoint_picker_settings_and_gpu_quantities_are_problems_not_crashes():
    bad = {
        "llm": {"engine": "vllm", "inferencePool": {"endpointPicker": {"port": "x", "failureMode": "Maybe"}}}
    }
    problems = model_intent("llama", bad).problems
    assert any("port must be a port number" in p for p in problems)
    assert any("FailOpen or FailClose" in p for p in problems)
    spec = {"serverRef": {"name": "gpus"}, "llm": {"engine": "vllm", "parallelism": {"tensor": 2}}}
    pool = {"metadata": {"name": "gpus"}, "spec": {"resources": {"limits": {GPU_RESOURCE: "lots"}}}}
    (problem,) = pool_problems(model_intent("llama", spec), pool)
    assert "gives each pod 0 nvidia.com/gpu" in problem
