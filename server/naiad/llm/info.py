"""What a loaded LLM model tells the OpenAI frontend about itself: its chat template, special tokens, context size.

A backend that owns a tokenizer (a GGUF's metadata, a Hugging Face folder) publishes one `LLMInfo` per model
version with `publish(ctx, info)` from its load hook; the frontend reads it with `of(ctx)`. Models that publish
none (a python model, an ensemble written for Triton) get their template from `tokenizer_config.json` in the model
folder or from `--chat-template`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

_KEY = "llm"
LORA_ADAPTERS = "lora_adapters"  # LLMInfo.extra's key for a model's LoRA adapters: {name: adapter file}
# LLMInfo.extra's key for a model that takes images (its `image` input): {"marker": text}. With a marker (llama.cpp's
# `<__media__>`), the chat template is given text in which the marker stands where each image goes; with none (a
# Hugging Face processor's model), the template is given `{"type": "image"}` content parts and writes the model's
# own image token
IMAGES = "images"


@dataclass
class LLMInfo:
    chat_template: str | None = None  # Jinja2, as Hugging Face tokenizers and GGUF `tokenizer.chat_template`
    bos_token: str = ""
    eos_token: str = ""
    context_length: int | None = None  # tokens; prompts plus max_tokens beyond it are refused
    # the most UTF-8 bytes a prompt can have and still fit the context under any tokenization (limits.py): a larger
    # one is refused untokenized; None: no bound known
    prompt_byte_limit: int | None = None
    # text (, add_special) -> token ids, for counting and validation without a round trip through the engine (None:
    # unknown); `add_special` (BOS and the like) defaults to what the engine does with a prompt; in a frontend worker
    # an awaitable of them, asked of the engine process
    tokenize: Callable[..., list[int] | Awaitable[list[int]]] | None = None
    # token ids -> text (/detokenize), or an awaitable of it in a frontend worker
    detokenize: Callable[[list[int]], str | Awaitable[str]] | None = None
    # a `structured_outputs` value ({"json": schema}, ...) -> None, raising NaiadError for one the engine cannot
    # follow; may be slow the first time (a schema turned into a grammar), so the frontend calls it off its loop
    check_structured_outputs: Callable[[Any], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # LoRA adapters, for an engine that takes them (llama.cpp): extra[LORA_ADAPTERS] lists them (name -> file);
    # load_lora(name, path) and unload_lora(name) change them while the model serves (blocking calls, so the frontend
    # runs them off its loop; in a frontend worker coroutine functions, asked of the engine process). InvalidArgument
    # for a name taken or a file the engine refuses, NotFound for no such file or adapter
    load_lora: Callable[[str, str], Awaitable[None] | None] | None = None
    unload_lora: Callable[[str], Awaitable[None] | None] | None = None


def publish(ctx: Any, info: LLMInfo) -> None:
    """Attach `info` to a model version's context (backends.base.ModelContext)."""
    ctx.extra[_KEY] = info


def of(ctx: Any) -> LLMInfo | None:
    """The LLMInfo a backend published for this model version, or None."""
    return ctx.extra.get(_KEY)


def lora_adapters(info: LLMInfo | None) -> dict[str, str]:
    """The LoRA adapters a model's LLMInfo lists (name -> adapter file); {} for none."""
    if info is None:
        return {}
    return info.extra.get(LORA_ADAPTERS) or {}


def image_input(info: LLMInfo | None) -> dict[str, Any] | None:
    """How a model takes images (`extra[IMAGES]`), or None for a model that takes none."""
    if info is None:
        return None
    value = info.extra.get(IMAGES)
    return value if isinstance(value, dict) else None
