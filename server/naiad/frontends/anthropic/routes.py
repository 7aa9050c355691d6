"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API on the LLM generation service,
answered as the `anthropic` client reads it: a message of content blocks (thinking, text, tool_use), its
`stop_reason` and usage, or the stream of typed events (`message_start`, `content_block_start`,
`content_block_delta`, `content_block_stop`, `message_delta`, `message_stop`); errors as Anthropic's error object
(`{"type": "error", "error": {"type", "message"}}`).

`stop_reason` is `tool_use` for a response of tool calls, `max_tokens` when the limit cut it, else `end_turn`: the
engines do not say which stop sequence ended a response, so `stop_sequence` is null.
"""

from __future__ import annotations

import json
import logging
import uuid
from contextlib import aclosing

import orjson
from aiohttp import web

from ...errors import as_naiad_error
from ...llm.tool_parsers import ToolCall
from ..http.codec import read_body
from ..http.sse import EventStream
from ..llm.errors import LLMError
from ..llm.guard import guard, guard_stream
from ..llm.request import Generation
from ..llm.service import ChoiceState, LLMService, Prepared
from ..llm.shaping import Shaper
from . import protocol

log = logging.getLogger("naiad.anthropic")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_object(exc: BaseException) -> tuple[int, dict]:
    """(HTTP status, Anthropic's error object) for any error a request met."""
    if isinstance(exc, LLMError):
        status, message = exc.status, exc.message
    else:
        err = as_naiad_error(exc)
        status, message = err.http_status, err.message
        if status == 499:
            status = 400
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": message}}


def _json(data: dict, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _tool_use(call: ToolCall) -> dict:
    try:
        arguments = json.loads(call.arguments) if call.arguments else {}
    except ValueError:
        arguments = {"arguments": call.arguments}
    tool_id = call.id.replace("call_", "toolu_", 1)
    return {"type": "tool_use", "id": tool_id, "name": call.name, "input": arguments}


class MessagesRoutes:
    def __init__(self, llm: LLMService, max_input_size: int, stall_timeout: float | None):
        self.llm = llm
        self.max_input_size = max_input_size
        self.stall_timeout = stall_timeout

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/messages", guard(self.create, self.error_response))
        router.add_post("/v1/messages/count_tokens", guard(self.count_tokens, self.error_response))

    @staticmethod
    def owns(path: str) -> bool:
        return path == "/v1/messages" or path.startswith("/v1/messages/")

    @staticmethod
    def error_response(exc: BaseException) -> web.Response:
        status, body = error_object(exc)
        return _json(body, status)

    async def _body(self, request: web.Request) -> dict:
        raw = await read_body(request, self.max_input_size)
        try:
            doc = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError as exc:
            raise LLMError(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(doc, dict):
            raise LLMError("the request body must be a JSON object")
        return doc

    # ---- count_tokens ----
    async def count_tokens(self, request: web.Request) -> web.Response:
        gen = protocol.parse(await self._body(request), count_only=True)
        mv, _ = await self.llm.resolve(gen.model)  # (an adapter counts by its base model's tokenizer)
        prompt = await self.llm.render(mv, self.llm.template(mv), gen)
        count = await self.llm.count(mv, prompt)
        if count is None:
            raise LLMError(f"model '{mv.name}' publishes no tokenizer to count with")
        return _json({"input_tokens": count})

    # ---- messages ----
    async def create(self, request: web.Request) -> web.StreamResponse:
        gen = protocol.parse(await self._body(request))
        prepared = await self.llm.prepare(gen, "/v1/messages")
        message_id = f"msg_{uuid.uuid4().hex}"
        if gen.stream:
            return await self._stream(request, prepared, gen, message_id)
        state = (await self.llm.collect(request, prepared, gen, message_id))[0]
        shaped = Shaper(gen, prepared.parsers, prepared.prompt).whole(state.text)
        content: list[dict] = []
        if shaped.reasoning is not None:
            content.append({"type": "thinking", "thinking": shaped.reasoning, "signature": ""})
        if shaped.content or not shaped.calls:
            content.append({"type": "text", "text": shaped.content})
        content += [_tool_use(c) for c in shaped.calls]
        message = self._message(message_id, prepared, state)
        message["content"] = content
        message["stop_reason"] = self._stop_reason(gen, state, bool(shaped.calls))
        message["usage"]["output_tokens"] = state.usage.completion_tokens or 0
        return _json(message)

    def _message(self, message_id: str, prepared: Prepared, state: ChoiceState) -> dict:
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": prepared.name,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {
                "input_tokens": state.usage.prompt_tokens or prepared.prompt_tokens or 0,
                "output_tokens": 0,
                "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": 0,
            },
        }

    def _stop_reason(self, gen: Generation, state: ChoiceState, calls: bool) -> str:
        if calls:
            return "tool_use"
        return "max_tokens" if self.llm.reason(state.reason, gen, state.usage) == "length" else "end_turn"

    async def _stream(
        self, request: web.Request, prepared: Prepared, gen: Generation, message_id: str
    ) -> web.StreamResponse:
        events = EventStream(request, self.stall_timeout)
        state = ChoiceState()
        shaper = Shaper(gen, prepared.parsers, prepared.prompt)
        blocks = _Blocks(events)

        async def write() -> web.StreamResponse:
            start = self._message(message_id, prepared, state)
            await events.send({"type": "message_start", "message": start}, event="message_start")
            reqs = self.llm.requests(prepared, gen, message_id)
            async with aclosing(self.llm.run(request, reqs)) as pieces:
                async for _, piece, _ in pieces:
                    if piece is None:
                        continue
                    state.add(piece)
                    thought, text = shaper.feed(piece.text)
                    await blocks.add(thought, text)
            thought, text, calls = shaper.finish()
            await blocks.add(thought, text)
            if not calls and blocks.count == 0:
                await blocks.add("", "", force_text=True)
            await blocks.close()
            for call in calls:
                await blocks.tool_use(call)
            await self.llm.finish_usage(state.usage, prepared, state.text)
            delta = {"stop_reason": self._stop_reason(gen, state, bool(calls)), "stop_sequence": None}
            usage = {"output_tokens": state.usage.completion_tokens or 0}
            await events.send(
                {"type": "message_delta", "delta": delta, "usage": usage}, event="message_delta"
            )
            await events.send({"type": "message_stop"}, event="message_stop")
            return await events.end()

        async def fail(exc: BaseException) -> web.StreamResponse:
            await events.send(error_object(exc)[1], event="error")
            return await events.end()

        return await guard_stream(events, write(), fail, f"message stream {message_id}")


class _Blocks:
    """The content blocks of a streamed message: each opened with its first delta, closed when the next opens."""

    def __init__(self, events: EventStream):
        self.events = events
        self.count = 0
        self.open: str | None = None  # the kind of the block being written

    async def _start(self, block: dict) -> None:
        await self.close()
        self.open = block["type"]
        await self.events.send(
            {"type": "content_block_start", "index": self.count, "content_block": block},
            event="content_block_start",
        )

    async def _delta(self, delta: dict) -> None:
        await self.events.send(
            {"type": "content_block_delta", "index": self.count, "delta": delta}, event="content_block_delta"
        )

    async def close(self) -> None:
        if self.open is None:
            return
        if self.open == "thinking":
            await self._delta({"type": "signature_delta", "signature": ""})
        await self.events.send(
            {"type": "content_block_stop", "index": self.count}, event="content_block_stop"
        )
        self.open = None
        self.count += 1

    async def add(self, thought: str, text: str, force_text: bool = False) -> None:
        if thought:
            if self.open != "thinking":
                await self._start({"type": "thinking", "thinking": "", "signature": ""})
            await self._delta({"type": "thinking_delta", "thinking": thought})
        if text or force_text:
            if self.open != "text":
                await self._start({"type": "text", "text": ""})
            if text:
                await self._delta({"type": "text_delta", "text": text})

    async def tool_use(self, call: ToolCall) -> None:
        block = _tool_use(call)
        await self._start({**block, "input": {}})
        await self._delta(
            {"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}
        )
        await self.close()
