"""An InferenceModel's `llm` block: the engine, GPUs per copy from its parallelism, and what that changes in the
objects around the model (the dedicated pool's GPUs and pod labels, the OpenAI port on its Service, its HPA's
token metrics). Pure functions; the InferencePool is rendered in inference_pool.py."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from . import lora_adapters
from .objects import Body, Spec
from .quantity import parse_quantity

GPU_RESOURCE = "nvidia.com/gpu"
# The label the Gateway API Inference Extension's endpoint picker reads to pick the metric names of a pod's engine.
ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"
# Every Naiad engine publishes vLLM's metric names (naiad.llm.metrics), so the picker reads them as vLLM's.
ENGINE_TYPE = "vllm"
# Which Naiad engine serves the model, on its pods.
LLM_ENGINE_LABEL = "naiad.dev/llm-engine"
# The engine whose pods need the LLM server image (llama-cpp-python and llama.cpp's rpc-server, Dockerfile.llm).
LLAMACPP_ENGINE = "llamacpp"
# The Service port clients reach `/v1` on (the pods serve it on their HTTP port).
OPENAI_SERVICE_PORT = 80

# engine -> the backend a model of that engine names in its config (None: the repository's config decides).
ENGINE_BACKENDS: dict[str, str | None] = {
    "llamacpp": "llamacpp",
    "vllm": "vllm",
    "transformers": "transformers",
    "triton": None,  # a Triton LLM repository (tensorrtllm ensemble, python vllm_backend model.py, ...)
}
# Engines that can spread one copy over several GPUs of a node.
_MULTI_GPU_ENGINES = ("vllm", "triton")
# Engines whose copy can span several pods (a LeaderWorkerSet group): llama.cpp's leader drives rpc-server workers,
# vLLM's engine places its workers on the group's GPUs through Ray (naiad.llm.ray_group); so does a Triton LLM
# repository's vLLM (the python vllm_backend model.py, whose model.json asks for the sizes and Ray's executor).
_GROUP_ENGINES = ("llamacpp", "vllm", "triton")


@dataclass(frozen=True)
class LLMSpec:
    """What the operator does with an LLM model: `gpus` per copy (None: it adds no GPU request)."""

    engine: str
    tensor: int = 1
    pipeline: int = 1
    gpus: int | None = None
    inference_pool: bool | None = None  # None: when the cluster serves the InferencePool API
    endpoint_picker: str = ""
    endpoint_picker_port: int = 9002
    failure_mode: str = "FailClose"
    gpus_per_node: int | None = None  # None: a copy always runs on one pod
    lora_adapters: tuple[tuple[str, str], ...] = ()  # (name, path in the version folder), llm.loraAdapters
    problems: list[str] = field(default_factory=list)

    @property
    def backend(self) -> str | None:
        return ENGINE_BACKENDS.get(self.engine)

    @property
    def group_size(self) -> int:
        """Pods per copy: ceil(gpus / gpusPerNode) when the copy needs more GPUs than one node has, else 1."""
        if self.gpus is None or self.gpus_per_node is None:
            return 1
        return -(-self.gpus // self.gpus_per_node)

    @property
    def gpus_per_pod(self) -> int | None:
        """GPUs each pod of a copy asks for (every pod of a group alike)."""
        if self.gpus is None:
            return None
        return -(-self.gpus // self.group_size)


def _positive(value: Any, what: str, problems: list[str]) -> int:
    if value is None:
        return 1
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        problems.append(f"{what} must be a positive integer, got {value!r}")
        return 1
    return value


def llm_spec(name: str, spec: Spec) -> LLMSpec | None:
    """The model's `llm` block parsed, with its problems; None for a model that is not an LLM."""
    block = spec.get("llm")
    if block is None:
        return None
    problems: list[str] = []
    engine = str(block.get("engine") or "")
    if engine not in ENGINE_BACKENDS:
        problems.append(f"llm.engine must be one of {sorted(ENGINE_BACKENDS)}, got {engine!r}")
    backend = ENGINE_BACKENDS.get(engine)
    if backend is not None and spec.get("backend") and spec["backend"] != backend:
        problems.append(f"llm.engine {engine!r} runs backend {backend!r}, but backend is {spec['backend']!r}")
    parallelism = block.get("parallelism")
    tensor = pipeline = 1
    gpus = None
    per_node = block.get("gpusPerNode")
    gpus_per_node = None if per_node is None else _positive(per_node, "llm.gpusPerNode", problems)
    if parallelism is not None:
        tensor = _positive(parallelism.get("tensor"), "llm.parallelism.tensor", problems)
        pipeline = _positive(parallelism.get("pipeline"), "llm.parallelism.pipeline", problems)
        gpus = tensor * pipeline
        grouped = gpus_per_node is not None and gpus > gpus_per_node
        if grouped:
            problems += _group_problems(engine, gpus, gpus_per_node or 1, spec)
        elif engine in ENGINE_BACKENDS and engine not in _MULTI_GPU_ENGINES and gpus > 1:
            problems.append(
                f"llm.engine {engine!r} runs a copy on one device: parallelism {tensor}x{pipeline} needs vllm "
                "or a Triton LLM repository (or llm.gpusPerNode, to spread it over a group of pods)"
            )
    pool = block.get("inferencePool") or {}
    picker = pool.get("endpointPicker") or {}
    enabled = pool.get("enabled")
    port = picker.get("port", 9002)
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        problems.append(f"llm.inferencePool.endpointPicker.port must be a port number, got {port!r}")
        port = 9002
    failure_mode = picker.get("failureMode", "FailClose")
    if failure_mode not in ("FailOpen", "FailClose"):
        problems.append(
            f"llm.inferencePool.endpointPicker.failureMode must be FailOpen or FailClose, got {failure_mode!r}"
        )
        failure_mode = "FailClose"
    return LLMSpec(
        engine=engine,
        tensor=tensor,
        pipeline=pipeline,
        gpus=gpus,
        inference_pool=None if enabled is None else bool(enabled),
        endpoint_picker=str(picker.get("name") or f"{name}-epp"),
        endpoint_picker_port=port,
        failure_mode=failure_mode,
        gpus_per_node=gpus_per_node,
        lora_adapters=lora_adapters.parse(block, engine, problems),
        problems=problems,
    )


