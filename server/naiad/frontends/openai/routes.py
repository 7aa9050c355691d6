"""The `/v1` routes: OpenAI requests in, inference requests to the server, OpenAI responses and event streams out.
Served on the HTTP port's aiohttp app, and on a port of its own with `--openai-port`."""

from __future__ import annotations

import hmac
import logging
import time
from contextlib import aclosing

import orjson
from aiohttp import web

from ...serving import Serving
from ..anthropic.routes import MessagesRoutes
from ..http.aiohttp_site import start_tcp_site
from ..http.codec import read_body, restricted_message
from ..http.sse import EventStream
from ..llm.errors import LLMError
from ..llm.guard import guard as llm_guard
from ..llm.guard import guard_stream
from ..llm.media import MediaSettings
from ..llm.request import Generation
from ..llm.service import ChoiceState, LLMService, Prepared, total_usage
from ..llm.shaping import Shaper
from ..transport import drain
from . import protocol
from .errors import error_object
from .extras import ExtraRoutes
from .lora import LoraRoutes, adapter_cards
from .objects import Builder, chat_logprobs, completion_logprobs, embedding_list, model_card
from .responses import ResponsesRoutes

log = logging.getLogger("naiad.openai")

API_GROUP = (
    "openai"  # the restricted-API group of every /v1 route (--http-restricted-api openai:<header>=<value>)
)
DEFAULT_STALL_TIMEOUT_S = 60.0


def error_response(exc: BaseException) -> web.Response:
    status, body = error_object(exc)
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


def _json(data: dict) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


def guard(handler):
    """`handler` with its errors answered as OpenAI's error object."""
    return llm_guard(handler, error_response)


