"""Text out of generated tokens: UTF-8-safe incremental detokenisation and stop strings that never leak.

A token can end in the middle of a UTF-8 character (byte-level BPE splits emoji and CJK into byte tokens), and a
stop string can arrive over several tokens; `TextStream` holds back exactly what may still change, so every delta
it emits is final text.
"""

from __future__ import annotations

import codecs


class _Stop:
    """One stop string and how much of it the text's end matches now (Knuth-Morris-Pratt): each new character
    costs O(1) amortized, whatever the string's length, so a long stop string cannot slow every token down."""

    __slots__ = ("fail", "matched", "text")

    def __init__(self, text: str):
        self.text = text
        self.matched = 0  # the longest end of the text so far that is a beginning of `text`
        fail = [0] * len(text)  # fail[i]: the longest proper border of text[: i + 1]
        k = 0
        for i in range(1, len(text)):
            while k and text[i] != text[k]:
                k = fail[k - 1]
            if text[i] == text[k]:
                k += 1
            fail[i] = k
        self.fail = fail

    def feed(self, new: str) -> int:
        """Match `new` on; the offset in `new` just past the first full match of the stop string, or -1."""
        text, k = self.text, self.matched
        if k == 0 and text[0] not in new:
            return -1  # (the common case: no character of `new` can start a match)
        fail = self.fail
        for i, c in enumerate(new):
            while k and c != text[k]:
                k = fail[k - 1]
            if c == text[k]:
                k += 1
                if k == len(text):
                    self.matched = k
                    return i + 1
        self.matched = k
        return -1


class TextStream:
    """Accumulates token bytes; `push()` returns the text that became final, `finish()` the rest."""

    __slots__ = ("_decoder", "_held", "_stops", "stopped", "text")

    def __init__(self, stops: list[str]):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = [_Stop(s) for s in stops if s]
        self._held = ""  # decoded, not yet emitted: it may be the start of a stop string
        self.text = ""  # everything emitted so far
        self.stopped = False  # a stop string was found: the text ends before it

    def push(self, data: bytes) -> str:
        """Add a token's bytes; the newly final text (possibly empty)."""
        if self.stopped:
            return ""
        new = self._decoder.decode(data)
        if not self._stops:
            self.text += new
            return new
        base = len(self._held)
        self._held += new
        # of the stop strings that end in the new text, the one that starts first wins
        cut = -1
        for stop in self._stops:
            end = stop.feed(new)
            if end >= 0:
                start = base + end - len(stop.text)
                if cut < 0 or start < cut:
                    cut = start
        if cut >= 0:
            out = self._held[:cut]
            self._held = ""
            self.stopped = True
            self.text += out
            return out
        # what may still begin a stop string is held back: the longest end of the text that begins one
        keep = min(len(self._held), max(stop.matched for stop in self._stops))
        out = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        self.text += out
        return out

    def finish(self) -> str:
        """Generation ended without a stop string: flush what was held back (an incomplete character as U+FFFD)."""
        if self.stopped:
            return ""
        out = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        self.text += out
        return out
