"""A choice's generated text shaped into what the APIs answer: reasoning (a thinking model's `<think>` block), content,
and tool calls, by the parsers its model's config names (`tool_call_parser`, `reasoning_parser`) or its chat
template implies. Streamed text goes through the same shaping delta by delta."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...llm import reasoning, tool_parsers
from ...llm.tool_parsers import ToolCall
from .errors import LLMError
from .request import Generation


@dataclass(frozen=True)
class Parsers:
    tool: str = "json"
    reasoning: str | None = None

    @classmethod
    def of(cls, mv: Any, template: Any) -> Parsers:
        """A model's parsers: its config parameters, else what its chat template implies (tools) or none."""
        params = getattr(mv.config, "parameters", {}) or {}

        def param(key: str) -> str | None:
            value = params.get(key) if hasattr(params, "get") else None
            text = getattr(value, "string_value", value)
            return text.strip() if isinstance(text, str) and text.strip() else None

        tool = param("tool_call_parser") or tool_parsers.guess(getattr(template, "text", None))
        if tool not in tool_parsers.PARSERS:
            raise LLMError(
                f"model '{mv.name}': tool_call_parser '{tool}' is none of {', '.join(tool_parsers.PARSERS)}",
                500,
            )
        thinking = param("reasoning_parser")
        if thinking is not None and thinking not in reasoning.PARSERS:
            raise LLMError(
                f"model '{mv.name}': reasoning_parser '{thinking}' is none of {', '.join(reasoning.PARSERS)}",
                500,
            )
        return cls(tool, thinking)


@dataclass
class Shaped:
    """A whole choice, shaped."""

    reasoning: str | None
    content: str
    calls: list[ToolCall] = field(default_factory=list)


class Shaper:
    """One choice's text as (reasoning, content) deltas while it streams, and its tool calls at the end."""

    def __init__(self, gen: Generation, parsers: Parsers, prompt: str, chat: bool = True):
        self.reasoning = (
            reasoning.ReasoningStream(parsers.reasoning, prompt) if chat and parsers.reasoning else None
        )
        wants_calls = chat and bool(gen.tools) and gen.tool_choice != "none"
        # a forced call follows a JSON schema (mapping.tool_call_schema): plain JSON whatever the model's family
        forced = gen.tool_choice == "required" or isinstance(gen.tool_choice, dict)
        names = [t["function"].get("name") for t in gen.tools or [] if isinstance(t.get("function"), dict)]
        self.tools = (
            tool_parsers.ToolCallStream("json" if forced else parsers.tool, names) if wants_calls else None
        )
        self.thought = ""  # all the reasoning so far
        self.said = ""  # all the content let through so far

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of a new piece of text that may go out now."""
        thought, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        if self.tools is not None and content:
            content = self.tools.feed(content)
        self.thought += thought
        self.said += content
        return thought, content

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        """The (reasoning, content) held back to the end, and the tool calls the held text made."""
        thought, content = self.reasoning.finish() if self.reasoning is not None else ("", "")
        calls: list[ToolCall] = []
        if self.tools is not None:
            content = self.tools.feed(content) if content else ""
            parsed = self.tools.finish()
            content += parsed.content
            calls = parsed.calls
        self.thought += thought
        self.said += content
        return thought, content, calls

    @property
    def thinking(self) -> bool:
        return self.reasoning is not None and self.reasoning.thought

    def whole(self, text: str) -> Shaped:
        """A choice that did not stream, shaped at once."""
        thought, content = self.feed(text)
        more_thought, more_content, calls = self.finish()
        reasoning_text = (thought + more_thought).strip("\n") if self.thinking else None
        return Shaped(reasoning_text, content + more_content, calls)
