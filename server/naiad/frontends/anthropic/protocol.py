"""Anthropic Messages request bodies read into a chat `Generation`: `system`, `messages` of text, `image` (base64
or url sources, in user messages), `tool_use` and `tool_result` blocks (as the chat template's assistant tool calls and tool messages), `tools` (their
`input_schema` as the function's parameters), `tool_choice`, `max_tokens` (required), `stop_sequences`,
`temperature`, `top_p`, `top_k`, `stream`, and `thinking` (the chat template's `enable_thinking`)."""

from __future__ import annotations

import json
from typing import Any

from ..llm import media
from ..llm.errors import LLMError
from ..llm.request import Generation


def _text(content: Any, where: str) -> str:
    """Text blocks (or a string) as one text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise LLMError(f"{where}: content must be a string or a list of content blocks")
    parts = []
    for block in content:
        if (
            not isinstance(block, dict)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise LLMError(f"{where}: a block of type {kind!r} where text blocks are expected")
        parts.append(block["text"])
    return "\n".join(parts)


def _message(i: int, msg: Any) -> list[dict]:
    """One Anthropic message as the chat messages a template knows (user, assistant with tool calls, tool)."""
    where = f"messages.{i}"
    if not isinstance(msg, dict) or msg.get("role") not in ("user", "assistant"):
        raise LLMError(f"{where}: role must be 'user' or 'assistant'")
    role, content = msg["role"], msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise LLMError(f"{where}.content: must be a string or a list of content blocks")
    texts: list[str] = []
    parts: list[dict] = []  # a user message's text and image parts, in order (media.py)
    calls: list[dict] = []
    results: list[dict] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        here = f"{where}.content.{j}"
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and role == "user":
            parts.append(media.image_part(_image_url(block.get("source"), here), f"{here}.source"))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise LLMError(f"{here}: tool_use needs an id and a name")
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise LLMError(f"{here}: tool_result needs a tool_use_id")
            result = block.get("content", "")
            text = _text(result, here) if result else ""
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not shown to the model again (as chat templates drop it)
        else:
            raise LLMError(f"{here}: content blocks of type {kind!r} are not supported in a {role} message")
    out: list[dict] = list(results)
    if role == "assistant":
        if texts or calls:
            message: dict = {"role": "assistant", "content": "\n".join(texts) or None}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    elif parts:
        out.append({"role": "user", "content": media.content(parts)})
    return out


def _image_url(source: Any, where: str) -> str:
    """An image block's source as a URL: `base64` (its media_type and data) as a data: URL, or `url` as given."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str) or not data:
            raise LLMError(f"{where}.source: a base64 image needs a media_type and data")
        return f"data:{media_type};base64,{data}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise LLMError(f"{where}.source: an image's source must be of type 'base64' (or 'url'), got {kind!r}")


def _number(doc: dict, key: str, low: float, high: float | None) -> float | None:
    value = doc.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or value < low
        or (high is not None and value > high)
    ):
        raise LLMError(
            f"{key}: must be a number between {low} and {high}"
            if high is not None
            else f"{key}: must be at least {low}"
        )
    return float(value)


def parse(doc: dict, count_only: bool = False) -> Generation:
    """A Messages request body as a chat Generation (InvalidArgument-like LLMErrors in Anthropic's words)."""
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise LLMError("model: Field required")
    gen = Generation(model=model)
    max_tokens = doc.get("max_tokens")
    if not count_only:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise LLMError("max_tokens: Field required (an integer of at least 1)")
        gen.max_tokens = max_tokens
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages:
        raise LLMError("messages: at least one message is required")
    chat: list[dict] = []
    system = doc.get("system")
    if system:
        chat.append({"role": "system", "content": _text(system, "system")})
    for i, msg in enumerate(messages):
        chat += _message(i, msg)
    gen.messages = chat
    stop = doc.get("stop_sequences")
    if stop is not None:
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise LLMError("stop_sequences: must be a list of strings")
        gen.stop = [s for s in stop if s]
    gen.temperature = _number(doc, "temperature", 0.0, 1.0)
    gen.top_p = _number(doc, "top_p", 0.0, 1.0)
    top_k = doc.get("top_k")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise LLMError("top_k: must be a non-negative integer")
        gen.extra["top_k"] = top_k
    stream = doc.get("stream", False)
    if not isinstance(stream, bool):
        raise LLMError("stream: must be true or false")
    gen.stream = stream
    tools = doc.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise LLMError("tools: must be a list")
        gen.tools = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
                raise LLMError(f"tools.{i}: a tool needs a name (and an input_schema)")
            if tool.get("type") not in (None, "custom"):
                raise LLMError(
                    f"tools.{i}: tools of type {tool.get('type')!r} are not supported (custom tools are)"
                )
            function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
            if tool.get("description"):
                function["description"] = tool["description"]
            gen.tools.append({"type": "function", "function": function})
        gen.tools = gen.tools or None
    choice = doc.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "auto":
            gen.tool_choice = "auto"
        elif kind == "any":
            gen.tool_choice = "required"
        elif kind == "none":
            gen.tool_choice = "none"
        elif kind == "tool" and isinstance(choice.get("name"), str):
            gen.tool_choice = {"type": "function", "function": {"name": choice["name"]}}
        else:
            raise LLMError(
                'tool_choice: must be {"type": "auto" | "any" | "none"} or {"type": "tool", "name": ...}'
            )
        if gen.tool_choice != "none" and not gen.tools:
            raise LLMError("tool_choice: needs tools")
    thinking = doc.get("thinking")
    if isinstance(thinking, dict) and thinking.get("type") in ("enabled", "disabled"):
        gen.chat_template_kwargs["enable_thinking"] = thinking["type"] == "enabled"
    return gen
