"""LLM requests (a `Generation`) onto a model's tensors, and its responses back: the vLLM shape (`text_input`, `stream`,
`sampling_parameters` JSON, ...) and the TensorRT-LLM shape (`text_input`, `max_tokens`, `temperature`, ... as tensors
of their own), sending only the inputs the model declares, as Triton's OpenAI frontend does."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ... import tensors
from ...inference import InferenceRequest, InferenceResponse
from ...llm import images
from ...llm import info as llm_info
from ...llm.shape import is_trtllm_shape, is_vllm_shape
from ..http.generate import fit_shape
from .errors import LLMError
from .request import Generation

VLLM = "vllm"
TRTLLM = "tensorrt_llm"


def llm_kind(mv) -> str | None:
    """Which LLM shape a model version speaks, or None for a model that is not an LLM."""
    if is_vllm_shape(mv.config):
        return VLLM
    if is_trtllm_shape(mv.config) or ("text_input" in mv.inputs and "text_output" in mv.outputs):
        return TRTLLM
    return None


def require_llm(mv, what: str) -> str:
    kind = llm_kind(mv)
    if kind is None:
        raise LLMError(
            f"model '{mv.name}' is not a language model: {what} needs a model in the vLLM shape (text_input and "
            f"sampling_parameters inputs) or the TensorRT-LLM shape (text_input in, text_output out)",
            param="model",
        )
    return kind


def supports_embeddings(mv) -> bool:
    return "embedding_request" in mv.inputs and "text_output" in mv.outputs


def image_input(mv) -> dict[str, Any] | None:
    """How a model takes images ({"marker": text or None}, llm/info.py's IMAGES), or None when it takes none: a
    vLLM-shape model with an `image` input (Triton vllm_backend's) whose engine says it is multimodal, or that
    publishes nothing (a Triton model: its Hugging Face chat template writes the image tokens)."""
    if images.INPUT not in mv.inputs or not is_vllm_shape(mv.config):
        return None
    published = llm_info.of(mv.ctx)
    if published is None:
        return {"marker": None}
    return llm_info.image_input(published)


def supports_structured_output(mv, kind: str) -> bool:
    """Guided decoding: vLLM does it (`backend: "vllm"`), an engine that says so in its LLMInfo
    (`extra["structured_outputs"]`) or its config (`parameters { key: "structured_outputs" value: { string_value:
    "true" } }`, for a python model wrapping an engine that does), a TensorRT-LLM-shape model with the
    guided_decoding_guide inputs."""
    if kind == TRTLLM:
        return {"guided_decoding_guide_type", "guided_decoding_guide"} <= set(mv.inputs)
    published = llm_info.of(mv.ctx)
    if published is not None and published.extra.get("structured_outputs"):
        return True
    param = mv.config.parameters.get("structured_outputs")
    if param is not None and param.string_value.strip().lower() in ("true", "1", "yes", "on"):
        return True
    return mv.config.backend == "vllm"


class _Inputs:
    """The tensors of one request, typed and shaped by the model's config."""

    def __init__(self, mv):
        self.mv = mv
        self.inputs: dict[str, np.ndarray] = {}
        self.datatypes: dict[str, str] = {}

    def has(self, name: str) -> bool:
        return name in self.mv.inputs

    def add(self, name: str, values: list) -> None:
        spec = self.mv.inputs[name]
        dims = ([-1] if self.mv.max_batch_size > 0 else []) + list(spec.dims)
        shape = fit_shape(name, dims, len(values))
        try:
            self.inputs[name] = tensors.from_json_data(spec.datatype, values, shape)
        except Exception as exc:
            raise LLMError(f"model '{self.mv.name}' cannot take input '{name}': {exc}") from None
        self.datatypes[name] = spec.datatype

    def add_if(self, name: str, values: list) -> None:
        if self.has(name):
            self.add(name, values)

    def request(self, request_id: str) -> InferenceRequest:
        return InferenceRequest(
            model_name=self.mv.name,
            inputs=self.inputs,
            datatypes=self.datatypes,
            model_version=self.mv.version,
            id=request_id,
        )


def sampling_parameters(gen: Generation, structured: Any = None) -> dict:
    """vLLM's SamplingParams as vllm_backend reads them from the `sampling_parameters` JSON."""
    params: dict[str, Any] = {}
    for key in ("max_tokens", "temperature", "top_p", "seed", "frequency_penalty", "presence_penalty"):
        value = getattr(gen, key)
        if value is not None:
            params[key] = value
    if gen.stop:
        params["stop"] = gen.stop
    if gen.logit_bias:
        params["logit_bias"] = gen.logit_bias
    if gen.logprobs is not None:
        params["logprobs"] = gen.logprobs
    params.update(gen.extra)
    if structured is not None:
        params["structured_outputs"] = json.dumps(structured)
    return params


def structured_output(mv, kind: str, gen: Generation) -> Any:
    """What guided decoding must follow ({"json": schema} or {"json_object": True}), or None; a clear 400 for a
    model that cannot do it."""
    wanted = None
    if gen.response_format is not None:
        wanted = {"json": gen.json_schema} if gen.json_schema is not None else {"json_object": True}
    if gen.tool_choice == "required" or isinstance(gen.tool_choice, dict):
        wanted = {"json": tool_call_schema(gen)}
    if gen.structured_outputs is not None:
        if wanted is not None:
            raise LLMError(
                "'structured_outputs' (or a guided_* field) cannot be combined with 'response_format' or a forced "
                "'tool_choice': give one",
                param="structured_outputs",
            )
        wanted = gen.structured_outputs
    if wanted is None:
        return None
    if not supports_structured_output(mv, kind):
        what = {
            "response_format": "'response_format'",
            "tool_choice": "a forced 'tool_choice'",
            "structured_outputs": "'structured_outputs'",
        }[structured_output_param(gen)]
        raise LLMError(
            f"{what} needs guided decoding, which model '{mv.name}' does not offer (vLLM and llama.cpp engines "
            "do; see docs/llm.md)",
            param=structured_output_param(gen),
        )
    return wanted


def structured_output_param(gen: Generation) -> str:
    """The request field that asked for structured output (named in its errors)."""
    if gen.structured_outputs is not None:
        return "structured_outputs"
    return (
        "tool_choice"
        if gen.tool_choice == "required" or isinstance(gen.tool_choice, dict)
        else "response_format"
    )


def trtllm_guide(structured: dict) -> tuple[str, str]:
    """TensorRT-LLM's guided_decoding_guide_type and guide for a structured-output dict (its types: json,
    json_schema, regex, ebnf_grammar); what it has no type for is a 400."""
    kinds = [k for k, v in structured.items() if v is not None and v is not False]
    if len(kinds) == 1 and kinds[0] == "json":
        schema = structured["json"]
        return "json_schema", schema if isinstance(schema, str) else json.dumps(schema)
    if len(kinds) == 1 and kinds[0] == "json_object":
        return "json", "{}"
    if len(kinds) == 1 and kinds[0] in ("regex", "grammar") and isinstance(structured[kinds[0]], str):
        return ("regex" if kinds[0] == "regex" else "ebnf_grammar"), structured[kinds[0]]
    raise LLMError(
        "a TensorRT-LLM model's guided decoding takes exactly one of json, json_object, regex or grammar (a string)",
        param="structured_outputs",
    )


def tool_call_schema(gen: Generation) -> dict:
    """The JSON a forced tool call must produce: {"name": ..., "arguments": {...}} for one of the tools."""
    tools = gen.tools or []
    if isinstance(gen.tool_choice, dict):
        name = gen.tool_choice["function"].get("name")
        tools = [t for t in tools if t["function"].get("name") == name]
        if not tools:
            raise LLMError(
                f"'tool_choice' names function {name!r}, which is not in 'tools'", param="tool_choice"
            )
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [t["function"].get("name")]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
        }
        for t in tools
    ]
    return variants[0] if len(variants) == 1 else {"anyOf": variants}


