"""OpenAI's Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`, `POST .../cancel`,
`GET .../input_items`), on the same generation service as chat completions.

A request's `input` (a string, or message, `function_call` and `function_call_output` items), its `instructions`
and the conversation of its `previous_response_id` become one chat; `tools` (function tools), `tool_choice`,
`text.format` (structured output), `max_output_tokens`, `temperature` and `top_p` map onto the chat's settings, and
`reasoning.effort` reaches the chat template as `reasoning_effort`. The answer is output items: a reasoning item (a
thinking model's `<think>` block), a message, function calls; streamed as the typed events the `openai` client's
`responses.stream` reads (`response.created`, `response.output_item.added`, `response.output_text.delta`,
`response.function_call_arguments.delta`, ..., `response.completed`).

Stored responses (`store`, true by default, as OpenAI's) are kept in this process's memory, as vLLM keeps them:
the newest `STORE_MAX_RESPONSES` and at most `STORE_MAX_BYTES` of them; older ones are forgotten (a later
`previous_response_id` naming one is a 404). `background: true` runs the response after the answer, to be read with
`GET` and stopped with `cancel`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

from ..http.sse import EventStream
from ..llm import media
from ..llm.errors import LLMError
from ..llm.guard import guard_stream
from ..llm.request import Generation
from ..llm.service import ChoiceState, LLMService, Prepared
from ..llm.shaping import Shaper
from . import protocol

log = logging.getLogger("naiad.openai")

STORE_MAX_RESPONSES = 1000
STORE_MAX_BYTES = 64 * 1024 * 1024
Body = Callable[[web.Request], Awaitable[dict]]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


# ---- the request ----


@dataclass
class ResponsesRequest:
    """A Responses API request read: the chat it is, and the fields the response object repeats."""

    gen: Generation
    echo: dict[str, Any]  # request fields the response object carries back as given
    store: bool
    background: bool
    previous_response_id: str | None
    new_messages: list[dict]  # this request's own messages (a later one's previous_response_id replays them)
    input_items: list[dict]  # this request's `input` as items (GET .../input_items)
    parallel_tool_calls: bool


def _content_of(content: Any, where: str, role: str) -> str | list[dict]:
    """A message's content (a string, or input_text/output_text parts, and input_image parts in a user message) as
    text, or as text and image parts (media.py) when it has images."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise LLMError(f"'{where}.content' must be a string or a list of content parts", param=where)
    parts: list[dict] = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image" and role == "user":
            if part.get("image_url") is None and part.get("file_id") is not None:
                raise LLMError(
                    f"'{where}.content[{i}]' names an uploaded file (file_id), which this server does not keep: "
                    "give image_url (a data: URL)",
                    param=f"{where}.content",
                )
            parts.append(media.image_part(part.get("image_url"), f"{where}.content[{i}].image_url", "input"))
        else:
            raise LLMError(
                f"'{where}.content[{i}]' is of type {kind!r}: text parts (input_text, output_text) are supported, "
                "and input_image parts in user messages",
                param=f"{where}.content",
            )
    return media.content(parts)


