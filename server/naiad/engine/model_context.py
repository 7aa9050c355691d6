"""A model version's context as a frontend worker sees it: its folders and the `LLMInfo` its backend published in
the engine (chat template, special tokens, context length), with the tokenizer and the structured-output check
asked of the engine; and the load stamp that tells a worker when the engine's model is another load than the one
it knows."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..llm import info as llm_info
from ..llm import tokenizing

_LOAD_KEY = "engine_load"
_loads = itertools.count(1)


def load_stamp(mv: Any) -> int:
    """(engine) A number of this loaded model version's own: a reload, or a load after an unload, gets another."""
    extra = mv.ctx.extra
    stamp = extra.get(_LOAD_KEY)
    if stamp is None:
        stamp = extra[_LOAD_KEY] = next(_loads)
    return stamp


def restamp(mv: Any) -> None:
    """(engine) The model version's context changed in place (a LoRA adapter loaded or unloaded): a new stamp, so
    every worker describes it again the next time it meets it."""
    mv.ctx.extra[_LOAD_KEY] = next(_loads)


def describe(mv: Any) -> dict:
    """(engine) What a worker needs of a model version's context, as msgpack-able values."""
    ctx = mv.ctx
    out: dict[str, Any] = {"model_dir": str(ctx.model_dir), "version_dir": str(ctx.version_dir), "llm": None}
    published = llm_info.of(ctx)
    if published is not None:
        out["llm"] = {
            "chat_template": published.chat_template,
            "bos_token": published.bos_token,
            "eos_token": published.eos_token,
            "context_length": published.context_length,
            "prompt_byte_limit": published.prompt_byte_limit,
            "extra": dict(published.extra),
            "tokenize": published.tokenize is not None,
            "detokenize": published.detokenize is not None,
            "check_structured_outputs": published.check_structured_outputs is not None,
            "lora": published.load_lora is not None and published.unload_lora is not None,
        }
    return out


async def change_lora(mv: Any, name: str, path: str | None) -> None:
    """(engine) Load LoRA adapter `name` from `path` into the model (None: unload it), off the event loop (a file
    read, and a wait for the engine's thread), then restamp the model: the workers' LLMInfo lists adapters."""
    published = llm_info.of(mv.ctx)
    if published is None or published.load_lora is None or published.unload_lora is None:
        from ..errors import InvalidArgument

        raise InvalidArgument(f"model '{mv.name}' takes no LoRA adapters")
    try:
        if path is None:
            await asyncio.to_thread(published.unload_lora, name)
        else:
            await asyncio.to_thread(published.load_lora, name, path)
    finally:
        restamp(mv)


async def check_structured_outputs(mv: Any, spec: Any) -> None:
    """(engine) The model's engine's check of a structured-output spec (InvalidArgument when it cannot follow it),
    off the event loop: it may build a grammar."""
    published = llm_info.of(mv.ctx)
    if published is not None and published.check_structured_outputs is not None:
        await asyncio.to_thread(published.check_structured_outputs, spec)


async def tokenize(mv: Any, text: str, add_special: bool | None = None) -> list[int]:
    """(engine) `text` as token ids by the model's published tokenizer (bounded, off the loop when large: the
    engine's loop serves every worker)."""
    published = llm_info.of(mv.ctx)
    if published is None or published.tokenize is None:
        from ..errors import InvalidArgument

        raise InvalidArgument(f"model '{mv.name}' publishes no tokenizer")
    return [int(t) for t in await tokenizing.tokenize(published, text, add_special)]


async def detokenize(mv: Any, ids: list[int]) -> str:
    """(engine) token ids as text by the model's published tokenizer (off the loop when many)."""
    published = llm_info.of(mv.ctx)
    if published is None or published.detokenize is None:
        from ..errors import InvalidArgument

        raise InvalidArgument(f"model '{mv.name}' publishes no detokenizer")
    return await tokenizing.detokenize(published, [int(t) for t in ids])


@dataclass
class RemoteContext:
    """(worker) What the OpenAI frontend reads of `ModelVersion.ctx`; `extra` caches per load, as in the engine."""

    name: str
    version: int
    model_dir: Path
    version_dir: Path
    extra: dict = field(default_factory=dict)


def remote_context(
    name: str,
    version: int,
    described: dict,
    tokenize: Callable[..., Awaitable[list[int]]],
    check: Callable[[Any], None],
    detokenize: Callable[[list[int]], Awaitable[str]] | None = None,
    change_lora: Callable[[str, str | None], Awaitable[None]] | None = None,
) -> RemoteContext:
    """(worker) The context `describe` sent, its LLMInfo's tokenizer being `tokenize`, its structured-output check
    `check` and its LoRA adapters' load and unload `change_lora(name, path or None)` (calls to the engine)."""
    ctx = RemoteContext(name, version, Path(described["model_dir"]), Path(described["version_dir"]))
    llm = described.get("llm")
    if llm is not None:
        load_lora = unload_lora = None
        if llm.get("lora") and change_lora is not None:

            async def load_lora(name: str, path: str) -> None:
                await change_lora(name, path)

            async def unload_lora(name: str) -> None:
                await change_lora(name, None)

        llm_info.publish(
            ctx,
            llm_info.LLMInfo(
                chat_template=llm["chat_template"],
                bos_token=llm["bos_token"],
                eos_token=llm["eos_token"],
                context_length=llm["context_length"],
                prompt_byte_limit=llm.get("prompt_byte_limit"),
                tokenize=tokenize if llm["tokenize"] else None,
                detokenize=detokenize if llm.get("detokenize") else None,
                check_structured_outputs=check if llm.get("check_structured_outputs") else None,
                extra=llm["extra"],
                load_lora=load_lora,
                unload_lora=unload_lora,
            ),
        )
    return ctx
