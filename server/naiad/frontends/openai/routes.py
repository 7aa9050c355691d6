"""The `/v1` routes: OpenAI requests in, inference requests to `Server`, OpenAI responses and event streams out.
Served on the HTTP port's aiohttp app, and on a port of its own with `--openai-port`."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from ...errors import NaiadError, NotFound
from ...inference import InferenceRequest, InferenceResponse
from ...llm import info as llm_info
from ...llm import limits, tokenizing
from ...serving import Serving
from ..http.aiohttp_site import start_tcp_site
from ..http.codec import read_body, restricted_message
from ..http.sse import EventStream, StreamStalled
from ..transport import drain
from . import choices, mapping, protocol, templates
from .errors import OpenAIError, error_object
from .protocol import Generation
from .responses import (
    Builder,
    Usage,
    chat_logprobs,
    completion_logprobs,
    embedding_list,
    model_card,
    parse_tool_calls,
)

log = logging.getLogger("naiad.openai")

API_GROUP = (
    "openai"  # the restricted-API group of every /v1 route (--http-restricted-api openai:<header>=<value>)
)
DISCONNECT_POLL_S = 0.5  # how often a request waiting on its model looks for a client that went away
DEFAULT_STALL_TIMEOUT_S = 60.0


@dataclass
class _Choice:
    """What one choice of a response has gathered from its model responses."""

    texts: list[str] = field(default_factory=list)
    reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    logprobs: list[dict] = field(default_factory=list)
    held: list[str] | None = None  # streamed text held back while it may be a tool call
    offset: int = 0  # characters streamed so far (completion logprobs' text_offset)


def _total_usage(states: list[_Choice]) -> Usage:
    """The response's usage: the prompt once, the completion tokens of every choice."""
    completion = [s.usage.completion_tokens for s in states]
    return Usage(
        prompt_tokens=states[0].usage.prompt_tokens,
        completion_tokens=None if None in completion else sum(c or 0 for c in completion),
    )


class ClientGone(Exception):
    """The client closed its connection while the model was still working."""


def error_response(exc: BaseException) -> web.Response:
    status, body = error_object(exc)
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _json(data: dict) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


def _raise_response_error(resp: InferenceResponse) -> None:
    if resp.error is not None:
        raise (
            resp.error
            if isinstance(resp.error, (NaiadError, OpenAIError))
            else OpenAIError(str(resp.error), 500)
        )