def input_messages(items: Any) -> list[dict]:
    """The chat messages `input` items make (message, function_call and function_call_output items)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise LLMError("'input' must be a string or a non-empty list of items", param="input")
    messages: list[dict] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise LLMError(f"'{where}' must be an object", param=where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise LLMError(f"'{where}.role' must be user, assistant, system or developer", param=where)
            messages.append(
                {
                    "role": "system" if role == "developer" else role,
                    "content": _content_of(item.get("content"), where, role),
                }
            )
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments", "{}")
            call_id = item.get("call_id") or item.get("id")
            if not isinstance(name, str) or not isinstance(arguments, str) or not isinstance(call_id, str):
                raise LLMError(
                    f"'{where}' needs a call_id, a name and arguments (a JSON string)", param=where
                )
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if (
                last is not None
                and last["role"] == "assistant"
                and last.get("tool_calls")
                and not last["content"]
            ):
                last["tool_calls"].append(call)  # the calls of one turn are one assistant message
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str):
                raise LLMError(f"'{where}' needs a call_id and an output (a string)", param=where)
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind == "reasoning":
            continue  # a thinking model's earlier reasoning is not shown to it again (as chat templates drop it)
        else:
            raise LLMError(
                f"'{where}' is an item of type {kind!r}, which this server does not take", param=where
            )
    return messages


def _tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise LLMError("'tools' must be a list", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("name"), str)
        ):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise LLMError(
                f'\'tools[{i}]\' is a tool of type {kind!r}: function tools ({{"type": "function", "name": ...}}) '
                "are supported",
                param="tools",
            )
        function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out or None


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise LLMError(
        "'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}",
        param="tool_choice",
    )


def parse(doc: dict) -> ResponsesRequest:
    """A Responses API request body, validated, as a chat `Generation` (without the previous response's turns)."""
    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise LLMError("'model' is required: the name of a model (GET /v1/models lists them)", param="model")
    messages = input_messages(doc.get("input"))
    instructions = doc.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise LLMError("'instructions' must be a string", param="instructions")
    chat: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "-"}]}
    for key in ("temperature", "top_p", "seed", "stop", "top_k", "min_p", "repetition_penalty"):
        if doc.get(key) is not None:
            chat[key] = doc[key]
    if doc.get("max_output_tokens") is not None:
        chat["max_tokens"] = doc["max_output_tokens"]
    if doc.get("top_logprobs"):
        chat["logprobs"], chat["top_logprobs"] = True, doc["top_logprobs"]
    fmt = (doc.get("text") or {}).get("format") if isinstance(doc.get("text"), dict) else None
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise LLMError(
                '\'text.format\' must be {"type": "text" | "json_object" | "json_schema"}',
                param="text.format",
            )
        if fmt["type"] == "json_schema":
            chat["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": fmt.get("name", "output"), "schema": fmt.get("schema", {})},
            }
        elif fmt["type"] == "json_object":
            chat["response_format"] = {"type": "json_object"}
    tools = _tools(doc.get("tools"))
    if tools:
        chat["tools"] = tools
    choice = _tool_choice(doc.get("tool_choice"))
    if choice is not None and (tools or choice == "none"):
        chat["tool_choice"] = choice
    gen = protocol.chat(chat)  # the same checks as a chat request's
    gen.messages = messages
    kwargs = doc.get("reasoning")
    if isinstance(kwargs, dict) and kwargs.get("effort"):
        gen.chat_template_kwargs["reasoning_effort"] = kwargs["effort"]
    stream = doc.get("stream", False)
    if not isinstance(stream, bool):
        raise LLMError("'stream' must be true or false", param="stream")
    gen.stream = stream
    store = doc.get("store", True)
    background = doc.get("background", False)
    if not isinstance(store, bool) or not isinstance(background, bool):
        raise LLMError("'store' and 'background' must be true or false", param="store")
    if background and not store:
        raise LLMError(
            "'background' needs 'store': a background response is read back from the store",
            param="background",
        )
    previous = doc.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise LLMError("'previous_response_id' must be a string", param="previous_response_id")
    parallel = doc.get("parallel_tool_calls", True)
    items = doc.get("input")
    echo = {
        "instructions": instructions,
        "max_output_tokens": doc.get("max_output_tokens"),
        "metadata": doc.get("metadata") or {},
        "temperature": doc.get("temperature"),
        "top_p": doc.get("top_p"),
        "tools": doc.get("tools") or [],
        "tool_choice": doc.get("tool_choice", "auto"),
        "text": doc.get("text") or {"format": {"type": "text"}},
        "reasoning": doc.get("reasoning") or {"effort": None, "summary": None},
        "user": doc.get("user"),
        "truncation": doc.get("truncation", "disabled"),
    }
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}]}]
    assert isinstance(items, list)  # (input_messages refused anything else)
    return ResponsesRequest(
        gen, echo, store, background, previous, messages, [_with_id(i) for i in items], bool(parallel)
    )


def _with_id(item: dict) -> dict:
    return (
        item
        if "id" in item
        else {"id": _id("msg" if item.get("type", "message") == "message" else "item"), **item}
    )


# ---- the store ----


@dataclass
class Stored:
    response: dict
    conversation: list[dict]  # every message of the conversation up to and including this response's output
    input_items: list[dict]
    size: int = 0
    task: asyncio.Task | None = None  # a background response still running


