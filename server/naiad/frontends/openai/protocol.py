"""Parsing and validating OpenAI request bodies into `Generation` and `Embedding` settings.

Fields OpenAI defines are checked (type and range) and answered with a 400 naming the field when wrong; fields this
server does not know are accepted and ignored, as OpenAI's own API does (never a 422).
"""

from __future__ import annotations

from typing import Any

import orjson

from ...errors import InvalidArgument
from ...llm import limits
from ..llm import media
from ..llm.errors import LLMError
from ..llm.request import Embedding, Generation

# vLLM's own sampling extensions to the OpenAI request that are handed to a vLLM-shape engine unchanged
VLLM_EXTRA_SAMPLING = {
    "top_k": int,
    "min_p": float,
    "repetition_penalty": float,
    "min_tokens": int,
    "ignore_eos": bool,
    "stop_token_ids": list,
    "include_stop_str_in_output": bool,
    "skip_special_tokens": bool,
    "spaces_between_special_tokens": bool,
    "length_penalty": float,
}
#: vLLM's older request fields for structured output -> their StructuredOutputsParams key
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs in one embeddings request
MAX_N = 16  # choices in one chat or completion request ('n')


def parse_body(body: bytes) -> dict:
    if not body:
        raise LLMError("the request body is empty: send a JSON object")
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise LLMError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise LLMError("the request body must be a JSON object")
    return doc


def _number(doc: dict, key: str, lo: float | None = None, hi: float | None = None) -> float | None:
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LLMError(f"'{key}' must be a number", param=key)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise LLMError(f"'{key}' must be between {lo} and {hi}, got {value}", param=key)
    return float(value)


def _integer(doc: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = doc.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise LLMError(f"'{key}' must be an integer", param=key)
    if lo is not None and value < lo:
        raise LLMError(f"'{key}' must be at least {lo}, got {value}", param=key)
    if hi is not None and value > hi:
        raise LLMError(f"'{key}' must be at most {hi}, got {value}", param=key)
    return value


def _boolean(doc: dict, key: str, default: bool = False) -> bool:
    value = doc.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise LLMError(f"'{key}' must be true or false", param=key)
    return value


def _model(doc: dict) -> str:
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise LLMError("'model' is required: the name of a model (GET /v1/models lists them)", param="model")
    return model


def _stop(doc: dict) -> list[str]:
    stop = doc.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop] if stop else []
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        try:
            return limits.check_stop([s for s in stop if s])
        except InvalidArgument as exc:
            raise LLMError(exc.message, param="stop") from None
    raise LLMError("'stop' must be a string or a list of strings", param="stop")


def _common(doc: dict, gen: Generation) -> None:
    gen.stream = _boolean(doc, "stream")
    options = doc.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            raise LLMError("'stream_options' must be an object", param="stream_options")
        if not gen.stream:
            raise LLMError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        gen.include_usage = _boolean(options, "include_usage")
    gen.n = _integer(doc, "n", lo=1, hi=MAX_N) or 1
    best_of = _integer(doc, "best_of", lo=1)
    if best_of is not None and best_of > 1:
        raise LLMError("'best_of' > 1 is not supported", param="best_of")
    gen.temperature = _number(doc, "temperature", 0.0, 2.0)
    gen.top_p = _number(doc, "top_p", 0.0, 1.0)
    if gen.top_p == 0.0:
        raise LLMError("'top_p' must be greater than 0", param="top_p")
    gen.seed = _integer(doc, "seed")
    gen.stop = _stop(doc)
    gen.frequency_penalty = _number(doc, "frequency_penalty", -2.0, 2.0)
    gen.presence_penalty = _number(doc, "presence_penalty", -2.0, 2.0)
    bias = doc.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in bias.values()
        ):
            raise LLMError("'logit_bias' must map token ids to numbers", param="logit_bias")
        gen.logit_bias = bias or None
    for key, kind in VLLM_EXTRA_SAMPLING.items():
        value = doc.get(key)
        if value is None:
            continue
        ok = (
            isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
            if kind is not float
            else isinstance(value, (int, float)) and not isinstance(value, bool)
        )
        if not ok:
            raise LLMError(f"'{key}' must be of type {kind.__name__}", param=key)
        gen.extra[key] = value
    if "top_k" in gen.extra and gen.extra["top_k"] < -1:
        raise LLMError("'top_k' must be -1 (off) or a positive integer", param="top_k")
    fmt = doc.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise LLMError(
                '\'response_format\' must be {"type": "text" | "json_object" | "json_schema"}',
                param="response_format",
            )
        if fmt["type"] == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise LLMError(
                    "'response_format.json_schema' must be an object with a 'schema'",
                    param="response_format.json_schema",
                )
            gen.json_schema = spec.get("schema", {})
        if fmt["type"] != "text":
            gen.response_format = fmt
    gen.structured_outputs = _structured_outputs(doc)


def _structured_outputs(doc: dict) -> dict | None:
    """vLLM's request fields for structured output as one dict: `structured_outputs` and the older `guided_*`."""
    spec = doc.get("structured_outputs")
    if spec is not None and not isinstance(spec, dict):
        raise LLMError("'structured_outputs' must be an object", param="structured_outputs")
    out = {k: v for k, v in (spec or {}).items() if v is not None}
    for field_name, kind in GUIDED.items():
        if doc.get(field_name) is not None:
            out[kind] = doc[field_name]
    return out or None


