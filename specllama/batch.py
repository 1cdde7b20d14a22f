"""Many prompts at once on a SpecLlama: submit() and generate_batch(), each prompt a generation
on the one generate path, in a slot of its own (slots.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from .options import Prompt
    from .slots import Pool
    from .streams import Result, Stream


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