class ResponseStore:
    """The newest responses, bounded in number and bytes (the oldest are forgotten first)."""

    def __init__(self, max_responses: int = STORE_MAX_RESPONSES, max_bytes: int = STORE_MAX_BYTES):
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def put(self, stored: Stored) -> None:
        old = self.items.pop(stored.response["id"], None)
        if old is not None:
            self.bytes -= old.size
        stored.size = len(orjson.dumps([stored.response, stored.conversation, stored.input_items]))
        self.items[stored.response["id"]] = stored
        self.bytes += stored.size
        while self.items and (len(self.items) > self.max_responses or self.bytes > self.max_bytes):
            _, gone = self.items.popitem(last=False)
            self.bytes -= gone.size

    def get(self, response_id: str) -> Stored:
        stored = self.items.get(response_id)
        if stored is None:
            raise LLMError(f"Response with id '{response_id}' not found.", 404, param="response_id")
        return stored

    def delete(self, response_id: str) -> Stored:
        stored = self.get(response_id)
        del self.items[response_id]
        self.bytes -= stored.size
        return stored


# ---- the response ----


@dataclass
class Output:
    """What a response produced: its items in order, the text of each part as it grows."""

    items: list[dict] = field(default_factory=list)
    reasoning: dict | None = None
    message: dict | None = None

    def text(self) -> str:
        return "".join(p["text"] for p in (self.message or {}).get("content", []))


def _usage(state: ChoiceState, reasoning_text: str | None) -> dict:
    prompt = state.usage.prompt_tokens or 0
    completion = state.usage.completion_tokens or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0 if not reasoning_text else None},
        "total_tokens": prompt + completion,
    }


