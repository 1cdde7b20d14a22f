"""What a generation hands back: chunks as it streams, and the result when it has ended."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Optional

from .decoding.stats import Stats


@dataclass(frozen=True)
class Chunk:
    """Part of a streamed generation: the text that became final and the tokens behind it."""

    text: str
    tokens: list[int]
    from_draft: list[bool]
    # with logprobs asked for: per token, (its logprob, [(token, logprob), ...] top alternatives)
    logprobs: Optional[list[tuple[float, list[tuple[int, float]]]]] = None
    # per token, who chose it: "draft" or "lookup" (proposed, and the target agreed), "grammar"
    # (the only token a grammar allowed) or "target" (the target's own token of a round)
    origins: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PromptProgress:
    """How far the prefill of a generation's prompt has come, in llama-server's prompt_progress
    terms: the prompt's tokens (total), those a cache held (cache), those in the context now,
    the cached ones included (processed), and the milliseconds the prefill has taken."""

    total: int
    cache: int
    processed: int
    time_ms: float

    def as_dict(self) -> dict:
        return {"total": self.total, "cache": self.cache, "processed": self.processed,
                "time_ms": round(self.time_ms, 3)}


class ProgressReport:
    """The target's prefill counts (runtime.protocols.Progress) as PromptProgress for a
    generation's on_progress: the first count is what a cache held, each new count one more
    event, and done() ends on the whole prompt (reused whole, or decoded by a host that tells
    only the end)."""

    def __init__(self, on_progress: Callable[[PromptProgress], None], n_total: int):
        self._on_progress, self._n_total = on_progress, n_total
        self._t_start = time.perf_counter()
        self._n_cache: Optional[int] = None
        self._n_last = -1

    def __call__(self, n_cached: int) -> None:
        if n_cached == self._n_last:
            return
        if self._n_cache is None:
            self._n_cache = n_cached
        self._n_last = n_cached
        self._on_progress(PromptProgress(self._n_total, self._n_cache, n_cached,
                                         (time.perf_counter() - self._t_start) * 1000))

    def done(self) -> None:
        self(self._n_total)


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