def generation_request(
    mv, kind: str, prompt: str, gen: Generation, request_id: str, lora: str | None = None
) -> InferenceRequest:
    """The inference request for one chat or completion request; `lora`: the LoRA adapter it runs under, passed as
    Triton vllm_backend's `lora_name` sampling parameter."""
    stream = gen.stream and mv.decoupled
    structured = structured_output(mv, kind, gen)
    ins = _Inputs(mv)
    ins.add("text_input", [prompt])
    if gen.images:
        if kind != VLLM or image_input(mv) is None:
            raise LLMError(f"model '{mv.name}' takes no images", param="messages")
        ins.add(images.INPUT, images.encode_values(gen.images))
    if gen.logprobs is not None and "logprobs" not in mv.outputs:
        raise LLMError(f"model '{mv.name}' does not return logprobs", param="logprobs")
    if kind == VLLM:
        ins.add_if("stream", [stream])
        params = sampling_parameters(gen, structured)
        if lora is not None:
            params["lora_name"] = lora
        ins.add("sampling_parameters", [json.dumps(params)])
        ins.add_if("exclude_input_in_output", [True])
        ins.add_if("return_finish_reason", [True])
        ins.add_if("return_num_input_tokens", [True])
        ins.add_if("return_num_output_tokens", [True])
        ins.add_if("return_logprobs", [gen.logprobs is not None])
        return ins.request(request_id)
    if lora is not None:
        raise LLMError(
            f"model '{mv.name}' takes no LoRA adapter by name (the TensorRT-LLM shape)", param="model"
        )
    # the TensorRT-LLM shape: one tensor per setting; a setting the model has no input for is refused
    settings: list[tuple[str, str, Any]] = [
        ("max_tokens", "max_tokens", gen.max_tokens),
        ("temperature", "temperature", gen.temperature),
        ("top_p", "top_p", gen.top_p),
        ("top_k", "top_k", gen.extra.get("top_k")),
        ("seed", "seed", gen.seed),
        ("frequency_penalty", "frequency_penalty", gen.frequency_penalty),
        ("presence_penalty", "presence_penalty", gen.presence_penalty),
        ("repetition_penalty", "repetition_penalty", gen.extra.get("repetition_penalty")),
        ("min_tokens", "min_length", gen.extra.get("min_tokens")),
        ("length_penalty", "length_penalty", gen.extra.get("length_penalty")),
    ]
    for field_name, input_name, value in settings:
        if value is None:
            continue
        if not ins.has(input_name):
            raise LLMError(
                f"model '{mv.name}' has no '{input_name}' input, so '{field_name}' cannot be honoured",
                param=field_name,
            )
        ins.add(input_name, [value])
    if gen.stop:
        if not ins.has("stop_words"):
            raise LLMError(
                f"model '{mv.name}' has no 'stop_words' input, so 'stop' cannot be honoured", param="stop"
            )
        ins.add("stop_words", list(gen.stop))
    if structured is not None:
        guide_type, guide = trtllm_guide(structured)
        ins.add("guided_decoding_guide_type", [guide_type])
        ins.add("guided_decoding_guide", [guide])
    ins.add_if("stream", [stream])
    ins.add_if("exclude_input_in_output", [True])
    ins.add_if("return_log_probs", [gen.logprobs is not None])
    ins.add_if("return_num_input_tokens", [True])
    ins.add_if("return_num_output_tokens", [True])
    return ins.request(request_id)


