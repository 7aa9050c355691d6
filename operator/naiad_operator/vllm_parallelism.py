"""The load config that hands a vllm InferenceModel's `llm.parallelism` to the engine: Naiad's vllm backend takes the
config parameters `tensor_parallel_size` / `pipeline_parallel_size` over `model.json`'s, and a copy over several
GPUs is one KIND_MODEL instance that sees all of the pod's GPUs (of the group's pods, through Ray, for a copy larger
than a node). A load's `config` replaces the repository's
config.pbtxt (Triton's semantics): the base is the model's own `config` when it has one, else a bare vllm config
the backend completes to the vLLM shape."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from .llm import LLMSpec

KIND_MODEL = "KIND_MODEL"


def _kinds(config: Mapping[str, Any]) -> set[str]:
    groups = config.get("instance_group") or []
    if not isinstance(groups, list):
        return {repr(groups)}
    return {str(g.get("kind") or "KIND_AUTO") if isinstance(g, Mapping) else repr(g) for g in groups}


def vllm_load_config(
    llm: LLMSpec | None, config: Mapping[str, Any] | None
) -> tuple[dict[str, Any] | None, list[str]]:
    """(the load config, problems): `config` with the parallel sizes for an `engine: vllm` copy over more than one
    GPU; `config` unchanged for any other model."""
    base = copy.deepcopy(dict(config)) if config is not None else None
    if llm is None or llm.engine != "vllm" or llm.gpus is None or llm.gpus < 2:
        return base, []
    out: dict[str, Any] = base or {}
    out.setdefault("backend", "vllm")
    kinds = _kinds(out)
    if kinds - {KIND_MODEL}:
        return out, [
            f"llm.parallelism ({llm.tensor}x{llm.pipeline}) runs one vllm engine over {llm.gpus} GPUs: "
            f"config.instance_group must be {KIND_MODEL}, got {', '.join(sorted(kinds))}"
        ]
    if not kinds:
        out["instance_group"] = [{"kind": KIND_MODEL, "count": 1}]
    parameters = out.setdefault("parameters", {})
    if not isinstance(parameters, dict):
        return out, [f"config.parameters must be a map of name to {{string_value: ...}}, got {parameters!r}"]
    parameters["tensor_parallel_size"] = {"string_value": str(llm.tensor)}
    parameters["pipeline_parallel_size"] = {"string_value": str(llm.pipeline)}
    if llm.group_size > 1:  # the engine's workers span the pods of a LeaderWorkerSet group, joined by Ray
        parameters["distributed_executor_backend"] = {"string_value": "ray"}
    return out, []