class ResponsesRoutes:
    def __init__(self, llm: LLMService, body: Body, stall_timeout: float | None):
        self.llm = llm
        self.body = body
        self.stall_timeout = stall_timeout
        self.store = ResponseStore()

    def add_routes(self, router: web.UrlDispatcher, guard: Callable) -> None:
        router.add_post("/v1/responses", guard(self.create))
        router.add_get("/v1/responses/{id}", guard(self.retrieve))
        router.add_delete("/v1/responses/{id}", guard(self.delete))
        router.add_post("/v1/responses/{id}/cancel", guard(self.cancel))
        router.add_get("/v1/responses/{id}/input_items", guard(self.input_items))

    # ---- retrieve, delete, cancel, input items ----
    async def retrieve(self, request: web.Request) -> web.Response:
        return _json(self.store.get(request.match_info["id"]).response)

    async def delete(self, request: web.Request) -> web.Response:
        stored = self.store.delete(request.match_info["id"])
        if stored.task is not None:
            stored.task.cancel()
        return _json({"id": stored.response["id"], "object": "response.deleted", "deleted": True})

    async def cancel(self, request: web.Request) -> web.Response:
        stored = self.store.get(request.match_info["id"])
        if not stored.response.get("background"):
            raise LLMError("Cannot cancel a synchronous response.", param="response_id")
        if stored.task is not None and not stored.task.done():
            stored.task.cancel()
            stored.response["status"] = "cancelled"
        return _json(stored.response)

    async def input_items(self, request: web.Request) -> web.Response:
        items = self.store.get(request.match_info["id"]).input_items
        return _json(
            {
                "object": "list",
                "data": items,
                "first_id": items[0]["id"] if items else None,
                "last_id": items[-1]["id"] if items else None,
                "has_more": False,
            }
        )

    # ---- create ----
    async def create(self, request: web.Request) -> web.StreamResponse:
        req = parse(await self.body(request))
        history: list[dict] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous.response.get("status") in ("queued", "in_progress"):
                raise LLMError(
                    f"Response '{req.previous_response_id}' is still running", param="previous_response_id"
                )
            history = list(previous.conversation)
        system = [{"role": "system", "content": req.echo["instructions"]}] if req.echo["instructions"] else []
        req.gen.messages = system + history + req.new_messages
        prepared = await self.llm.prepare(req.gen, "/v1/responses")
        response = self._response(req, prepared, "in_progress")
        conversation = history + req.new_messages
        if req.background:
            response["status"] = "queued"
            stored = Stored(response, conversation, req.input_items)
            self.store.put(stored)
            stored.task = asyncio.get_running_loop().create_task(
                self._background(request, req, prepared, stored)
            )
            return _json(dict(response))
        if req.gen.stream:
            return await self._stream(request, req, prepared, response, conversation)
        state = (await self.llm.collect(request, prepared, req.gen, response["id"]))[0]
        out = self._finish(
            req,
            prepared,
            response,
            state,
            Shaper(req.gen, prepared.parsers, prepared.prompt).whole(state.text),
        )
        self._keep(req, response, conversation, out)
        return _json(response)

    def _response(self, req: ResponsesRequest, prepared: Prepared, status: str) -> dict:
        return {
            "id": _id("resp"),
            "object": "response",
            "created_at": int(time.time()),
            "status": status,
            "background": req.background,
            "error": None,
            "incomplete_details": None,
            "model": prepared.name,
            "output": [],
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "usage": None,
            **req.echo,
        }

    def _finish(
        self, req: ResponsesRequest, prepared: Prepared, response: dict, state: ChoiceState, shaped
    ) -> Output:
        """A whole response's output items, usage and status."""
        out = Output()
        if shaped.reasoning is not None:
            out.items.append(_reasoning_item(_id("rs"), shaped.reasoning))
        if shaped.content or not shaped.calls:
            out.message = _message_item(_id("msg"), shaped.content, "completed")
            out.items.append(out.message)
        calls = shaped.calls if req.parallel_tool_calls else shaped.calls[:1]
        out.items += [_call_item(c.name, c.arguments, c.id, "completed") for c in calls]
        self._close(req, response, out, state, shaped.reasoning)
        return out

    def _close(
        self,
        req: ResponsesRequest,
        response: dict,
        out: Output,
        state: ChoiceState,
        reasoning_text: str | None,
    ) -> None:
        reason = self.llm.reason(state.reason, req.gen, state.usage)
        response["output"] = out.items
        response["usage"] = _usage(state, reasoning_text)
        if reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            response["status"] = "completed"

    def _keep(self, req: ResponsesRequest, response: dict, conversation: list[dict], out: Output) -> None:
        if not req.store:
            return
        turn: list[dict] = []
        calls = [i for i in out.items if i["type"] == "function_call"]
        text = out.text()
        if text or not calls:
            turn.append({"role": "assistant", "content": text})
        if calls:
            tool_calls = [
                {
                    "id": c["call_id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls
            ]
            if turn:
                turn[-1]["tool_calls"] = tool_calls
            else:
                turn.append({"role": "assistant", "content": None, "tool_calls": tool_calls})
        self.store.put(Stored(response, conversation + turn, req.input_items))

    async def _background(
        self, request: web.Request, req: ResponsesRequest, prepared: Prepared, stored: Stored
    ) -> None:
        response = stored.response
        response["status"] = "in_progress"
        try:
            reqs = self.llm.requests(prepared, req.gen, response["id"])
            state = ChoiceState()
            # no client to lose: its answer was sent already
            async with aclosing(self.llm.run(None, reqs)) as pieces:
                async for _, piece, _ in pieces:
                    if piece is not None:
                        state.add(piece)
            await self.llm.finish_usage(state.usage, prepared, state.text)
            shaped = Shaper(req.gen, prepared.parsers, prepared.prompt).whole(state.text)
            out = self._finish(req, prepared, response, state, shaped)
            self._keep(req, response, stored.conversation, out)
        except asyncio.CancelledError:
            response["status"] = "cancelled"
        except Exception as exc:
            response["status"] = "failed"
            response["error"] = {"code": "server_error", "message": str(exc)}
        finally:
            stored.task = None

    # ---- streaming ----
    async def _stream(
        self,
        request: web.Request,
        req: ResponsesRequest,
        prepared: Prepared,
        response: dict,
        conversation: list[dict],
    ) -> web.StreamResponse:
        events = EventStream(request, self.stall_timeout)
        seq = 0

        async def emit(kind: str, **fields: Any) -> None:
            nonlocal seq
            await events.send({"type": kind, "sequence_number": seq, **fields}, event=kind)
            seq += 1

        shaper = Shaper(req.gen, prepared.parsers, prepared.prompt)
        state = ChoiceState()
        out = Output()

        async def write() -> web.StreamResponse:
            await emit("response.created", response=dict(response))
            await emit("response.in_progress", response=dict(response))
            reqs = self.llm.requests(prepared, req.gen, response["id"])
            async with aclosing(self.llm.run(request, reqs)) as pieces:
                async for _, piece, _ in pieces:
                    if piece is None:
                        continue
                    state.add(piece)
                    thought, text = shaper.feed(piece.text)
                    await self._deltas(emit, out, thought, text)
            thought, text, calls = shaper.finish()
            await self._deltas(emit, out, thought, text)
            await self._close_parts(emit, out)
            if not out.items or (not calls and out.message is None):
                await self._deltas(emit, out, "", "", force_message=True)
                await self._close_parts(emit, out)
            for call in calls if req.parallel_tool_calls else calls[:1]:
                item = _call_item(call.name, "", call.id, "in_progress")
                index = len(out.items)
                out.items.append(item)
                await emit("response.output_item.added", output_index=index, item=dict(item))
                await emit(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=index,
                    delta=call.arguments,
                )
                item["arguments"], item["status"] = call.arguments, "completed"
                await emit(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=call.arguments,
                    name=call.name,
                )
                await emit("response.output_item.done", output_index=index, item=dict(item))
            await self.llm.finish_usage(state.usage, prepared, state.text)
            self._close(req, response, out, state, shaper.thought if shaper.thinking else None)
            self._keep(req, response, conversation, out)
            await emit(
                "response.completed" if response["status"] == "completed" else "response.incomplete",
                response=response,
            )
            return await events.end()

        async def fail(exc: BaseException) -> web.StreamResponse:
            response["status"] = "failed"
            response["error"] = {"code": "server_error", "message": getattr(exc, "message", str(exc))}
            await emit("response.failed", response=response)
            return await events.end()

        return await guard_stream(events, write(), fail, f"response stream {response['id']}")

    async def _deltas(self, emit, out: Output, thought: str, text: str, force_message: bool = False) -> None:
        """Reasoning and message text as events: each item and part opened with its first delta."""
        if thought:
            if out.reasoning is None:
                out.reasoning = _reasoning_item(_id("rs"), "")
                out.items.append(out.reasoning)
                await emit(
                    "response.output_item.added",
                    output_index=len(out.items) - 1,
                    item={**out.reasoning, "content": []},
                )
            index = out.items.index(out.reasoning)
            out.reasoning["content"][0]["text"] += thought
            await emit(
                "response.reasoning_text.delta",
                item_id=out.reasoning["id"],
                output_index=index,
                content_index=0,
                delta=thought,
            )
        if text or force_message:
            if out.reasoning is not None and out.reasoning.get("status") != "completed":
                await self._close_reasoning(emit, out)
            if out.message is None:
                out.message = _message_item(_id("msg"), "", "in_progress")
                out.message["content"] = []
                out.items.append(out.message)
                index = len(out.items) - 1
                await emit(
                    "response.output_item.added", output_index=index, item={**out.message, "content": []}
                )
                part = _text_part("")
                out.message["content"].append(part)
                await emit(
                    "response.content_part.added",
                    item_id=out.message["id"],
                    output_index=index,
                    content_index=0,
                    part=dict(part),
                )
            if text:
                index = out.items.index(out.message)
                out.message["content"][0]["text"] += text
                await emit(
                    "response.output_text.delta",
                    item_id=out.message["id"],
                    output_index=index,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )

    async def _close_reasoning(self, emit, out: Output) -> None:
        assert out.reasoning is not None
        index = out.items.index(out.reasoning)
        text = out.reasoning["content"][0]["text"]
        await emit(
            "response.reasoning_text.done",
            item_id=out.reasoning["id"],
            output_index=index,
            content_index=0,
            text=text,
        )
        out.reasoning["status"] = "completed"
        await emit("response.output_item.done", output_index=index, item=dict(out.reasoning))

    async def _close_parts(self, emit, out: Output) -> None:
        if out.reasoning is not None and out.reasoning.get("status") != "completed":
            await self._close_reasoning(emit, out)
        if out.message is not None and out.message["status"] != "completed":
            index = out.items.index(out.message)
            part = out.message["content"][0]
            await emit(
                "response.output_text.done",
                item_id=out.message["id"],
                output_index=index,
                content_index=0,
                text=part["text"],
                logprobs=[],
            )
            await emit(
                "response.content_part.done",
                item_id=out.message["id"],
                output_index=index,
                content_index=0,
                part=dict(part),
            )
            out.message["status"] = "completed"
            await emit("response.output_item.done", output_index=index, item=dict(out.message))


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)],
    }


def _reasoning_item(item_id: str, text: str) -> dict:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "in_progress" if not text else "completed",
    }


def _call_item(name: str, arguments: str, call_id: str, status: str) -> dict:
    return {
        "id": _id("fc"),
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