def _message(i: int, msg: Any) -> dict:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise LLMError(f"'{where}' must be an object with 'role' and 'content'", param=where)
    role = msg.get("role")
    if role not in ROLES:
        raise LLMError(
            f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}", param=where + ".role"
        )
    content = msg.get("content")
    out = dict(msg)
    if isinstance(content, list):
        parts: list[dict] = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if (
                isinstance(part, dict)
                and kind in ("text", "input_text")
                and isinstance(part.get("text"), str)
            ):
                parts.append({"type": "text", "text": part["text"]})
            elif isinstance(part, str):
                parts.append({"type": "text", "text": part})
            elif kind == "image_url" and role == "user":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                parts.append(media.image_part(url, f"{where}.content[{j}].image_url.url", where + ".content"))
            elif kind == "input_image" and role == "user":  # the Responses API's part, taken here too
                parts.append(
                    media.image_part(part.get("image_url"), f"{where}.content[{j}].image_url", where)
                )
            else:
                kind = kind if isinstance(part, dict) else type(part).__name__
                raise LLMError(
                    f"'{where}.content' has a part of type {kind!r}: text parts are supported, and image_url "
                    "parts in user messages",
                    param=where + ".content",
                )
        out["content"] = media.content(parts)
    elif content is None:
        if role != "assistant":
            raise LLMError(f"'{where}.content' is required for role '{role}'", param=where + ".content")
    elif not isinstance(content, str):
        raise LLMError(
            f"'{where}.content' must be a string or a list of text parts", param=where + ".content"
        )
    return out


def chat(doc: dict) -> Generation:
    gen = Generation(model=_model(doc))
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise LLMError("'messages' must be a non-empty list", param="messages")
    gen.messages = [_message(i, m) for i, m in enumerate(messages)]
    _common(doc, gen)
    mct = _integer(doc, "max_completion_tokens", lo=1)
    gen.max_tokens = mct if mct is not None else _integer(doc, "max_tokens", lo=1)
    if _boolean(doc, "logprobs"):
        top = _integer(doc, "top_logprobs", lo=0, hi=20)
        gen.logprobs = top or 0
    elif doc.get("top_logprobs") is not None:
        raise LLMError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    tools = doc.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(
            isinstance(t, dict)
            and t.get("type", "function") == "function"
            and isinstance(t.get("function"), dict)
            for t in tools
        ):
            raise LLMError(
                '\'tools\' must be a list of {"type": "function", "function": {...}}', param="tools"
            )
        gen.tools = tools or None
    choice = doc.get("tool_choice")
    if choice is not None:
        named = isinstance(choice, dict) and isinstance(choice.get("function"), dict)
        if choice not in ("none", "auto", "required") and not named:
            raise LLMError(
                "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", ...}",
                param="tool_choice",
            )
        if choice != "none" and not gen.tools:
            raise LLMError("'tool_choice' needs 'tools'", param="tool_choice")
        gen.tool_choice = choice
    gen.add_generation_prompt = _boolean(doc, "add_generation_prompt", True)
    gen.continue_final_message = _boolean(doc, "continue_final_message")
    kwargs = doc.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise LLMError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        gen.chat_template_kwargs = kwargs
    return gen


def completion(doc: dict) -> Generation:
    gen = Generation(model=_model(doc))
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        raise LLMError("one prompt per request is supported: send a string, not a list", param="prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        raise LLMError("a prompt of token ids is not supported: send the text", param="prompt")
    if not isinstance(prompt, str):
        raise LLMError("'prompt' must be a string", param="prompt")
    gen.prompt = prompt
    _common(doc, gen)
    gen.max_tokens = _integer(doc, "max_tokens", lo=1)
    gen.echo = _boolean(doc, "echo")
    top = _integer(doc, "logprobs", lo=0, hi=20)
    gen.logprobs = top
    if doc.get("suffix"):
        raise LLMError("'suffix' is not supported", param="suffix")
    return gen


def embedding(doc: dict) -> Embedding:
    model = _model(doc)
    value = doc.get("input")
    if isinstance(value, str):
        inputs: list = [value]
    elif (
        isinstance(value, list)
        and value
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    ):
        inputs = [value]
    elif (
        isinstance(value, list)
        and value
        and all(
            isinstance(v, str) or (isinstance(v, list) and v and all(isinstance(t, int) for t in v))
            for v in value
        )
    ):
        inputs = value
    else:
        raise LLMError(
            "'input' must be a string, a list of strings, or token ids (a list of integers or of lists)",
            param="input",
        )
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise LLMError(f"'input' may hold at most {MAX_EMBEDDING_INPUTS} items", param="input")
    if any(v == "" for v in inputs):
        raise LLMError("'input' may not contain empty strings", param="input")
    fmt = doc.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise LLMError("'encoding_format' must be 'float' or 'base64'", param="encoding_format")
    dims = _integer(doc, "dimensions", lo=1)
    return Embedding(model=model, inputs=inputs, encoding_format=fmt, dimensions=dims)
