"""OpenAI's response objects and streaming chunks: chat completions (content, reasoning and tool calls, as
frontends/llm/shaping.py shapes a choice), text completions, embeddings, models, usage and logprobs."""

from __future__ import annotations

import base64
import time
import uuid

import numpy as np

from ...llm.tool_parsers import ToolCall
from ..llm.request import Generation
from ..llm.service import Usage
from ..llm.shaping import Shaped


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


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


class Builder:
    """The objects of one response: the same id, creation time and model on every chunk."""

    def __init__(self, chat: bool, model: str, gen: Generation):
        self.chat = chat
        self.gen = gen
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.model = model
        self.object = "chat.completion" if chat else "text_completion"
        self.reasoning = False  # the model has a reasoning parser: messages carry reasoning_content

    def _head(self, chunk: bool) -> dict:
        obj = self.object + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, choices: list[tuple[Shaped, str, dict | None]], usage: Usage) -> dict:
        """The response of a request that did not stream: one (shaped text, finish_reason, logprobs) per choice."""
        out = self._head(False)
        out["choices"] = [self._choice(i, *c) for i, c in enumerate(choices)]
        out["usage"] = usage.as_dict()
        return out

    def _choice(self, index: int, shaped: Shaped, finish_reason: str, logprobs: dict | None) -> dict:
        if not self.chat:
            return {
                "index": index,
                "text": shaped.content,
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }
        message: dict = {"role": "assistant", "content": shaped.content}
        if shaped.reasoning is not None or self.reasoning:
            message["reasoning_content"] = shaped.reasoning
        if shaped.calls:
            message["content"] = shaped.content or None
            message["tool_calls"] = [c.as_openai() for c in shaped.calls]
            finish_reason = "tool_calls"
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        logprobs: dict | None = None,
        role: bool = False,
        index: int = 0,
        reasoning: str | None = None,
    ) -> dict:
        out = self._head(True)
        if self.chat:
            delta: dict = {}
            if role:
                delta["role"] = "assistant"
            if reasoning:
                delta["reasoning_content"] = reasoning
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

    def tool_call_chunk(self, calls: list[ToolCall], index: int = 0) -> dict:
        out = self._head(True)
        deltas = [{"index": i, **call.as_openai()} for i, call in enumerate(calls)]
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


def model_card(name: str, created: int, root: str | None = None, parent: str | None = None) -> dict:
    """A model's card as vLLM lists one: `root` the model (a LoRA adapter's file), `parent` a LoRA adapter's base."""
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "naiad",
        "root": root if root is not None else name,
        "parent": parent,
    }
