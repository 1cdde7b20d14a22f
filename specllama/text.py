"""Turning accepted token bytes into text: UTF-8 safe streaming and stop strings."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Optional


class StopMatcher:
    """Holds back text that might be the start of a stop string, so none of it leaks.

    feed() returns the text safe to emit; once a stop string is complete, `stopped` is True
    and nothing after the stop string is ever returned.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: Optional[str] = None  # the stop string found (the earliest in the text)

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self._held + text
        hits = [(i, s) for i, s in ((buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits)
            self.stopped, self._held = True, ""
            return buf[:at]
        n_hold = self._longest_partial(buf)
        self._held = buf[len(buf) - n_hold:]
        return buf[:len(buf) - n_hold]

    def flush(self) -> str:
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _longest_partial(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:n]):
                    best = n
                    break
        return best


class Detokenizer:
    """Bytes in, complete UTF-8 characters out; a character split across tokens waits."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        return self._decoder.decode(data)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
