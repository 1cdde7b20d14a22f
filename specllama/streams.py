"""What a generation hands back: chunks as it streams, and the result when it has ended."""

from __future__ import annotations

import threading
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Optional

from .stats import Stats


@dataclass(frozen=True)
class Chunk:
    """Part of a streamed generation: the text that became final and the tokens behind it."""

    text: str
    tokens: list[int]
    from_draft: list[bool]
    # with logprobs asked for: per token, (its logprob, [(token, logprob), ...] top alternatives)
    logprobs: Optional[list[tuple[float, list[tuple[int, float]]]]] = None


@dataclass
class Result:
    """A finished generation. finish_reason: "stop" (EOG or stop string), "length", "cancelled"."""

    text: str
    tokens: list[int]
    finish_reason: str
    stats: Stats = field(default_factory=Stats)
    stop_sequence: Optional[str] = None  # the stop string that ended it, if one did


@dataclass
class Outcome:
    """What a generation writes and its Stream reads: the generation holds this, never the
    Stream, so a Stream dropped without close() (a `for` loop left with break) is freed at once,
    and with it its generation, which ends as close() would end it and frees its slot."""

    result: Optional[Result] = None
    stats: Optional[Stats] = None  # the running generation's stats, live
    cancel: threading.Event = field(default_factory=threading.Event)


class Stream:
    """Iterator of Chunks; `result` holds the text, finish_reason and stats once it has ended.
    Stepping and closing it are serialized, so close() from another thread waits for the step
    in progress rather than meeting a running generator."""

    def __init__(self, chunks: Generator[Chunk, None, None], outcome: Outcome):
        self._chunks, self._outcome = chunks, outcome  # outcome: what chunks' generation writes
        self._step = threading.Lock()
        self.started = False  # stepped at least once (a generation that never started holds nothing)

    @property
    def result(self) -> Optional[Result]:
        return self._outcome.result

    @property
    def stats(self) -> Optional[Stats]:
        """The running generation's stats, live (None before it starts)."""
        return self._outcome.stats

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Chunk:
        with self._step:
            self.started = True
            return next(self._chunks)

    def cancel(self) -> None:
        """Ask the generation to stop at its next token, from any thread; it then ends with
        finish_reason "cancelled"."""
        self._outcome.cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._outcome.cancel.is_set()

    def close(self) -> None:
        """Stop early; the models stay consistent and `result` says "cancelled"."""
        self._outcome.cancel.set()
        with self._step:
            self._chunks.close()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
