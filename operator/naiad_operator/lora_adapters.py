"""An LLM model's LoRA adapters (`llm.loraAdapters`): checked, and written into the load config as the llamacpp
backend's `lora_adapters` parameter, so every pod that holds the model holds its adapters and exports them in
vllm:lora_requests_info, which the Inference Extension's endpoint picker reads for adapter affinity."""

from __future__ import annotations

import copy
import posixpath
import re
from collections.abc import Mapping
from typing import Any

# what an adapter's name may be: it is a model name on /v1 and a label value in vllm:lora_requests_info
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,126}")
ENGINES = ("llamacpp",)  # the engines whose backend takes adapters from a parameter
PARAMETER = "lora_adapters"


def parse(block: Mapping[str, Any], engine: str, problems: list[str]) -> tuple[tuple[str, str], ...]:
    """`llm.loraAdapters` as (name, path) pairs; what is wrong goes to `problems`."""
    raw = block.get("loraAdapters")
    if raw is None:
        return ()
    if not isinstance(raw, list):
        problems.append(f"llm.loraAdapters must be a list of {{name, path}}, got {raw!r}")
        return ()
    if raw and engine not in ENGINES:
        problems.append(
            f"llm.loraAdapters: the {engine!r} engine does not take adapters from the operator (llamacpp does; "
            "a vllm model reads multi_lora.json in its folder)"
        )
        return ()
    out: list[tuple[str, str]] = []
    for i, entry in enumerate(raw):
        where = f"llm.loraAdapters[{i}]"
        if not isinstance(entry, Mapping):
            problems.append(f"{where} must be {{name, path}}, got {entry!r}")
            continue
        name, path = str(entry.get("name") or ""), str(entry.get("path") or "")
        if not NAME.fullmatch(name):
            problems.append(
                f"{where}.name must be letters, digits, '.', '_' or '-' (at most 127), got {name!r}"
            )
        elif any(name == seen for seen, _ in out):
            problems.append(f"{where}.name {name!r} is given twice")
        elif not path or posixpath.isabs(path) or ".." in path.split("/") or any(c in path for c in ",="):
            problems.append(
                f"{where}.path must be a GGUF's path relative to the model's version folder (no '..', ',' or "
                f"'='), got {path!r}"
            )
        else:
            out.append((name, path))
    return tuple(out)


def with_adapters(
    adapters: tuple[tuple[str, str], ...], config: Mapping[str, Any] | None
) -> tuple[dict[str, Any] | None, list[str]]:
    """(the load config, problems): `config` with the adapters as the `lora_adapters` parameter and backend
    llamacpp (none: unchanged). A load config replaces the repository's config.pbtxt, as Triton's does, so the
    model's other settings belong in `config` too. A config that names its own `lora_adapters` is a problem: one
    place says which adapters a model has."""
    out = copy.deepcopy(dict(config)) if config is not None else None
    if not adapters:
        return out, []
    out = out or {}
    out.setdefault("backend", ENGINES[0])
    parameters = out.setdefault("parameters", {})
    if not isinstance(parameters, dict):
        return out, [f"config.parameters must be a map of name to {{string_value: ...}}, got {parameters!r}"]
    if PARAMETER in parameters:
        return out, [f"set the adapters in llm.loraAdapters or in config.parameters.{PARAMETER}, not both"]
    parameters[PARAMETER] = {"string_value": ",".join(f"{name}={path}" for name, path in adapters)}
    return out, []