def embedding_request(mv, value: Any, dimensions: int | None, request_id: str) -> InferenceRequest:
    """vllm_backend's embedding request: {"input": ..., "pooling_params": {"dimensions": [d]}}."""
    pooling: dict[str, Any] = {}
    if dimensions is not None:
        pooling["dimensions"] = [dimensions]
    ins = _Inputs(mv)
    ins.add("embedding_request", [json.dumps({"input": value, "pooling_params": pooling})])
    if "text_input" in mv.inputs and not mv.inputs["text_input"].optional:
        ins.add("text_input", [""])
    ins.add_if("return_num_input_tokens", [True])
    return ins.request(request_id)


@dataclass
class Piece:
    """What one model response carries: text (a delta when streaming), and what came with it."""

    text: str = ""
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    logprobs: list[dict] = field(
        default_factory=list
    )  # vLLM's per-token {token_id: {logprob, rank, decoded_token}}


def _scalar(resp: InferenceResponse, name: str) -> Any:
    t = resp.output(name)
    if t is None:
        return None
    data = np.asarray(t.data).reshape(-1)
    if data.size == 0:
        return None
    value = data[0]
    if isinstance(value, (bytes, np.bytes_)):
        return bytes(value).decode("utf-8", "replace")
    return value.item() if hasattr(value, "item") else value


def read_response(resp: InferenceResponse) -> Piece:
    """A model response as text and token facts (outputs the model does not have are left out)."""
    piece = Piece()
    t = resp.output("text_output")
    if t is not None:
        data = np.asarray(t.data).reshape(-1)
        piece.text = "".join(
            bytes(v).decode("utf-8", "replace") if isinstance(v, (bytes, np.bytes_)) else str(v) for v in data
        )
    reason = _scalar(resp, "finish_reason")
    if reason and reason != "None":  # vllm_backend writes str(None) while a sequence runs
        piece.finish_reason = str(reason)
    for name in ("num_input_tokens", "num_output_tokens"):
        value = _scalar(resp, name)
        if value is not None:
            setattr(piece, name, int(value))
    logprobs = _scalar(resp, "logprobs")
    if logprobs and logprobs != "null":
        try:
            parsed = json.loads(logprobs)
        except ValueError:
            parsed = None
        if isinstance(parsed, list):
            piece.logprobs = [p for p in parsed if isinstance(p, dict) and p]
    return piece


def embedding_values(resp: InferenceResponse) -> tuple[list[float], int | None]:
    """The embedding a model returned (a JSON list of floats in `text_output`) and its input token count."""
    piece = read_response(resp)
    try:
        values = json.loads(piece.text)
    except ValueError:
        values = None
    if isinstance(values, list) and values and isinstance(values[0], list) and len(values) == 1:
        values = values[0]
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) for v in values):
        raise LLMError(
            f"model '{resp.model_name}' did not return an embedding (a JSON list of numbers)", status=500
        )
    return [float(v) for v in values], piece.num_input_tokens
