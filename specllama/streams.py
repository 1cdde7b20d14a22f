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


class Stream:
    """Iterator of Chunks; `result` holds the text, finish_reason and stats once it has ended.
    Stepping and closing it are serialized, so close() from another thread waits for the step
    in progress rather than meeting a running generator."""

    def __init__(self, chunks: Generator[Chunk, None, None]):
        self._chunks = chunks
        self.result: Optional[Result] = None
        self.stats: Optional[Stats] = None  # the running generation's stats, live
        self._cancel = threading.Event()
        self._step = threading.Lock()

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Chunk:
        with self._step:
            return next(self._chunks)

    def cancel(self) -> None:
        """Ask the generation to stop at its next token, from any thread; it then ends with
        finish_reason "cancelled"."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def close(self) -> None:
        """Stop early; the models stay consistent and `result` says "cancelled"."""
        self._cancel.set()
        with self._step:
            self._chunks.close()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
