"""Chat templates: where a model's comes from (its LLMInfo, its `tokenizer_config.json`, `--chat-template FILE`) and
rendering it with Jinja2 in the sandbox Hugging Face tokenizers use."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from ...llm import info as llm_info
from .errors import LLMError

log = logging.getLogger("naiad.llm")


@dataclass(frozen=True)
class ChatTemplate:
    source: str  # where it came from, for error messages
    text: str
    bos_token: str = ""
    eos_token: str = ""


def _token(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def from_tokenizer_config(path: Path) -> ChatTemplate | None:
    """The chat template of a Hugging Face `tokenizer_config.json` (a string, or a list of named templates of which
    'default' is used), or None when it has none."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        log.warning("cannot read %s: %s", path, exc)
        return None
    template = doc.get("chat_template") if isinstance(doc, dict) else None
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if not isinstance(template, str):
        chat_file = path.with_name("chat_template.jinja")  # newer tokenizers save it beside the config
        template = chat_file.read_text(encoding="utf-8") if chat_file.is_file() else None
    if not template:
        return None
    return ChatTemplate(str(path), template, _token(doc.get("bos_token")), _token(doc.get("eos_token")))


def from_file(path: str) -> ChatTemplate:
    """`--chat-template FILE`, read once at start (a file that cannot be read stops the server with its reason)."""
    try:
        return ChatTemplate(path, Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"--chat-template {path}: {exc.strerror or exc}") from None


def resolve(mv, fallback: ChatTemplate | None) -> ChatTemplate | None:
    """A model version's chat template: the one its backend published, else `tokenizer_config.json` in the version
    folder or the model folder, else the `--chat-template` file; None when there is none."""
    cached = mv.ctx.extra.get("openai_chat_template")
    if cached is not None:
        return cached or None
    found: ChatTemplate | None = None
    published = llm_info.of(mv.ctx)
    if published is not None and published.chat_template:
        found = ChatTemplate(
            f"model '{mv.name}'", published.chat_template, published.bos_token, published.eos_token
        )
    if found is None:
        for folder in (mv.ctx.version_dir, mv.ctx.model_dir):
            path = Path(folder) / "tokenizer_config.json"
            if path.is_file():
                found = from_tokenizer_config(path)
                if found is not None:
                    break
    if found is None and fallback is not None:
        bos = published.bos_token if published is not None else ""
        eos = published.eos_token if published is not None else ""
        found = ChatTemplate(fallback.source, fallback.text, bos, eos)
    mv.ctx.extra["openai_chat_template"] = found or False
    return found


def _raise(message: str) -> None:
    raise LLMError(f"the chat template refused the request: {message}")


_ENV = None


def environment():
    """Hugging Face's template environment: sandboxed, immutable, loop controls, `raise_exception`, `tojson` that
    keeps non-ASCII text, `strftime_now`."""
    global _ENV
    if _ENV is None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

        def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
            )

        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _ENV = env
    return _ENV


def _compiled(template: ChatTemplate):
    cache = _compiled.__dict__.setdefault("cache", {})
    compiled = cache.get(template.text)
    if compiled is None:
        import jinja2

        try:
            compiled = environment().from_string(template.text)
        except jinja2.TemplateError as exc:
            raise LLMError(
                f"the chat template of {template.source} does not compile: {exc}", status=500
            ) from None
        if len(cache) > 64:
            cache.clear()
        cache[template.text] = compiled
    return compiled


def _for_template(messages: list[dict]) -> list[dict]:
    """Messages as templates expect them: an assistant's tool-call arguments as objects, not JSON text, and a
    message without content (an assistant's tool calls) with empty text (a template that has no tool calls
    concatenates the content, and None is not text)."""
    out = []
    for msg in messages:
        if msg.get("content") is None:
            msg = {**msg, "content": ""}
        calls = msg.get("tool_calls")
        if msg.get("role") == "assistant" and isinstance(calls, list):
            msg = dict(msg)
            fixed = []
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    try:
                        call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
                    except ValueError:
                        pass
                fixed.append(call)
            msg["tool_calls"] = fixed
        out.append(msg)
    return out


def render(
    template: ChatTemplate,
    messages: list[dict],
    tools: list | None = None,
    add_generation_prompt: bool = True,
    extra: dict | None = None,
) -> str:
    """The prompt text for a conversation."""
    import jinja2

    context = dict(extra or {})
    context.update(
        messages=_for_template(messages),
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        bos_token=template.bos_token,
        eos_token=template.eos_token,
    )
    try:
        return _compiled(template).render(**context)
    except LLMError:
        raise
    except jinja2.TemplateError as exc:
        raise LLMError(f"the chat template of {template.source} failed: {exc}") from None
    except Exception as exc:  # a template may index into anything it is given
        raise LLMError(
            f"the chat template of {template.source} failed: {type(exc).__name__}: {exc}"
        ) from None