class OpenAIFrontend:
    """The LLM APIs' routes: OpenAI's (/v1/models, chat completions, completions, embeddings, the Responses API),
    vLLM's extras (/tokenize, /detokenize, /v1/score, /v1/rerank) and Anthropic's Messages (/v1/messages), all on
    one `LLMService`; served on the HTTP port's app and on `--openai-port`'s."""

    def __init__(
        self,
        server: Serving,
        chat_template: str | None = None,
        stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
        max_input_size: int = 64 * 1024 * 1024,
        allow_runtime_lora: bool = False,
        media_settings: MediaSettings | None = None,
    ):
        self.server = server
        self.llm = LLMService(server, chat_template, media_settings)
        self.stall_timeout = stall_timeout
        self.max_input_size = max_input_size
        self._created: dict[tuple[str, int], int] = {}
        self._lora_created: dict[tuple[str, str], int] = {}
        self.responses = ResponsesRoutes(self.llm, self.body, stall_timeout)
        self.messages = MessagesRoutes(self.llm, self.max_input_size, stall_timeout)
        self.extras = ExtraRoutes(self.llm, self.body)
        self.lora = LoraRoutes(self.llm, self.body, allow_runtime_lora)

    def add_routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/v1/models", guard(self.list_models))
        router.add_get("/v1/models/{model:.+}", guard(self.get_model))
        router.add_post("/v1/chat/completions", guard(self.chat_completions))
        router.add_post("/v1/completions", guard(self.completions))
        router.add_post("/v1/embeddings", guard(self.embeddings))
        self.responses.add_routes(router, guard)
        self.extras.add_routes(router, guard)
        self.lora.add_routes(router, guard)
        self.messages.add_routes(router)

    def http_error(self, request: web.Request, exc: web.HTTPException) -> web.Response:
        """An HTTP error aiohttp raised for an LLM API's request (no such route, a method it does not take) in that
        API's error object: for this frontend's own app and for the HTTP port's (http.frontend.HttpFrontend)."""
        error = LLMError(f"{exc.reason}: {request.method} {request.path}", exc.status)
        if self.messages.owns(request.path):
            return self.messages.error_response(error)
        return error_response(error)

    def restricted(self, key: str) -> web.Response:
        """The refusal of a request without the restricted API's header `key`, as OpenAI's error object."""
        return restricted_response(key)

    # ---- models ----
    def _card(self, mv) -> dict:
        created = self._created.setdefault((mv.name, mv.version), int(time.time()))
        return model_card(mv.name, created)

    def _adapter_card(self, name: str, path: str | None, parent: str | None) -> dict:
        """A LoRA adapter's card, as vLLM lists one: `root` its file, `parent` its base model."""
        created = self._lora_created.setdefault((name, path or ""), int(time.time()))
        return model_card(name, created, root=path, parent=parent)

    async def list_models(self, request: web.Request) -> web.Response:
        cards = []
        for mv in self.llm.listed():
            cards.append(self._card(mv))
            cards.extend(adapter_cards(mv, self._adapter_card))
        return _json({"object": "list", "data": cards})

    async def get_model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        try:
            mv = self.llm.model(name)
        except LLMError:
            base = self.llm.adapter_base(name)
            card = (
                next((c for c in adapter_cards(base, self._adapter_card) if c["id"] == name), None)
                if base
                else None
            )
            if card is None:
                raise
            return _json(card)
        if not self.llm.served(mv):
            raise LLMError(f"The model '{name}' does not exist", 404, param="model", code="model_not_found")
        return _json(self._card(mv))

    # ---- shared ----
    async def body(self, request: web.Request) -> dict:
        return protocol.parse_body(await read_body(request, self.max_input_size))

    # ---- chat and completions ----
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.chat(await self.body(request)), chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, protocol.completion(await self.body(request)), chat=False)

    async def _generate(self, request: web.Request, gen: Generation, chat: bool) -> web.StreamResponse:
        prepared = await self.llm.prepare(gen, "/v1/chat/completions" if chat else "/v1/completions")
        builder = Builder(chat, prepared.name, gen)
        builder.reasoning = chat and prepared.parsers.reasoning is not None
        if gen.stream:
            return await self._stream(request, prepared, gen, builder)
        states = await self.llm.collect(request, prepared, gen, builder.id)
        outcomes = []
        for state in states:
            shaped = Shaper(gen, prepared.parsers, prepared.prompt, chat).whole(state.text)
            if gen.echo:
                shaped.content = prepared.prompt + shaped.content
            lp = None
            if gen.logprobs is not None:
                lp = (
                    chat_logprobs(state.logprobs, gen.logprobs)
                    if chat
                    else completion_logprobs(state.logprobs, gen.logprobs)
                )
            outcomes.append((shaped, self.llm.reason(state.reason, gen, state.usage), lp))
        return _json(builder.whole(outcomes, total_usage([s.usage for s in states])))

    async def _stream(
        self, request: web.Request, prepared: Prepared, gen: Generation, builder: Builder
    ) -> web.StreamResponse:
        events = EventStream(request, self.stall_timeout)
        chat = builder.chat
        prompt = prepared.prompt
        states = [ChoiceState() for _ in range(gen.n)]
        shapers = [Shaper(gen, prepared.parsers, prompt, chat) for _ in states]
        offsets = [len(prompt) if gen.echo else 0 for _ in states]  # completion logprobs' text_offset
        reqs = self.llm.requests(prepared, gen, builder.id)

        async def write() -> web.StreamResponse:
            async with aclosing(self.llm.run(request, reqs)) as pieces:
                async for i, piece, resp in pieces:
                    state = states[i]
                    await self._open(events, builder, prompt, len(states))
                    if piece is None:
                        await self._close_choice(events, builder, prepared, state, shapers[i], i)
                        continue
                    state.add(piece)
                    thought, text = shapers[i].feed(piece.text)
                    if not text and not thought and not piece.logprobs:
                        continue
                    lp = None
                    if gen.logprobs is not None and piece.logprobs:
                        lp = (
                            chat_logprobs(piece.logprobs, gen.logprobs)
                            if chat
                            else completion_logprobs(piece.logprobs, gen.logprobs, offsets[i])
                        )
                    offsets[i] += len(text)
                    chunk = builder.chunk(
                        text if (text or not thought) else None, logprobs=lp, index=i, reasoning=thought
                    )
                    if (
                        resp is not None and resp.more_ready
                    ):  # this choice's next response is waiting: one write
                        events.hold(chunk)
                    else:
                        await events.send(chunk)
            await self._open(events, builder, prompt, len(states))
            if gen.include_usage:
                await events.send(builder.usage_chunk(total_usage([s.usage for s in states])))
            return await events.done()

        async def fail(exc: BaseException) -> web.StreamResponse:
            await events.send(error_object(exc)[1])
            return await events.done()

        return await guard_stream(events, write(), fail, f"stream {builder.id}")

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
        prepared: Prepared,
        state: ChoiceState,
        shaper: Shaper,
        index: int,
    ) -> None:
        """A choice's model responses ended: its held-back text or tool calls, then its finish reason."""
        gen = builder.gen
        await self.llm.finish_usage(state.usage, prepared, state.text)
        final_reason = self.llm.reason(state.reason, gen, state.usage)
        thought, text, calls = shaper.finish()
        if thought or text:
            await events.send(builder.chunk(text or None, index=index, reasoning=thought))
        if calls:
            await events.send(builder.tool_call_chunk(calls, index=index))
            final_reason = "tool_calls"
        await events.send(
            builder.chunk(None if builder.chat else "", finish_reason=final_reason, index=index)
        )

    # ---- embeddings ----
    async def embeddings(self, request: web.Request) -> web.Response:
        emb = protocol.embedding(await self.body(request))
        mv = await self.llm.ready_model(emb.model)
        results = await self.llm.embed(request, mv, emb.inputs, emb.dimensions, f"embd-{id(request):x}")
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
    return error_response(LLMError(restricted_message(key), 403))