def _group_problems(engine: str, gpus: int, gpus_per_node: int, spec: Spec) -> list[str]:
    """A copy larger than a node runs as a LeaderWorkerSet group; what that needs of the model."""
    problems = []
    if engine not in _GROUP_ENGINES:
        problems.append(
            f"llm.engine {engine!r}: a copy of {gpus} GPUs on nodes of {gpus_per_node} needs a group of pods, "
            "which the operator runs for llamacpp (llama.cpp's RPC backend), vllm and triton (Ray)"
        )
    elif engine == LLAMACPP_ENGINE and gpus_per_node != 1:
        problems.append(
            "llm.engine 'llamacpp' runs one device per pod of a group (an rpc-server serves one device): "
            "llm.gpusPerNode must be 1"
        )
    if spec.get("serverRef"):
        problems.append("a copy larger than a node runs on pods of its own: remove serverRef")
    return problems


def _gpu_limit(resources: Mapping[str, Any]) -> float | None:
    """The pod's nvidia.com/gpu limit (or request); a malformed quantity counts as none (the pool's own checks
    report it)."""
    for section in ("limits", "requests"):
        value = (resources.get(section) or {}).get(GPU_RESOURCE)
        if value is not None:
            try:
                return float(parse_quantity(value))
            except ValueError:
                return None
    return None


def dedicated_gpu_problems(llm: LLMSpec, server_spec: Spec) -> list[str]:
    """A dedicated pool template that asks for other GPUs than the parallelism gives (per pod)."""
    if llm.gpus_per_pod is None:
        return []
    limit = _gpu_limit(server_spec.get("resources") or {})
    if limit is not None and limit != llm.gpus_per_pod:
        return [
            f"server.resources asks for {limit:g} {GPU_RESOURCE} but llm.parallelism "
            f"({llm.tensor}x{llm.pipeline}) needs {llm.gpus_per_pod} per {'pod' if llm.group_size > 1 else 'copy'}: "
            "leave the GPUs to the parallelism"
        ]
    return []


def shared_gpu_problems(llm: LLMSpec, pool: str, pool_spec: Spec) -> list[str]:
    """A shared pool whose pods have fewer GPUs than one copy needs."""
    if llm.gpus is None:
        return []
    limit = _gpu_limit(pool_spec.get("resources") or {}) or 0
    if limit < llm.gpus:
        return [
            f"InferenceServer {pool} gives each pod {limit:g} {GPU_RESOURCE}; llm.parallelism "
            f"({llm.tensor}x{llm.pipeline}) needs {llm.gpus} on one pod"
        ]
    return []


def apply_to_dedicated_server(llm: LLMSpec, server_spec: Body) -> Body:
    """The dedicated pool's spec with the copy's GPUs per pod (tensor x pipeline on one pod, or its share of a
    group's) and the pod labels the endpoint picker reads."""
    out = copy.deepcopy(server_spec)
    if llm.gpus_per_pod is not None:
        resources = out.setdefault("resources", {})
        resources.setdefault("limits", {})[GPU_RESOURCE] = llm.gpus_per_pod
        requests = resources.get("requests")
        if requests is not None and GPU_RESOURCE in requests:
            requests[GPU_RESOURCE] = llm.gpus_per_pod
    labels = out.setdefault("podLabels", {})
    labels[ENGINE_TYPE_LABEL] = ENGINE_TYPE
    labels[LLM_ENGINE_LABEL] = llm.engine
    return out


def openai_service_port() -> Body:
    """`/v1` is served on the pods' HTTP port; the Service offers it on port 80 as well."""
    return {
        "name": "openai",
        "port": OPENAI_SERVICE_PORT,
        "targetPort": "http",
        "protocol": "TCP",
        "appProtocol": "http",
    }


def openai_url(service: str, namespace: str, tls: bool = False) -> str:
    scheme = "https" if tls else "http"
    return f"{scheme}://{service}.{namespace}.svc:{OPENAI_SERVICE_PORT}/v1"


# --- autoscaling on tokens ----------------------------------------------------------------------------------------


def token_metrics(
    autoscaling: Mapping[str, Any], model_name: str, waiting_metric: str, kv_metric: str
) -> list[Body]:
    """Pods metrics of an LLM model's HPA: requests waiting per pod (vllm:num_requests_waiting), and KV-cache use
    per pod (vllm:kv_cache_usage_perc) when a target for it is set; both served by prometheus-adapter."""
    selector = {"matchLabels": {"model_name": model_name}}
    waiting = int(autoscaling.get("targetRequestsWaiting") or 2)
    metrics: list[Body] = [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": waiting_metric, "selector": selector},
                "target": {"type": "AverageValue", "averageValue": str(waiting)},
            },
        }
    ]
    kv = autoscaling.get("targetKVCacheUsagePercent")
    if kv is not None:
        metrics.append(
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": kv_metric, "selector": copy.deepcopy(selector)},
                    "target": {"type": "AverageValue", "averageValue": f"{int(kv) * 10}m"},
                },
            }
        )
    return metrics
