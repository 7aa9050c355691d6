"""vLLM's routes beside OpenAI's: `/tokenize` and `/detokenize` (a prompt or a chat's messages as the model's token
ids, and back), and `/v1/score` and `/v1/rerank` (Jina's and Cohere's shape) on embedding models, scoring by the
cosine similarity of the texts' embeddings."""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from ...llm import info as llm_info
from ...llm import limits, tokenizing
from ..llm.errors import LLMError
from ..llm.service import LLMService
from . import protocol

Body = Callable[[web.Request], Awaitable[dict]]
MAX_DOCUMENTS = 1024  # texts one score or rerank request may compare


def _json(data: dict) -> web.Response:
    return web.Response(body=orjson.dumps(data), content_type="application/json")


def _flag(doc: dict, key: str, default: bool) -> bool:
    value = doc.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise LLMError(f"'{key}' must be true or false", param=key)
    return value


class ExtraRoutes:
    def __init__(self, llm: LLMService, body: Body):
        self.llm = llm
        self.body = body

    def add_routes(self, router: web.UrlDispatcher, guard: Callable) -> None:
        router.add_post("/tokenize", guard(self.tokenize))
        router.add_post("/detokenize", guard(self.detokenize))
        for path in ("/v1/score", "/score"):
            router.add_post(path, guard(self.score))
        for path in ("/v1/rerank", "/rerank"):
            router.add_post(path, guard(self.rerank))

    async def _tokenizer(self, doc: dict) -> tuple[Any, llm_info.LLMInfo]:
        name = doc.get("model")
        if not isinstance(name, str) or not name:
            raise LLMError(
                "'model' is required: the name of a model (GET /v1/models lists them)", param="model"
            )
        mv, _ = await self.llm.resolve(name)  # (an adapter tokenizes as its base model)
        published = llm_info.of(mv.ctx)
        if published is None or published.tokenize is None:
            raise LLMError(f"model '{mv.name}' publishes no tokenizer", param="model")
        return mv, published

    # ---- tokenize ----
    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's /tokenize: `prompt` (special tokens added unless `add_special_tokens` is false) or `messages`
        rendered by the chat template (none added unless asked: the template writes them)."""
        doc = await self.body(request)
        mv, published = await self._tokenizer(doc)
        if doc.get("messages") is not None:
            gen = protocol.chat(doc)
            prompt = await self.llm.render(mv, self.llm.template(mv), gen)
            add_special = _flag(doc, "add_special_tokens", False)
        else:
            given = doc.get("prompt", doc.get("content"))  # (llama-server's name for it)
            if not isinstance(given, str):
                raise LLMError("'prompt' (a string) or 'messages' is required", param="prompt")
            prompt, add_special = given, _flag(doc, "add_special_tokens", True)
        try:
            ids = await tokenizing.tokenize(published, prompt, add_special)
        except limits.PromptTooLong as exc:
            raise LLMError(exc.message, param="prompt", code="context_length_exceeded") from None
        strs = None
        if _flag(doc, "return_token_strs", False):
            if published.detokenize is None:
                raise LLMError(f"model '{mv.name}' publishes no detokenizer", param="return_token_strs")
            strs = [await tokenizing.detokenize(published, [i]) for i in ids]
        return _json(
            {"count": len(ids), "max_model_len": published.context_length, "tokens": ids, "token_strs": strs}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        doc = await self.body(request)
        mv, published = await self._tokenizer(doc)
        ids = doc.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise LLMError("'tokens' must be a list of token ids (integers)", param="tokens")
        if published.detokenize is None:
            raise LLMError(f"model '{mv.name}' publishes no detokenizer", param="model")
        return _json({"prompt": await tokenizing.detokenize(published, ids)})

    # ---- score and rerank ----
    async def _scores(
        self, request: web.Request, name: Any, query: str, texts: list[str]
    ) -> tuple[str, list[float], int]:
        if not isinstance(name, str) or not name:
            raise LLMError(
                "'model' is required: the name of a model (GET /v1/models lists them)", param="model"
            )
        if not texts:
            raise LLMError("there is nothing to score: give at least one document", param="documents")
        if len(texts) > MAX_DOCUMENTS:
            raise LLMError(f"at most {MAX_DOCUMENTS} documents may be scored at once", param="documents")
        mv = await self.llm.ready_model(name)
        results = await self.llm.embed(request, mv, [query, *texts], None, f"score-{uuid.uuid4().hex[:8]}")
        q = results[0][0]
        scores = [_cosine(q, vector) for vector, _ in results[1:]]
        return mv.name, scores, sum(tokens for _, tokens in results)

    async def score(self, request: web.Request) -> web.Response:
        """vLLM's /v1/score: `text_1` (one text, or a list as long as `text_2`) against `text_2`."""
        doc = await self.body(request)
        first, second = doc.get("text_1"), doc.get("text_2")
        lefts = [first] if isinstance(first, str) else first
        rights = [second] if isinstance(second, str) else second
        for key, values in (("text_1", lefts), ("text_2", rights)):
            if (
                not isinstance(values, list)
                or not values
                or not all(isinstance(v, str) and v for v in values)
            ):
                raise LLMError(f"'{key}' must be a non-empty string or list of non-empty strings", param=key)
        assert isinstance(lefts, list) and isinstance(rights, list)
        if len(lefts) != 1 and len(lefts) != len(rights):
            raise LLMError("'text_1' must be one text or as many as 'text_2'", param="text_1")
        if len(lefts) == 1:
            model, scores, tokens = await self._scores(request, doc.get("model"), lefts[0], rights)
        else:
            model, scores, tokens = str(doc.get("model")), [], 0
            for left, right in zip(lefts, rights):
                model, one, used = await self._scores(request, doc.get("model"), left, [right])
                scores += one
                tokens += used
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return _json(
            {
                "id": f"score-{uuid.uuid4().hex}",
                "object": "list",
                "created": _now(),
                "model": model,
                "data": data,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
            }
        )

    async def rerank(self, request: web.Request) -> web.Response:
        """Jina's and Cohere's /v1/rerank: `documents` (strings or {"text": ...}) ordered by relevance to `query`,
        the `top_n` best, with the documents unless `return_documents` is false."""
        doc = await self.body(request)
        query = doc.get("query")
        if not isinstance(query, str) or not query:
            raise LLMError("'query' must be a non-empty string", param="query")
        documents = doc.get("documents")
        if not isinstance(documents, list):
            raise LLMError(
                "'documents' must be a list of strings or {\"text\": ...} objects", param="documents"
            )
        texts = []
        for item in documents:
            text = item.get("text") if isinstance(item, dict) else item
            if not isinstance(text, str) or not text:
                raise LLMError(
                    "each of 'documents' must be a non-empty string or {\"text\": ...}", param="documents"
                )
            texts.append(text)
        top_n = doc.get("top_n")
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
            raise LLMError("'top_n' must be a positive integer", param="top_n")
        model, scores, tokens = await self._scores(request, doc.get("model"), query, texts)
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: top_n or len(scores)]
        keep = _flag(doc, "return_documents", True)
        results = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if keep:
                result["document"] = {"text": texts[i]}
            results.append(result)
        return _json(
            {
                "id": f"rerank-{uuid.uuid4().hex}",
                "model": model,
                "usage": {"total_tokens": tokens},
                "results": results,
            }
        )


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def _now() -> int:
    return int(time.time())
