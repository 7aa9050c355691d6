"""LoRA adapters as models, as vLLM serves them: each adapter a model loaded models list (`GET /v1/models`, with
`parent` its base model and `root` its file), requested as `model: "<adapter>"` (frontends/llm/service.py resolves
it to the base model and the adapter's `lora_name`), and vLLM's runtime routes, which change what the server serves
and are refused unless `naiad serve --allow-runtime-lora` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING):

- `POST /v1/load_lora_adapter {"lora_name", "lora_path", "base_model_name"?}`: 200 "Success: LoRA adapter '<name>'
  added successfully." (text, as vLLM answers); 400 for a name taken (by an adapter or a model) or a file the engine
  refuses, 404 for a path with no adapter or an unknown base model.
- `POST /v1/unload_lora_adapter {"lora_name"}`: 200 "Success: LoRA adapter '<name>' removed successfully."; 404 for
  an adapter no model lists. Requests running under it finish first.

An adapter loads into the model that publishes `load_lora` in its LLMInfo (llama.cpp models): the one named by
`base_model_name`, or the only such model loaded. In a frontend worker, the LLMInfo's calls are the engine process's.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from ...errors import NaiadError, NotFound
from ...llm import info as llm_info
from ..llm.errors import LLMError
from ..llm.service import LLMService

RUNTIME_OFF = (
    "loading and unloading LoRA adapters at runtime is off: start the server with --allow-runtime-lora (vLLM's "
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING)"
)


def adapter_cards(mv: Any, card: Callable[[str, str | None, str | None], dict]) -> list[dict]:
    """The model cards of a model's adapters, by name: `card(id, root, parent)`."""
    adapters = llm_info.lora_adapters(llm_info.of(mv.ctx))
    return [card(name, path, mv.name) for name, path in sorted(adapters.items())]


async def _run(fn: Callable[..., Any], *args: Any) -> None:
    """An LLMInfo call: a coroutine function (a frontend worker's, asked of the engine) or a blocking one (run on a
    thread: it reads a file and waits for the engine thread)."""
    if inspect.iscoroutinefunction(fn):
        await fn(*args)
        return
    result = await asyncio.to_thread(fn, *args)
    if isinstance(result, Awaitable):
        await result


class LoraRoutes:
    def __init__(self, llm: LLMService, body: Callable[[web.Request], Awaitable[dict]], allow_runtime: bool):
        self.llm = llm
        self.body = body
        self.allow_runtime = allow_runtime

    def add_routes(self, router: web.UrlDispatcher, guard: Callable) -> None:
        router.add_post("/v1/load_lora_adapter", guard(self.load))
        router.add_post("/v1/unload_lora_adapter", guard(self.unload))

    def _allowed(self) -> None:
        if not self.allow_runtime:
            raise LLMError(RUNTIME_OFF, 403, code="runtime_lora_disabled")

    def _base(self, name: Any) -> Any:
        """The model an adapter loads into: `base_model_name`'s, or the one loaded model that takes adapters."""
        if name is not None:
            if not isinstance(name, str) or not name:
                raise LLMError("'base_model_name' must be a model's name", param="base_model_name")
            mv = self.llm.model(name)
            published = llm_info.of(mv.ctx)
            if published is None or published.load_lora is None:
                raise LLMError(
                    f"model '{name}' takes no LoRA adapters (llama.cpp models do)", param="base_model_name"
                )
            return mv
        takers = [mv for mv in self.llm.listed() if (p := llm_info.of(mv.ctx)) and p.load_lora is not None]
        if len(takers) == 1:
            return takers[0]
        if not takers:
            raise LLMError(
                "no loaded model takes LoRA adapters (llama.cpp models do)", param="base_model_name"
            )
        names = ", ".join(mv.name for mv in takers)
        raise LLMError(
            f"'base_model_name' is required: more than one model takes LoRA adapters ({names})",
            param="base_model_name",
        )

    async def load(self, request: web.Request) -> web.Response:
        self._allowed()
        doc = await self.body(request)
        name, path = doc.get("lora_name"), doc.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise LLMError("Both 'lora_name' and 'lora_path' must be provided.", param="lora_name")
        mv = self._base(doc.get("base_model_name"))
        if self.llm.adapter_base(name) is not None:
            raise LLMError(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        try:
            self.llm.model(name)
        except LLMError:
            pass
        else:
            raise LLMError(
                f"'{name}' is the name of a model: a LoRA adapter is requested by its name as a model's",
                param="lora_name",
            )
        published = llm_info.of(mv.ctx)
        load = published.load_lora if published is not None else None
        if load is None:  # (the model was reloaded without adapters since `_base` chose it)
            raise LLMError(
                f"model '{mv.name}' takes no LoRA adapters (llama.cpp models do)", param="base_model_name"
            )
        try:
            await _run(load, name, path)
        except NaiadError as exc:
            param = "lora_path" if isinstance(exc, NotFound) else None
            raise LLMError(exc.message, exc.http_status, param=param) from None
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        self._allowed()
        doc = await self.body(request)
        name = doc.get("lora_name")
        if not isinstance(name, str) or not name:
            raise LLMError("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
        mv = self.llm.adapter_base(name)
        published = llm_info.of(mv.ctx) if mv is not None else None
        if published is None or published.unload_lora is None:
            raise LLMError(f"The lora adapter '{name}' cannot be found.", 404, param="lora_name")
        try:
            await _run(published.unload_lora, name)
        except NaiadError as exc:
            raise LLMError(exc.message, exc.http_status, param="lora_name") from None
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
