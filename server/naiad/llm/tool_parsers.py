"""Tool calls in generated text, as the model families in use write them (vLLM's `--tool-call-parser` names):

- `hermes` (Hermes, Qwen 2.5/3 and most chat templates of 2025-26): text, then `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` blocks;
- `llama3_json` (Llama 3.1-3.3): an optional `<|python_tag|>`, then `{"name": ..., "parameters": {...}}` objects
  separated by `;`;
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (v3 tokenizers) or `name[ARGS]{...}` pairs
  (v11 and later);
- `json`: the whole text a JSON object or list of them (any model following a forced tool choice's schema).

A model's parser is its config parameter `tool_call_parser`, else guessed from its chat template (which names the
tags it taught the model). Only calls of the request's tools count: text that names another is content. While a
response streams, `ToolCallStream` lets content through until text that may begin a call arrives, and holds the
rest for `finish()`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

PARSERS = ("hermes", "llama3_json", "mistral", "json")


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class Parsed:
    content: str  # the text that is not a call ("" when there is none)
    calls: list[ToolCall]


def guess(chat_template: str | None) -> str:
    """The parser a chat template implies (the tags it writes calls with); `json` when it says nothing."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "json"


def _call(item: object, known: set[str]) -> ToolCall | None:
    if not isinstance(item, dict) or item.get("name") not in known:
        return None
    args = item.get("arguments", item.get("parameters", {}))
    return ToolCall(
        str(item["name"]), args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    )


def _json_calls(text: str, known: set[str]) -> list[ToolCall] | None:
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    calls = [_call(item, known) for item in (doc if isinstance(doc, list) else [doc])]
    return None if not calls or None in calls else [c for c in calls if c is not None]


_MISTRAL_PAIR = re.compile(r"\s*([A-Za-z0-9_.\-]+)\[ARGS\]")


def parse(parser: str, text: str, tools: Iterable[str]) -> Parsed | None:
    """The tool calls in a whole response and the text around them; None when it calls none of `tools`."""
    known = set(tools)
    body = text.strip()
    if parser == "hermes" or (parser == "json" and "<tool_call>" in body):
        if "<tool_call>" not in body:
            return None
        content, _, rest = body.partition("<tool_call>")
        blocks = ("<tool_call>" + rest).split("<tool_call>")[1:]
        calls: list[ToolCall] = []
        for block in blocks:
            found = _json_calls(block.split("</tool_call>")[0].strip(), known)
            if found is None:
                return None
            calls += found
        return Parsed(content.strip(), calls)
    if parser == "mistral":
        content, tag, rest = body.partition("[TOOL_CALLS]")
        if not tag:
            return None
        rest = rest.strip()
        if rest.startswith("["):
            found = _json_calls(rest, known)
            return Parsed(content.strip(), found) if found else None
        calls = []
        for chunk in rest.split("[TOOL_CALLS]"):  # name[ARGS]{...}, one call after each tag
            match = _MISTRAL_PAIR.match(chunk)
            if match is None:
                return None
            call = _call({"name": match.group(1), "arguments": chunk[match.end() :].strip()}, known)
            if call is None:
                return None
            try:
                json.loads(call.arguments)
            except ValueError:
                return None
            calls.append(call)
        return Parsed(content.strip(), calls)
    if parser == "llama3_json":  # objects one after the other, `;` between them
        body = body.removeprefix("<|python_tag|>").strip()
        decoder, at, calls = json.JSONDecoder(), 0, []
        while at < len(body):
            try:
                doc, at = decoder.raw_decode(body, at)
            except ValueError:
                return None
            for item in doc if isinstance(doc, list) else [doc]:
                call = _call(item, known)
                if call is None:
                    return None
                calls.append(call)
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return Parsed("", calls) if calls else None
    found = _json_calls(body, known)
    return Parsed("", found) if found else None


def _starts(parser: str) -> tuple[str, ...]:
    """What begins a call, for each parser (a response holding one of these may be calling a tool)."""
    return {
        "hermes": ("<tool_call>",),
        "mistral": ("[TOOL_CALLS]",),
        "llama3_json": ("<|python_tag|>", "{", "["),
        "json": ("<tool_call>", "{", "["),
    }.get(parser, ("{", "["))


class ToolCallStream:
    """A streamed response's content let through while it cannot be a call; from the first text that may begin one,
    held for `finish()`, which parses it (calls, and the content they were not)."""

    def __init__(self, parser: str, tools: Iterable[str]):
        self.parser = parser
        self.tools = list(tools)
        self.starts = _starts(parser)
        # JSON-shaped calls must open the response; tagged ones may follow text
        self.anywhere = parser in ("hermes", "mistral")
        self.held = ""
        self.holding = False
        self.sent = ""

    def feed(self, delta: str) -> str:
        """The content that may go out now."""
        if self.holding:
            self.held += delta
            return ""
        text = self.held + delta
        if self.anywhere:
            cut = min((i for i in (text.find(s) for s in self.starts) if i >= 0), default=-1)
            if cut >= 0:
                self.held, self.holding = text[cut:], True
                return self._send(text[:cut])
            keep = max((k for s in self.starts for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            self.held = text[len(text) - keep :] if keep else ""
            return self._send(text[: len(text) - keep])
        start = (self.sent + text).lstrip()
        if not start:
            self.held = text
            return ""
        if any(start.startswith(s) or s.startswith(start) for s in self.starts):
            self.held, self.holding = text, True
            return ""
        self.held = ""
        return self._send(text)

    def _send(self, text: str) -> str:
        self.sent += text
        return text

    def finish(self) -> Parsed:
        """The held text parsed: its calls and the content left (the whole held text when it calls nothing)."""
        held, self.held = self.held, ""
        parsed = parse(self.parser, held, self.tools) if held else None
        return parsed if parsed is not None else Parsed(held, [])
