"""The generation service every LLM API's routes share: the model a request names, its prompt rendered (a chat
template, off the event loop when large), bounded and counted against the context, the structured output its
engine must follow, its choices run on the model and read back as `Piece`s, and the usage and finish reason of each.

OpenAI's chat and completions, the Responses API and Anthropic's Messages differ only in how they read a request
into a `Generation` and write what comes back; everything between is here, once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from ...errors import InvalidArgument, NaiadError, NotFound
from ...inference import InferenceRequest, InferenceResponse
from ...llm import images, limits, tokenizing
from ...llm import info as llm_info
from ...serving import Serving
from . import choices, mapping, media, templates
from .errors import LLMError
from .request import Generation
from .shaping import Parsers

log = logging.getLogger("naiad.llm")

DISCONNECT_POLL_S = 0.5  # how often a request waiting on its model looks for a client that went away


class ClientGone(Exception):
    """The client closed its connection while the model was still working."""


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


def total_usage(usages: list[Usage]) -> Usage:
    """A response's usage over its choices: the prompt once, every choice's completion tokens."""
    completion = [u.completion_tokens for u in usages]
    return Usage(
        prompt_tokens=usages[0].prompt_tokens,
        completion_tokens=None if None in completion else sum(c or 0 for c in completion),
    )


@dataclass
class Prepared:
    """A request ready to run: its model, the model's tensor shape, the prompt, its token count (None where the
    tokenizer is not known here) and the parsers its text is shaped by."""

    mv: Any
    kind: str
    prompt: str
    prompt_tokens: int | None
    parsers: Parsers
    # the LoRA adapter the request named as its model (`mv` is then the adapter's base model)
    lora: str | None = None

    @property
    def name(self) -> str:
        """The model a response names: the adapter when the request named one, as vLLM answers."""
        return self.lora or self.mv.name


@dataclass
class ChoiceState:
    """What one choice has gathered from its model responses."""

    texts: list[str] = field(default_factory=list)
    reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    logprobs: list[dict] = field(default_factory=list)

    def add(self, piece: mapping.Piece) -> None:
        self.texts.append(piece.text)
        self.reason = piece.finish_reason or self.reason
        self.logprobs.extend(piece.logprobs)
        if piece.num_input_tokens is not None and self.usage.prompt_tokens is None:
            self.usage.prompt_tokens = piece.num_input_tokens
        if piece.num_output_tokens is not None:
            self.usage.completion_tokens = (self.usage.completion_tokens or 0) + piece.num_output_tokens

    @property
    def text(self) -> str:
        return "".join(self.texts)


def not_found(name: str) -> LLMError:
    return LLMError(f"The model '{name}' does not exist", 404, param="model", code="model_not_found")


class LLMService:
    """The server's LLM models as the LLM routes use them (`server`: the in-process `Server` or a frontend worker's
    engine client); `chat_template`: `--chat-template`'s file, for models that bring none."""

    def __init__(
        self,
        server: Serving,
        chat_template: str | None = None,
        media_settings: media.MediaSettings | None = None,
    ):
        self.server = server
        self.chat_template = templates.from_file(chat_template) if chat_template else None
        self.media = media.MediaLoader(media_settings)
        self._adapter_bases: dict[str, str] = {}  # LoRA adapter -> the model it was last found on

    # ---- models ----
    def model(self, name: str) -> Any:
        """A loaded model, as it is now (no load on demand)."""
        try:
            return self.server.repository.get(name, -1)
        except NotFound:
            raise not_found(name) from None

    async def ready_model(self, name: str) -> Any:
        """The model an inference route runs: with --load-on-demand, loaded first if it is in a repository."""
        try:
            mv, _ = await self.server.ready_model(name)
            return mv
        except NotFound:
            raise not_found(name) from None

    async def resolve(self, name: str) -> tuple[Any, str | None]:
        """The model a generation names, and the LoRA adapter when the name is one's (the model is then the
        adapter's base, as vLLM serves adapters): a model of that name first, then the adapters the models list."""
        try:
            mv, _ = await self.server.ready_model(name)
            return mv, None
        except NotFound:
            pass
        base = self._adapter_bases.get(name)
        if base is not None:
            try:
                base_mv, _ = await self.server.ready_model(base)
            except NotFound:
                base_mv = None
            if base_mv is not None and name in llm_info.lora_adapters(llm_info.of(base_mv.ctx)):
                return base_mv, name
            self._adapter_bases.pop(name, None)
        for mv in self.listed():
            if name in llm_info.lora_adapters(llm_info.of(mv.ctx)):
                self._adapter_bases[name] = mv.name
                return mv, name
        raise not_found(name)

    def adapter_base(self, name: str) -> Any:
        """The loaded model that lists LoRA adapter `name`, or None."""
        for mv in self.listed():
            if name in llm_info.lora_adapters(llm_info.of(mv.ctx)):
                return mv
        return None

    @staticmethod
    def served(mv: Any) -> bool:
        """Whether a model is one the LLM APIs serve (a language model or an embedding model)."""
        return mapping.llm_kind(mv) is not None or mapping.supports_embeddings(mv)

    def listed(self) -> list[Any]:
        """Every served model's latest loaded version, by name."""
        out = []
        records = self.server.repository.records
        for name in sorted(records):
            rec = records[name]
            if rec.versions:
                mv = rec.versions[max(rec.versions)]
                if self.served(mv):
                    out.append(mv)
        return out

    # ---- the prompt ----
    def template(self, mv: Any) -> templates.ChatTemplate | None:
        """The model's chat template (its own, its folder's, or --chat-template's)."""
        return templates.resolve(mv, self.chat_template)

    async def prepare(self, gen: Generation, route: str) -> Prepared:
        """The model and the prompt of a chat (`gen.messages`) or a completion, bounded and counted."""
        mv, lora = await self.resolve(gen.model)
        kind = mapping.require_llm(mv, route)
        template = self.template(mv)
        if gen.messages is not None:
            await self.load_images(mv, gen)
            prompt = await self.render(mv, template, gen)
        else:
            prompt = gen.prompt or ""
        parsers = Parsers.of(mv, template)
        prompt_tokens = await self.prompt_tokens(mv, prompt, gen)
        await self.check_structured_output(mv, kind, gen)
        return Prepared(mv, kind, prompt, prompt_tokens, parsers, lora)

    async def load_images(self, mv: Any, gen: Generation) -> None:
        """The images the messages point to, read into `gen.images` (their count, size and pixels checked): a 400
        for a model that takes none, before any is read."""
        urls = media.image_urls(gen.messages)
        if urls:
            self.image_input(mv, len(urls))
            gen.images = await self.media.load_all(urls, "messages")

    @staticmethod
    def image_input(mv: Any, n_images: int) -> dict:
        """How the model takes images; a 400 when the request has too many or the model takes none."""
        try:
            images.check_count(n_images)
        except InvalidArgument as exc:
            raise LLMError(exc.message, param="messages") from None
        how = mapping.image_input(mv)
        if how is None:
            raise LLMError(
                f"model '{mv.name}' is not multimodal: it takes no images (a llama.cpp model needs its mmproj "
                "file; a transformers model a vision-language model and its processor)",
                param="messages",
            )
        return how

    async def render(self, mv: Any, template: templates.ChatTemplate | None, gen: Generation) -> str:
        """A chat's prompt by the model's template; rendering is Python work as long as the messages, so a large
        chat is rendered off the event loop. Image parts become what the model's template expects (media.py)."""
        if template is None:
            raise LLMError(
                f"model '{mv.name}' has no chat template (none published by its backend, no chat_template in a "
                "tokenizer_config.json beside it, no --chat-template): use /v1/completions, or give one",
                param="messages",
            )
        add_prompt = gen.add_generation_prompt and not gen.continue_final_message
        size = media.text_size(gen.messages)
        published = llm_info.of(mv.ctx)
        if published is not None:
            try:
                # the prompt holds at least the messages' text (a character is a byte or more): refused unrendered
                limits.check_bytes(size, published.prompt_byte_limit, published.context_length)
            except limits.PromptTooLong as exc:
                raise LLMError(exc.message, param="messages", code="context_length_exceeded") from None
        messages = gen.messages or []
        n_images = len(media.image_urls(messages))
        if n_images:
            messages = media.for_template(messages, self.image_input(mv, n_images).get("marker"))
        try:
            prompt = await tokenizing.off_loop(
                templates.render,
                template,
                messages,
                gen.tools,
                add_prompt,
                gen.chat_template_kwargs,
                size=size,
                what="rendering the chat template",
            )
        except tokenizing.TokenizeTimeout as exc:
            raise LLMError(exc.message, param="messages") from None
        if gen.continue_final_message and messages and isinstance(messages[-1].get("content"), str):
            # the prompt stops where the last (assistant) message stops, for the model to go on from there
            last = messages[-1]["content"]
            cut = prompt.rfind(last)
            if cut >= 0:
                prompt = prompt[: cut + len(last)]
        return prompt

    async def prompt_tokens(self, mv: Any, prompt: str, gen: Generation) -> int | None:
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
            raise LLMError(exc.message, param=param, code="context_length_exceeded") from None
        except tokenizing.TokenizeTimeout as exc:
            raise LLMError(exc.message, param=param) from None
        except NaiadError as exc:
            # the engine process's answer in a frontend worker (its deadline, its bound, busy)
            raise LLMError(exc.message, exc.http_status, param=param) from None
        except Exception as exc:  # a tokenizer failing is the engine's to report
            log.debug("tokenize failed for model '%s': %s", mv.name, exc)
            return None
        ctx = published.context_length
        if ctx:
            if n >= ctx:
                raise LLMError(
                    f"This model's maximum context length is {ctx} tokens. However, your prompt has {n} tokens. "
                    "Please reduce the length of the prompt.",
                    param=param,
                    code="context_length_exceeded",
                )
            if gen.max_tokens is not None and n + gen.max_tokens > ctx:
                raise LLMError(
                    f"This model's maximum context length is {ctx} tokens. However, you requested "
                    f"{n + gen.max_tokens} tokens ({n} in the prompt, {gen.max_tokens} for the completion). "
                    "Please reduce the length of the prompt or max_tokens.",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
            if gen.max_tokens is None:
                gen.max_tokens = ctx - n
        return n

    async def count(self, mv: Any, text: str) -> int | None:
        """`text`'s tokens by the model's tokenizer, or None when it is not known here (or fails)."""
        published = llm_info.of(mv.ctx)
        if published is None or published.tokenize is None:
            return None
        try:
            return len(await tokenizing.tokenize(published, text))
        except Exception:
            return None

    @staticmethod
    async def check_structured_output(mv: Any, kind: str, gen: Generation) -> None:
        """A schema or grammar the model's engine cannot follow is a 400 naming the field that asked for it,
        before anything is sent to the model (the engine's check may build a grammar: off the event loop)."""
        structured = mapping.structured_output(mv, kind, gen)
        published = llm_info.of(mv.ctx)
        if structured is None or published is None or published.check_structured_outputs is None:
            return
        try:
            await asyncio.to_thread(published.check_structured_outputs, structured)
        except NaiadError as exc:
            raise LLMError(exc.message, param=mapping.structured_output_param(gen)) from None

    # ---- running it ----
    @staticmethod
    def requests(prepared: Prepared, gen: Generation, request_id: str) -> list[InferenceRequest]:
        """One inference request per choice (`n`)."""
        return [
            mapping.generation_request(
                prepared.mv,
                prepared.kind,
                prepared.prompt,
                g,
                choices.choice_request_id(request_id, i),
                prepared.lora,
            )
            for i, g in enumerate(choices.choice_generations(gen))
        ]

    def run(
        self, request: web.Request | None, reqs: list[InferenceRequest]
    ) -> AsyncGenerator[tuple[int, mapping.Piece | None, InferenceResponse | None], None]:
        """(choice, piece, response) for each model response of each choice, and (choice, None, None) at each
        choice's end; a response's error is raised. `request`: the client's, whose leaving cancels the run (None:
        a run no client waits for)."""
        return self._pieces(request, reqs)

    async def _pieces(
        self, request: web.Request | None, reqs: list[InferenceRequest]
    ) -> AsyncGenerator[tuple[int, mapping.Piece | None, InferenceResponse | None], None]:
        merged = choices.merged(lambda req: self.iterate(request, req), reqs)
        async with aclosing(merged) as responses:
            async for i, resp in responses:
                if resp is None:
                    yield i, None, None
                    continue
                raise_response_error(resp)
                yield i, mapping.read_response(resp), resp

    async def iterate(
        self, request: web.Request | None, req: InferenceRequest
    ) -> AsyncGenerator[InferenceResponse, None]:
        """The model's responses. A timer looks for a client that went away every DISCONNECT_POLL_S and cancels
        the handler if so (nothing is spent per response); closing the stream cancels the model request."""
        if request is None:
            async with aclosing(self.server.infer_stream(req)) as stream:
                async for resp in stream:
                    yield resp
            return
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

    async def collect(
        self, request: web.Request, prepared: Prepared, gen: Generation, request_id: str
    ) -> list[ChoiceState]:
        """A request that does not stream: every choice's text, finish reason, logprobs and usage."""
        states = [ChoiceState() for _ in range(gen.n)]
        async with aclosing(self.run(request, self.requests(prepared, gen, request_id))) as pieces:
            async for i, piece, _ in pieces:
                if piece is not None:
                    states[i].add(piece)
        for state in states:
            await self.finish_usage(state.usage, prepared, state.text)
        return states

    async def finish_usage(self, usage: Usage, prepared: Prepared, text: str) -> None:
        """Token counts the model did not report, counted here."""
        if usage.prompt_tokens is None:
            usage.prompt_tokens = (
                prepared.prompt_tokens
                if prepared.prompt_tokens is not None
                else await self.count(prepared.mv, prepared.prompt)
            )
        if usage.completion_tokens is None:
            usage.completion_tokens = await self.count(prepared.mv, text) if text else 0

    @staticmethod
    def reason(reason: str | None, gen: Generation, usage: Usage) -> str:
        """OpenAI's finish reason of a choice."""
        if reason in ("stop", "length", "tool_calls", "content_filter"):
            return reason
        if (
            gen.max_tokens is not None
            and usage.completion_tokens is not None
            and usage.completion_tokens >= gen.max_tokens
        ):
            return "length"
        return "stop"

    # ---- embeddings ----
    async def embed(
        self, request: web.Request, mv: Any, values: list[Any], dimensions: int | None, request_id: str
    ) -> list[tuple[list[float], int]]:
        """(vector, tokens) for each input, run concurrently."""
        if not mapping.supports_embeddings(mv):
            raise LLMError(
                f"model '{mv.name}' does not serve embeddings: it needs an 'embedding_request' input (the vLLM "
                "shape)",
                param="model",
            )

        async def one(value: Any) -> tuple[list[float], int]:
            req = mapping.embedding_request(mv, value, dimensions, request_id)
            result = None
            async with aclosing(self.iterate(request, req)) as responses:
                async for resp in responses:
                    raise_response_error(resp)
                    if resp.outputs:
                        result = resp
            if result is None:
                raise LLMError(f"model '{mv.name}' returned no embedding", 500)
            vector, tokens = mapping.embedding_values(result)
            if tokens is None:
                counted = await self.count(mv, value) if isinstance(value, str) else len(value)
                tokens = counted or 0
            return vector, tokens

        return list(await asyncio.gather(*(one(v) for v in values)))


def raise_response_error(resp: InferenceResponse) -> None:
    if resp.error is not None:
        raise (
            resp.error if isinstance(resp.error, (NaiadError, LLMError)) else LLMError(str(resp.error), 500)
        )
