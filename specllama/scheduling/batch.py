"""Many prompts at once on a SpecLlama: submit() and generate_batch(), each prompt a generation
on the one generate path, in a slot of its own (slots.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from ..options import Prompt
    from .slots import Pool
    from ..streams import Result, Stream


class BatchApi:
    """submit() and generate_batch(), as a SpecLlama has them."""

    # what the SpecLlama it is part of provides
    pool: "Pool"
    stream: "Callable[..., Stream]"
    _executor: Optional[ThreadPoolExecutor] = None
    _executor_lock = threading.Lock()

    def submit(self, prompt: "Prompt", **options: Any) -> "Future[Result]":
        """generate() in a worker thread: a Future of its Result (or of the error it raised).
        Options are checked now, in the caller's thread. Up to n_parallel submitted prompts
        decode side by side, each with the output it has alone; the rest wait their turn."""
        stream = self.stream(prompt, **options)
        return self._workers().submit(_finish, stream)

    def generate_batch(self, prompts: Sequence["Prompt"], **options: Any) -> "list[Result]":
        """generate() on every prompt (the same options for all), side by side: the Results in
        the prompts' order. Every prompt and the options are checked before any decodes."""
        streams = [self.stream(prompt, **options) for prompt in prompts]
        futures = [self._workers().submit(_finish, stream) for stream in streams]
        return [future.result() for future in futures]

    def _workers(self) -> ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.pool.slots.n_max, thread_name_prefix="specllama-submit")
            return self._executor

    def _stop_workers(self) -> None:
        """Submitted prompts not started yet are cancelled (their futures say so)."""
        with self._executor_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)


def _finish(stream: "Stream") -> "Result":
    for _ in stream:
        pass
    assert stream.result is not None
    return stream.result


@dataclass(frozen=True)
class Timing:
    """One streamed request of time_requests(), in seconds from the moment all were sent."""

    first_token_s: float
    total_s: float
    n_tokens: int
    text: str


def time_requests(llm: Any, prompts: Sequence["Prompt"], together: bool, **options: Any) -> tuple[list[Timing], float]:
    """Stream every prompt, sent at the same moment: at once (a thread each) or one after another
    (each waiting for the one before, as a server with one slot makes them). The Timings in the
    prompts' order, and the seconds until the last ended. For benchmarks and `bench --parallel`."""
    timings: list[Optional[Timing]] = [None] * len(prompts)
    errors: list[BaseException] = []
    t0 = time.perf_counter()

    def one(i: int) -> None:
        first, texts, n_tokens = None, [], 0
        try:
            for chunk in llm.stream(prompts[i], **options):
                if first is None and chunk.tokens:
                    first = time.perf_counter() - t0
                texts.append(chunk.text)
                n_tokens += len(chunk.tokens)
        except BaseException as e:  # raised in the caller's thread below
            errors.append(e)
            return
        end = time.perf_counter() - t0
        timings[i] = Timing(end if first is None else first, end, n_tokens, "".join(texts))

    if together:
        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            while thread.is_alive():
                thread.join(0.2)  # Ctrl-C reaches the calling thread meanwhile
    else:
        for i in range(len(prompts)):
            one(i)
    if errors:
        raise errors[0]
    return [t for t in timings if t is not None], time.perf_counter() - t0
