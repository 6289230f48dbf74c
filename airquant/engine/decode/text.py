"""Text out of a growing list of token ids: incremental, never a broken UTF-8 character, stop strings cut.

The one owner of stop strings: the decode loop, the transformers fallback, the provider and the server
all take the text and the ``finish_reason`` from here and never search the text again.

A byte-level BPE token may hold part of a character; decoding such a prefix gives U+FFFD at its end.
The text is released only up to a point where it decodes cleanly, and (when stop strings are set)
short of any tail that could still become a stop string, so a streamed client never sees text that a
later token turns into a stop and removes. A stop string found (also across token boundaries) cuts the
text where it starts and sets ``finish_reason = "stop"``.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
# What a shared server accepts (serve/app.py, the Provider): each stop string is searched, and its prefixes
# held back, at every token of its sequence, in the pass everyone shares. 4 is OpenAI's own limit.
MAX_STOPS = 4
MAX_STOP_CHARS = 256


class Detokenizer:
    """``push(ids)`` -> the new text since the last call; ``finish_reason`` is "stop" once a stop string
    appeared (the text is cut before it), else None."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer, self.stop = tokenizer, tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""  # the full decoded text, cut at a stop string once one appeared
        self.sent = 0  # characters of ``text`` already released
        self.finish_reason: str | None = None

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        hit = self._find_stop(text)
        if hit is not None:
            self.finish_reason = "stop"
            self.text = text[:hit]
            return self._release(len(self.text))
        self.text = text
        safe = len(text.rstrip(REPLACEMENT)) if text.endswith(REPLACEMENT) else len(text)
        return self._release(safe - self._held_back(text[:safe]))

    def flush(self) -> str:
        """The rest of the text (the sequence ended): a trailing partial character stays out."""
        text = self.text if self.finish_reason == "stop" else self.text.rstrip(REPLACEMENT)
        return self._release(len(text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent: upto], upto
        return out

    def _find_stop(self, text: str) -> int | None:
        # Only the region new tokens can have completed is searched: a stop string ends after ``sent``.
        start = max(0, self.sent - max((len(s) for s in self.stop), default=0))
        hits = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """Characters at the end of ``text`` that begin some stop string (not released yet)."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
