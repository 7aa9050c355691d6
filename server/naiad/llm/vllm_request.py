"""One request in the vLLM shape (Triton's vllm_backend inputs) read into Python values, and its outputs built back.

The three LLM engines (the `llamacpp`, `vllm` and `transformers` backends) read `text_input`, `stream`,
`sampling_parameters` (JSON; the request's parameters when the tensor is absent, as vllm_backend does),
`exclude_input_in_output`, the `return_*` flags and `embedding_request` with `parse`, and answer with `outputs`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from ..inference import InferenceRequest
from . import images, limits

RETURN_FLAGS = (
    "return_finish_reason",
    "return_cumulative_logprob",
    "return_logprobs",
    "return_num_input_tokens",
    "return_num_output_tokens",
)


@dataclass
class VllmRequest:
    prompt: str
    stream: bool
    prepend_input: bool  # not exclude_input_in_output
    sampling: dict[str, Any]
    returns: set[str] = field(default_factory=set)  # the return_* flags that are set
    embedding: dict[str, Any] | None = None  # the parsed embedding_request
    images: list[bytes] = field(
        default_factory=list
    )  # the `image` input's images, base64-decoded (images.py)


def _scalar(request: InferenceRequest, name: str) -> Any:
    value = request.inputs.get(name)
    if value is None:
        return None
    if value.size != 1:
        raise InvalidArgument(f"input '{name}' must hold exactly one element, got shape {list(value.shape)}")
    item = value.reshape(-1)[0]
    if not isinstance(item, bytes):
        return item
    try:
        return item.decode("utf-8")  # strict, as vllm_backend decodes
    except UnicodeDecodeError:
        raise InvalidArgument(f"input '{name}' is not valid UTF-8") from None


def _json_object(text: Any, what: str) -> dict[str, Any]:
    if isinstance(text, dict):
        return dict(text)
    try:
        value = json.loads(text) if text not in (None, "") else {}
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} must be a JSON object")
    return value


def parse(request: InferenceRequest) -> VllmRequest:
    """Read a vLLM-shape request; malformed values raise InvalidArgument."""
    embedding_text = _scalar(request, "embedding_request")
    if embedding_text is not None:
        embedding = _json_object(embedding_text, "embedding_request")
        if "input" not in embedding:
            raise InvalidArgument("embedding_request needs an 'input' (a string or a list of token ids)")
        return VllmRequest("", False, False, {}, {f for f in RETURN_FLAGS if _scalar(request, f)}, embedding)
    prompt = _scalar(request, "text_input")
    if prompt is None:
        raise InvalidArgument("input 'text_input' is required")
    stream = bool(_scalar(request, "stream") or False)
    exclude = _scalar(request, "exclude_input_in_output")
    prepend = (not bool(exclude)) if exclude is not None else not stream
    if prepend and stream:
        raise InvalidArgument("When streaming, `exclude_input_in_output` = False is not allowed.")
    text = _scalar(request, "sampling_parameters")
    if text is not None:
        sampling = _json_object(text, "sampling_parameters")
    else:
        sampling = {
            k: v for k, v in request.parameters.items() if not k.startswith(("triton_", "binary_data"))
        }
    returns = {f for f in RETURN_FLAGS if _scalar(request, f)}
    return VllmRequest(
        str(prompt), stream, prepend, sampling, returns, images=images.from_request(request.inputs)
    )


def outputs(
    req: VllmRequest,
    text: str,
    *,
    finish_reason: str | None = None,
    cumulative_logprob: float | None = None,
    logprobs: list[dict[str, Any]] | None = None,
    num_input_tokens: int = 0,
    num_output_tokens: int = 0,
) -> dict[str, np.ndarray]:
    """The response tensors: `text_output` always, the others when the request asked for them."""
    out = {"text_output": np.array([text.encode("utf-8")], dtype=np.object_)}
    if "return_finish_reason" in req.returns:
        out["finish_reason"] = np.array([str(finish_reason).encode()], dtype=np.object_)
    if "return_cumulative_logprob" in req.returns:
        value = float("nan") if cumulative_logprob is None else cumulative_logprob
        out["cumulative_logprob"] = np.array([value], dtype=np.float32)
    if "return_logprobs" in req.returns:
        out["logprobs"] = np.array([json.dumps(logprobs).encode()], dtype=np.object_)
    if "return_num_input_tokens" in req.returns:
        out["num_input_tokens"] = np.array([num_input_tokens], dtype=np.uint32)
    if "return_num_output_tokens" in req.returns:
        out["num_output_tokens"] = np.array([num_output_tokens], dtype=np.uint32)
    return out


def number(sampling: dict[str, Any], key: str, kind: type, default: Any) -> Any:
    """A sampling parameter as `kind` (int or float), InvalidArgument when it is not a number."""
    value = sampling.get(key, default)
    if value is None:
        return default
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise InvalidArgument(f"sampling parameter '{key}' must be a number, got {value!r}") from None


def stop_strings(sampling: dict[str, Any]) -> list[str]:
    """`stop` as a list of non-empty strings."""
    stop = sampling.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise InvalidArgument("sampling parameter 'stop' must be a string or a list of strings")
    return limits.check_stop([s for s in stop if s])
