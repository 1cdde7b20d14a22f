"""A request's generation in a worker thread, and the server's slot it holds while it runs.

The event loop never decodes: a Job runs the request's work in a thread of its own, passes what
it emits to the loop through a queue, and releases the turn when it ends. When the client goes
away (a closed stream, or a non-streamed request whose client gave up), cancel() stops the
generation at its next token and tells the work to start no other, so client timeouts and
retries do not pile up behind work nobody will read.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, Optional

from fastapi import Request

_ITEM, _RESULT, _ERROR = "item", "result", "error"


class ClientGone(Exception):
    """The client closed its connection before the response was ready."""


class Disconnect:
    """Done the moment the client closes its connection: once the body is read, the next ASGI
    message a request receives is its disconnect, so a task waiting for it learns at once."""

    def __init__(self, request: Request):
        self.task = asyncio.ensure_future(self._watch(request.receive))

    @staticmethod
    async def _watch(receive: Callable) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    @property
    def gone(self) -> bool:
        return self.task.done() and not self.task.cancelled()

    def close(self) -> None:
        self.task.cancel()


class ProgressEvents:
    """A streamed request's prompt_progress (its return_progress, as llama-server's): the
    stream's on_progress, passing each PromptProgress, shaped as the API's event, to the job.
    The stream (and its options) is made before its job exists: events start once work(job)
    has called start(job), which is before the prefill they report."""

    def __init__(self, shape: Callable[[Any], Any]):
        self._shape = shape
        self._job: Optional["Job"] = None

    def start(self, job: "Job") -> None:
        self._job = job

    def __call__(self, progress: Any) -> None:
        if self._job is not None:
            self._job.emit(self._shape(progress))


async def acquire(lock: asyncio.Semaphore, disconnect: Disconnect) -> bool:
    """Wait for a slot in arrival order; False, without it, if the client leaves first."""
    waiting = asyncio.ensure_future(lock.acquire())
    await asyncio.wait({waiting, disconnect.task}, return_when=asyncio.FIRST_COMPLETED)
    if waiting.done():
        return True
    waiting.cancel()
    try:
        await waiting
    except asyncio.CancelledError:
        return False
    lock.release()  # it was handed the lock as it was cancelled: give it back
    return False


class Job:
    """work(job) runs in a worker thread and returns the job's result; meanwhile it may
    job.emit(item) for a stream and must job.track(stream) each Stream it starts, so that
    cancel() reaches it. release() runs on the event loop when the work has ended; failed(e) in
    the worker thread when it raised e.

    At most max_unread emitted items wait for the stream's reader: past that the client reads
    slower than the model writes (or not at all), and the job is cancelled (overflowed) rather
    than hold its output in memory without bound."""

    def __init__(self, work: Callable[["Job"], Any], release: Callable[[], None],
                 failed: Callable[[BaseException], None] = lambda e: None, max_unread: int = 4096):
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self._streams: list[Any] = []
        self._release, self._failed = release, failed
        self._max_unread = max_unread
        self._n_unread = 0  # guarded by _unread_lock: emitted in the worker, read on the loop
        self._unread_lock = threading.Lock()
        self.overflowed = False  # cancelled for a reader that fell max_unread items behind
        self.finished = False  # the work has ended (on the event loop's side)
        self.disconnect: Optional[Disconnect] = None  # a non-streamed request's watch on its client
        threading.Thread(target=self._run, args=(work,), name="specllama-request", daemon=True).start()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self) -> None:
        self._cancel.set()
        for stream in list(self._streams):
            stream.cancel()

    def track(self, stream: Any) -> Any:
        self._streams.append(stream)
        if self.cancelled:
            stream.cancel()
        return stream

    def emit(self, item: Any) -> None:
        with self._unread_lock:
            if self.overflowed:
                return
            self._n_unread += 1
            self.overflowed = self._n_unread > self._max_unread
        if self.overflowed:
            self.cancel()
            return
        self._put((_ITEM, item))

    def _put(self, entry: tuple) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, entry)
        except RuntimeError:  # the event loop has closed: the server is shutting down
            pass

    def _run(self, work: Callable[["Job"], Any]) -> None:
        try:
            self._put((_RESULT, work(self)))
        except BaseException as e:  # reaches the request's handler, which maps it
            self._failed(e)
            self._put((_ERROR, e))
        finally:
            try:
                self._loop.call_soon_threadsafe(self._release)
            except RuntimeError:
                pass

    async def _next(self, getter: "asyncio.Future[tuple]") -> tuple:
        entry = await getter
        if entry[0] == _ITEM:
            with self._unread_lock:
                self._n_unread -= 1
        else:
            self.finished = True
        if entry[0] == _ERROR:
            raise entry[1]
        return entry

    async def items(self) -> AsyncIterator[Any]:
        """What the work emits, until it ends (its exception, if it raised, is raised here)."""
        while True:
            kind, value = await self._next(asyncio.ensure_future(self._queue.get()))
            if kind == _RESULT:
                return
            yield value

    async def result(self, disconnect: Disconnect) -> Any:
        """The work's result; ClientGone (the work cancelled) if the client leaves first."""
        while True:
            getter = asyncio.ensure_future(self._queue.get())
            await asyncio.wait({getter, disconnect.task}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
                self.cancel()
                raise ClientGone()
            kind, value = await self._next(getter)
            if kind == _RESULT:
                return value
