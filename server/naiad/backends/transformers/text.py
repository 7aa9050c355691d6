"""Text the transformers backend streams: how much of it may go out before the next token."""

from __future__ import annotations


def safe_end(text: str, stops: list[str]) -> int:
    """How much of `text` may go out now: not a trailing replacement character (a UTF-8 sequence still being
    decoded) nor a suffix that starts one of the stop strings."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    for stop in stops:
        for k in range(min(len(stop) - 1, end), 0, -1):
            if text[end - k : end] == stop[:k]:
                end -= k
                break
    return end
