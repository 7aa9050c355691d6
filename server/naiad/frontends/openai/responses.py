"""OpenAI's response objects and streaming chunks: chat completions, text completions, embeddings, models, usage,
logprobs, and tool calls parsed from generated text."""

from __future__ import annotations

import base64
import json
import time
import uuid
from dataclasses import dataclass

import numpy as np

from .protocol import Generation


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Usage:
    prompt_tokens: int | None = None
    completion_tokens: int | None = None

    def as_dict(self) -> dict | None:
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def _top(entry: dict) -> list[tuple[str, dict]]:
    """One position's {token_id: {logprob, rank, decoded_token}} as (token, data) pairs: the sampled token first
    (vLLM puts it first), then the rest by rank."""
    items = list(entry.values())
    first, rest = items[0], sorted(items[1:], key=lambda d: d.get("rank", 1 << 30))
    return [(str(d.get("decoded_token", "")), d) for d in [first, *rest]]


def chat_logprobs(entries: list[dict], top: int) -> dict:
    content = []
    for entry in entries:
        ranked = _top(entry)
        token, data = ranked[0]
        content.append(
            {
                "token": token,
                "logprob": float(data.get("logprob", 0.0)),
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [
                    {"token": t, "logprob": float(d.get("logprob", 0.0)), "bytes": list(t.encode("utf-8"))}
                    for t, d in ranked[: max(top, 0)]
                ],
            }
        )
    return {"content": content}


def completion_logprobs(entries: list[dict], top: int, offset: int = 0) -> dict:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        ranked = _top(entry)
        token, data = ranked[0]
        offsets.append(offset)
        offset += len(token)
        tokens.append(token)
        token_logprobs.append(float(data.get("logprob", 0.0)))
        top_logprobs.append({t: float(d.get("logprob", 0.0)) for t, d in ranked[: max(top, 1)]})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def parse_tool_calls(text: str, gen: Generation) -> list[dict] | None:
    """Tool calls in generated text: a JSON object {"name", "arguments"|"parameters"} (or a list of them), bare or
    inside <tool_call>...</tool_call> as Hermes-style templates write them, naming one of the request's tools.
    None when the text is not a tool call."""
    if not gen.tools or gen.tool_choice == "none":
        return None
    body = text.strip()
    if "<tool_call>" in body:
        parts = [p.split("</tool_call>")[0].strip() for p in body.split("<tool_call>")[1:]]
    else:
        parts = [body]
    known = {t["function"].get("name") for t in gen.tools}
    calls = []
    for part in parts:
        try:
            doc = json.loads(part)
        except ValueError:
            return None
        for item in doc if isinstance(doc, list) else [doc]:
            if not isinstance(item, dict) or item.get("name") not in known:
                return None
            args = item.get("arguments", item.get("parameters", {}))
            calls.append(
                {
                    "id": new_id("call"),
                    "type": "function",
                    "function": {
                        "name": item["name"],
                        "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                    },
                }
            )
    return calls or None


class Builder:
    """The objects of one response: the same id, creation time and model on every chunk."""

    def __init__(self, chat: bool, model: str, gen: Generation):
        self.chat = chat
        self.gen = gen
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.model = model
        self.object = "chat.completion" if chat else "text_completion"

    def _head(self, chunk: bool) -> dict:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, choices: list[tuple[str, str, dict | None]], usage: Usage) -> dict:
        """The response of a request that did not stream: one (text, finish_reason, logprobs) per choice."""
        out = self._head(False)
        out["choices"] = [self._choice(i, *c) for i, c in enumerate(choices)]
        out["usage"] = usage.as_dict()
        return out

    def _choice(self, index: int, text: str, finish_reason: str, logprobs: dict | None) -> dict:
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        message: dict = {"role": "assistant", "content": text}
        calls = parse_tool_calls(text, self.gen)
        if calls:
            message = {"role": "assistant", "content": None, "tool_calls": calls}
            finish_reason = "tool_calls"
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        logprobs: dict | None = None,
        role: bool = False,
        index: int = 0,
    ) -> dict:
        out = self._head(True)
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {
                "index": index,
                "text": text or "",
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        out["choices"] = [choice]
        if self.gen.include_usage:
            out["usage"] = None
        return out

    def tool_call_chunk(self, calls: list[dict], index: int = 0) -> dict:
        out = self._head(True)
        deltas = [{"index": i, **call} for i, call in enumerate(calls)]
        out["choices"] = [
            {"index": index, "delta": {"tool_calls": deltas}, "logprobs": None, "finish_reason": None}
        ]
        if self.gen.include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage: Usage) -> dict:
        out = self._head(True)
        out["choices"] = []
        out["usage"] = usage.as_dict()
        return out


def embedding_list(model: str, vectors: list[list[float]], encoding_format: str, prompt_tokens: int) -> dict:
    data = []
    for i, vector in enumerate(vectors):
        value: list[float] | str = vector
        if encoding_format == "base64":
            value = base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
        data.append({"object": "embedding", "index": i, "embedding": value})
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "naiad"}