class OpenAIFrontend:
    def __init__(
        self,
        server: Serving,
        chat_template: str | None = None,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
        max_input_size: int = 64 * 1024 * 1024,
    ):
        self.server = server
        self.chat_template = templates.from_file(chat_template) if chat_template else None
        self.stall_timeout = stall_timeout
        self.max_input_size = max_input_size
        self._created: dict[tuple[str, int], int] = {}

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/models", self.guard(self.list_models))
        router.add_get("/v1/models/{model:.+}", self.guard(self.get_model))
        router.add_post("/v1/chat/completions", self.guard(self.chat_completions))
        router.add_post("/v1/completions", self.guard(self.completions))
        router.add_post("/v1/embeddings", self.guard(self.embeddings))

    @staticmethod
    def http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
        """An HTTP error aiohttp raised for a /v1 request (no such route, a method it does not take) as OpenAI's
        error object: for this frontend's own app and for the HTTP port's (http.frontend.HttpFrontend)."""
        return error_response(OpenAIError(f"{exc.reason}: {request.method} {request.path}", exc.status))

    @staticmethod
    def restricted(key: str) -> web.Response:
        """The refusal of a /v1 request without the restricted API's header `key`, as OpenAI's error object."""
        return restricted_response(key)

    @staticmethod
    def guard(handler):
        """Every error a handler meets answered as OpenAI's error object."""

        async def run(request: web.Request):
            try:
                return await handler(request)
            except (OpenAIError, NaiadError) as exc:
                return error_response(exc)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                return error_response(OpenAIError(exc.reason or "error", exc.status))
            except (ClientGone, StreamStalled, ConnectionResetError):
                return web.Response(status=499)  # nobody is left to read it
            except Exception as exc:
                log.exception("unhandled error on %s %s", request.method, request.path)
                return error_response(OpenAIError(f"internal error: {type(exc).__name__}: {exc}", 500))

        return run

    # ---- models ----
    def _model(self, name: str):
        try:
            return self.server.repository.get(name, -1)
        except NotFound:
            raise OpenAIError(
                f"The model '{name}' does not exist", 404, param="model", code="model_not_found"
            ) from None

    async def _ready_model(self, name: str):
        """The model an inference route runs: with --load-on-demand, loaded first if it is in a repository."""
        try:
            mv, _ = await self.server.ready_model(name)
            return mv
        except NotFound:
            raise OpenAIError(
                f"The model '{name}' does not exist", 404, param="model", code="model_not_found"
            ) from None

    def _card(self, mv) -> dict:
        created = self._created.setdefault((mv.name, mv.version), int(time.time()))
        return model_card(mv.name, created)

    def _served(self, mv) -> bool:
        return mapping.llm_kind(mv) is not None or mapping.supports_embeddings(mv)

    async def list_models(self, request: web.Request) -> web.Response:
        cards = []
        for name in sorted(self.server.repository.records):
            rec = self.server.repository.records[name]
            if rec.versions:
                mv = rec.versions[max(rec.versions)]
                if self._served(mv):
                    cards.append(self._card(mv))
        return _json({"object": "list", "data": cards})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        mv = self._model(name)
        if not self._served(mv):
            raise OpenAIError(
                f"The model '{name}' does not exist", 404, param="model", code="model_not_found"
            )
        return _json(self._card(mv))

    # ---- shared ----
    async def _body(self, request: web.Request) -> dict:
        return protocol.parse_body(await read_body(request, self.max_input_size))

    async def _iterate(
        self, request: web.Request, req: InferenceRequest
    ) -> AsyncGenerator[InferenceResponse, None]:
        """The model's responses. A timer looks for a client that went away every DISCONNECT_POLL_S and cancels
        the handler if so (nothing is spent per response); closing the stream cancels the model request."""
        loop = asyncio.get_running_loop()
        handler = asyncio.current_task()
        gone = False
        handle: asyncio.TimerHandle | None = None

        def check() -> None:
            nonlocal gone, handle
            transport = request.transport
            if transport is None or transport.is_closing():
                gone = True
                if handler is not None:
                    handler.cancel()
            else:
                handle = loop.call_later(DISCONNECT_POLL_S, check)

        handle = loop.call_later(DISCONNECT_POLL_S, check)
        stream = self.server.infer_stream(req)
        try:
            async for resp in stream:
                yield resp
        except asyncio.CancelledError:
            if gone:
                raise ClientGone() from None
            raise
        finally:
            handle.cancel()
            await stream.aclose()  # the generator's own finally marks the request cancelled

    async def _prompt_tokens(self, mv, prompt: str, gen: Generation) -> int | None:
        """The prompt's token count when the model's tokenizer is known here, checked against its context (and
        max_tokens filled in to what the context leaves, as vLLM does). A prompt too large for the context in bytes
        is refused untokenized; a large one is tokenized off the event loop (llm/tokenizing.py)."""
        published = llm_info.of(mv.ctx)
        if published is None:
            return None
        param = "messages" if gen.messages is not None else "prompt"
        try:
            limits.check_prompt(prompt, published.prompt_byte_limit, published.context_length)
            if published.tokenize is None:
                return None
            n = len(await tokenizing.tokenize(published, prompt))
        except limits.PromptTooLong as exc:
            raise OpenAIError(exc.message, param=param, code="context_length_exceeded") from None
        except tokenizing.TokenizeTimeout as exc:
            raise OpenAIError(exc.message, param=param) from None
        except NaiadError:
            raise
        except Exception as exc:  # a tokenizer failing is the engine's to report
            log.debug("tokenize failed for model '%s': %s", mv.name, exc)
            return None
        ctx = published.context_length
        if ctx:
            if n >= ctx:
                raise OpenAIError(
                    f"This model's maximum context length is {ctx} tokens. However, your prompt has {n} tokens. "
                    "Please reduce the length of the prompt.",
                    param=param,
                    code="context_length_exceeded",
                )
            if gen.max_tokens is not None and n + gen.max_tokens > ctx:
                raise OpenAIError(
                    f"This model's maximum context length is {ctx} tokens. However, you requested "
                    f"{n + gen.max_tokens} tokens ({n} in the prompt, {gen.max_tokens} for the completion). "
                    "Please reduce the length of the prompt or max_tokens.",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            if gen.max_tokens is None:
                gen.max_tokens = ctx - n
        return n

    async def _count(self, mv, text: str) -> int | None:
        published = llm_info.of(mv.ctx)
        if published is None or published.tokenize is None:
            return None
        try:
            return len(await tokenizing.tokenize(published, text))
        except Exception:
            return None

    async def _prepare(self, gen: Generation, chat: bool):
        mv = await self._ready_model(gen.model)
        kind = mapping.require_llm(mv, "/v1/chat/completions" if chat else "/v1/completions")
        if chat:
            template = templates.resolve(mv, self.chat_template)
            if template is None:
                raise OpenAIError(
                    f"model '{mv.name}' has no chat template (none published by its backend, no chat_template in a "
                    "tokenizer_config.json beside it, no --chat-template): use /v1/completions, or give one",
                    param="messages",
                )
            add_prompt = gen.add_generation_prompt and not gen.continue_final_message
            # rendering is Python work as long as the messages: a large chat is rendered off the loop
            size = sum(len(m.get("content") or "") for m in gen.messages or [])
            try:
                prompt = await tokenizing.off_loop(
                    templates.render,
                    template,
                    gen.messages or [],
                    gen.tools,
                    add_prompt,
                    gen.chat_template_kwargs,
                    size=size,
                    what="rendering the chat template",
                )
            except tokenizing.TokenizeTimeout as exc:
                raise OpenAIError(exc.message, param="messages") from None
            if gen.continue_final_message and gen.messages and gen.messages[-1].get("content"):
                # the prompt stops where the last (assistant) message stops, for the model to go on from there
                last = gen.messages[-1]["content"]
                cut = prompt.rfind(last)
                if cut >= 0:
                    prompt = prompt[: cut + len(last)]
        else:
            prompt = gen.prompt or ""
        return mv, kind, prompt

    # ---- chat and completions ----
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.chat(await self._body(request)), chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.completion(await self._body(request)), chat=False)

    async def _generate(self, request: web.Request, gen: Generation, chat: bool) -> web.StreamResponse:
        mv, kind, prompt = await self._prepare(gen, chat)
        prompt_tokens = await self._prompt_tokens(mv, prompt, gen)
        builder = Builder(chat, mv.name, gen)
        await self._check_structured_output(mv, kind, gen)
        reqs = [
            mapping.generation_request(mv, kind, prompt, g, choices.choice_request_id(builder.id, i))
            for i, g in enumerate(choices.choice_generations(gen))
        ]
        if gen.stream:
            return await self._stream(request, reqs, mv, gen, builder, prompt, prompt_tokens)
        states = [_Choice() for _ in reqs]
        async with aclosing(self._responses(request, reqs)) as responses:
            async for i, resp in responses:
                if resp is None:
                    continue
                _raise_response_error(resp)
                piece = mapping.read_response(resp)
                state = states[i]
                state.texts.append(piece.text)
                state.reason = piece.finish_reason or state.reason
                state.logprobs.extend(piece.logprobs)
                self._add_usage(state.usage, piece)
        outcomes: list[tuple[str, str, dict | None]] = []
        for state in states:
            text = "".join(state.texts)
            await self._finish_usage(state.usage, mv, prompt, text, prompt_tokens)
            lp = None
            if gen.logprobs is not None:
                lp = (
                    chat_logprobs(state.logprobs, gen.logprobs)
                    if chat
                    else completion_logprobs(state.logprobs, gen.logprobs)
                )
            reason = self._reason(state.reason, gen, state.usage)
            outcomes.append((prompt + text if gen.echo else text, reason, lp))
        return _json(builder.whole(outcomes, _total_usage(states)))

    def _responses(
        self, request: web.Request, reqs: list[InferenceRequest]
    ) -> AsyncGenerator[tuple[int, InferenceResponse | None], None]:
        """(choice, response) from the model for each of the request's choices; (choice, None) at each one's end."""
        return choices.merged(lambda req: self._iterate(request, req), reqs)

    @staticmethod
    async def _check_structured_output(mv, kind: str, gen: Generation) -> None:
        """A schema or grammar the model's engine cannot follow is a 400 naming the field that asked for it,
        before anything is sent to the model (the engine's check may build a grammar: off the event loop)."""
        structured = mapping.structured_output(mv, kind, gen)
        published = llm_info.of(mv.ctx)
        if structured is None or published is None or published.check_structured_outputs is None:
            return
        try:
            await asyncio.to_thread(published.check_structured_outputs, structured)
        except NaiadError as exc:
            raise OpenAIError(exc.message, param=mapping.structured_output_param(gen)) from None

    @staticmethod
    def _add_usage(usage: Usage, piece: mapping.Piece) -> None:
        if piece.num_input_tokens is not None and usage.prompt_tokens is None:
            usage.prompt_tokens = piece.num_input_tokens
        if piece.num_output_tokens is not None:
            usage.completion_tokens = (usage.completion_tokens or 0) + piece.num_output_tokens

    async def _finish_usage(
        self, usage: Usage, mv, prompt: str, text: str, prompt_tokens: int | None
    ) -> None:
        if usage.prompt_tokens is None:
            usage.prompt_tokens = (
                prompt_tokens if prompt_tokens is not None else await self._count(mv, prompt)
            )
        if usage.completion_tokens is None:
            usage.completion_tokens = await self._count(mv, text) if text else 0

    @staticmethod
    def _reason(reason: str | None, gen: Generation, usage: Usage) -> str:
        if reason in ("stop", "length", "tool_calls", "content_filter"):
            return reason
        if (
            gen.max_tokens is not None
            and usage.completion_tokens is not None
            and usage.completion_tokens >= gen.max_tokens
        ):
            return "length"
        return "stop"

    async def _stream(
        self,
        request: web.Request,
        reqs: list[InferenceRequest],
        mv,
        gen: Generation,
        builder: Builder,
        prompt: str,
        prompt_tokens: int | None,
    ) -> web.StreamResponse:
        events = EventStream(request, self.stall_timeout)
        chat = builder.chat
        # with tools, text that may be a tool call is held back until it is known whether it is one
        tools = bool(chat and gen.tools and gen.tool_choice != "none")
        states = [_Choice(held=[] if tools else None, offset=len(prompt) if gen.echo else 0) for _ in reqs]
        try:
            async with aclosing(self._responses(request, reqs)) as responses:
                async for i, resp in responses:
                    state = states[i]
                    if resp is None:
                        await self._open(events, builder, prompt, len(states))
                        await self._close_choice(events, builder, mv, prompt, prompt_tokens, state, i)
                        continue
                    _raise_response_error(resp)  # before the stream starts: an HTTP error of its own
                    piece = mapping.read_response(resp)
                    state.reason = piece.finish_reason or state.reason
                    self._add_usage(state.usage, piece)
                    state.texts.append(piece.text)
                    await self._open(events, builder, prompt, len(states))
                    if state.held is not None:
                        state.held.append(piece.text)
                        start = "".join(state.held).lstrip()
                        if not start or start[0] in "{[<":
                            continue
                        piece.text, state.held = "".join(state.held), None
                    if not piece.text and not piece.logprobs:
                        continue
                    lp = None
                    if gen.logprobs is not None and piece.logprobs:
                        lp = (
                            chat_logprobs(piece.logprobs, gen.logprobs)
                            if chat
                            else completion_logprobs(piece.logprobs, gen.logprobs, state.offset)
                        )
                    state.offset += len(piece.text)
                    chunk = builder.chunk(piece.text, logprobs=lp, index=i)
                    if resp.more_ready:  # this choice's next response is waiting: one write for both
                        events.hold(chunk)
                    else:
                        await events.send(chunk)
            await self._open(events, builder, prompt, len(states))
            if gen.include_usage:
                await events.send(builder.usage_chunk(_total_usage(states)))
            return await events.done()
        except (ClientGone, StreamStalled, ConnectionResetError):
            log.debug("stream %s ended early: the client went away or stopped reading", builder.id)
            return events.response
        except asyncio.CancelledError:
            if not events.gone():  # cancelled for another reason than the client's leaving (the server stops)
                raise
            log.debug("stream %s ended early: the client went away", builder.id)
            return events.response
        except Exception as exc:
            if not events.started:
                raise
            if not isinstance(exc, (OpenAIError, NaiadError)):
                log.exception("error in stream %s", builder.id)
            try:
                await events.send(error_object(exc)[1])
                return await events.done()
            except (StreamStalled, ConnectionResetError):
                return events.response

    @staticmethod
    async def _open(events: EventStream, builder: Builder, prompt: str, n: int) -> None:
        """Start the stream once: each choice's first chunk (the assistant role, or the echoed prompt)."""
        if events.started:
            return
        await events.start()
        for i in range(n):
            if builder.chat:  # the role chunks go out with the first token, in one write
                events.hold(builder.chunk("", role=True, index=i))
            elif builder.gen.echo:
                await events.send(builder.chunk(prompt, index=i))

    async def _close_choice(
        self,
        events: EventStream,
        builder: Builder,
        mv,
        prompt: str,
        prompt_tokens: int | None,
        state: _Choice,
        index: int,
    ) -> None:
        """A choice's model responses ended: its held-back text or tool calls, then its finish reason."""
        gen = builder.gen
        await self._finish_usage(state.usage, mv, prompt, "".join(state.texts), prompt_tokens)
        final_reason = self._reason(state.reason, gen, state.usage)
        if state.held is not None:
            held = "".join(state.held)
            calls = parse_tool_calls(held, gen)
            if calls:
                await events.send(builder.tool_call_chunk(calls, index=index))
                final_reason = "tool_calls"
            elif held:
                await events.send(builder.chunk(held, index=index))
        await events.send(
            builder.chunk(None if builder.chat else "", finish_reason=final_reason, index=index)
        )

    # ---- embeddings ----
    async def embeddings(self, request: web.Request) -> web.Response:
        emb = protocol.embedding(await self._body(request))
        mv = await self._ready_model(emb.model)
        if not mapping.supports_embeddings(mv):
            raise OpenAIError(
                f"model '{mv.name}' does not serve embeddings: /v1/embeddings needs a model with an "
                "'embedding_request' input (the vLLM shape)",
                param="model",
            )

        request_id = f"embd-{id(request):x}"

        async def one(value) -> tuple[list[float], int]:
            req = mapping.embedding_request(mv, value, emb.dimensions, request_id)
            result = None
            async with aclosing(self._iterate(request, req)) as responses:
                async for resp in responses:
                    _raise_response_error(resp)
                    if resp.outputs:
                        result = resp
            if result is None:
                raise OpenAIError(f"model '{mv.name}' returned no embedding", 500)
            vector, tokens = mapping.embedding_values(result)
            if tokens is None:
                counted = await self._count(mv, value) if isinstance(value, str) else len(value)
                tokens = counted or 0
            return vector, tokens

        results = await asyncio.gather(*(one(v) for v in emb.inputs))
        return _json(
            embedding_list(mv.name, [r[0] for r in results], emb.encoding_format, sum(r[1] for r in results))
        )

    # ---- a port of its own ----
    def restrict_middleware(self, restricted: dict):
        rule = restricted.get(API_GROUP)

        @web.middleware
        async def restrict(request: web.Request, handler):
            if rule is not None:
                key, value = rule
                given = request.headers.get(key)
                if given is None or not hmac.compare_digest(
                    given.encode("utf-8", "surrogateescape"), value.encode("utf-8", "surrogateescape")
                ):
                    return restricted_response(key)
            return await handler(request)

        return restrict

    def application(self, restricted: dict | None = None) -> web.Application:
        """The app of `--openai-port`: the /v1 routes alone, OpenAI errors for anything else."""

        @web.middleware
        async def not_found(request: web.Request, handler):
            try:
                return await handler(request)
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                return self.http_error(request, exc)

        app = web.Application(
            client_max_size=self.max_input_size,
            middlewares=[not_found, self.restrict_middleware(restricted or {})],
        )
        self.add_routes(app.router)
        return app

    async def start(
        self,
        host: str,
        port: int,
        ssl=None,
        restricted: dict | None = None,
        reuse_port: bool = False,
        listen: bool = True,
    ) -> web.AppRunner:
        """Serve `application` on host:port; `reuse_port`: SO_REUSEPORT, so every frontend worker listens.
        `listen=False`: bind nothing; connections accepted elsewhere are served by the runner's `server`."""
        app = self.application(restricted)
        drain.install(app)  # on SIGTERM, answers close their keep-alive connections
        runner = web.AppRunner(app, access_log=None, handle_signals=False, auto_decompress=False)
        await runner.setup()
        if not listen:
            return runner
        try:
            await start_tcp_site(runner, host, port, ssl, reuse_port)
        except BaseException:
            await runner.cleanup()
            raise
        return runner


def restricted_response(key: str) -> web.Response:
    return error_response(OpenAIError(restricted_message(key), 403))
