"""Reasoning ("thinking") moved out of a response's content, as vLLM's `--reasoning-parser` does: what a thinking
model writes between `<think>` and `</think>` (DeepSeek-R1, Qwen3, and the models trained like them) becomes
`reasoning_content` (chat completions), a reasoning item (Responses) or a thinking block (Anthropic Messages).

A model's parser is its config parameter `reasoning_parser` (`deepseek_r1`, `qwen3`, or `think` for any model with
those tags); none by default. A chat template that opens the think block itself (`enable_thinking`, R1's
templates) leaves the model's output inside it from the first token: the stream starts in reasoning when the
rendered prompt ends with the opening tag. `ReasoningStream` splits a streamed response's deltas; a tag cut across
two deltas is held back until it is whole.
"""

from __future__ import annotations

PARSERS = {
    "deepseek_r1": ("<think>", "</think>"),
    "qwen3": ("<think>", "</think>"),
    "think": ("<think>", "</think>"),
}


class ReasoningStream:
    """Splits text into (reasoning, content) as it arrives: a think block must open the response (after
    whitespace); without one the whole response is content."""

    BEFORE, THINKING, AFTER = range(3)

    def __init__(self, parser: str, prompt: str = ""):
        self.start, self.end = PARSERS[parser]
        opened = prompt.rstrip().endswith(self.start)  # the template opened the block
        self.state = self.THINKING if opened else self.BEFORE
        self.thought = opened  # a think block was seen (an empty one still says the model thought)
        self.held = ""
        self.trim = False  # the newlines after the closing tag are the block's, not the content's

    def feed(self, delta: str) -> tuple[str, str]:
        """(reasoning, content) that may go out now."""
        text, self.held = self.held + delta, ""
        reasoning = ""
        if self.state == self.BEFORE:
            head = text.lstrip()
            if head.startswith(self.start):
                self.state, self.thought = self.THINKING, True
                text = head[len(self.start) :]
            elif self.start.startswith(head):  # (empty, or a tag cut short): wait for more
                self.held = text
                return "", ""
            else:
                self.state = self.AFTER
        if self.state == self.THINKING:
            at = text.find(self.end)
            if at < 0:
                keep = next(
                    (
                        k
                        for k in range(min(len(self.end) - 1, len(text)), 0, -1)
                        if text.endswith(self.end[:k])
                    ),
                    0,
                )
                self.held = text[len(text) - keep :]
                return text[: len(text) - keep], ""
            reasoning, text = text[:at], text[at + len(self.end) :]
            self.state, self.trim = self.AFTER, True
        if self.trim:
            text = text.lstrip("\n")
            self.trim = not text
        return reasoning, text

    def finish(self) -> tuple[str, str]:
        """What was held back: a tag that never completed is text of the part it was in."""
        held, self.held = self.held, ""
        return (held, "") if self.state == self.THINKING else ("", held)


def split(parser: str, text: str, prompt: str = "") -> tuple[str | None, str]:
    """A whole response's (reasoning or None, content)."""
    stream = ReasoningStream(parser, prompt)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    reasoning += more_reasoning
    content += more_content
    return (reasoning.strip("\n") if stream.thought else None), content
