"""Text out of generated tokens: UTF-8-safe incremental detokenisation and stop strings that never leak.

A token can end in the middle of a UTF-8 character (byte-level BPE splits emoji and CJK into byte tokens), and a
stop string can arrive over several tokens; `TextStream` holds back exactly what may still change, so every delta
it emits is final text.
"""

from __future__ import annotations

import codecs


class TextStream:
    """Accumulates token bytes; `push()` returns the text that became final, `finish()` the rest."""

    __slots__ = ("_decoder", "_held", "_stops", "stopped", "text")

    def __init__(self, stops: list[str]):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = [s for s in stops if s]
        self._held = ""  # decoded, not yet emitted: it may be the start of a stop string
        self.text = ""  # everything emitted so far
        self.stopped = False  # a stop string was found: the text ends before it

    def push(self, data: bytes) -> str:
        """Add a token's bytes; the newly final text (possibly empty)."""
        if self.stopped:
            return ""
        self._held += self._decoder.decode(data)
        if not self._stops:
            out, self._held = self._held, ""
            self.text += out
            return out
        # a stop string may begin in the emitted text's tail only if it was held back, so searching _held suffices
        cut = -1
        for stop in self._stops:
            i = self._held.find(stop)
            if i >= 0 and (cut < 0 or i < cut):
                cut = i
        if cut >= 0:
            out = self._held[:cut]
            self._held = ""
            self.stopped = True
            self.text += out
            return out
        keep = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._held)), keep, -1):
                if self._held.endswith(stop[:n]):
                    keep = n
                    break
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
