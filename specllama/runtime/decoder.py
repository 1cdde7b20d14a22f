"""Every llama_decode of the process on one OS thread, whichever thread asks for it.

llama.cpp's CPU backend, built with OpenMP (as llama-cpp-python builds it), runs a graph on a
team of threads that belongs to the thread calling llama_decode; after a graph the team's
workers spin for a while before they sleep. Requests in threads of their own, calling in
turn, each wake a team of their own while the last caller's workers still spin on the cores
the new team needs, and every barrier of its graph stalls. Measured on our 2-core CPU, two
chat requests taking turns (F16 1.5B target, 0.5B draft, every llama_decode timed): the
draft's one-token step took 34-40 ms against 22-28 ms with one caller, and the pair ran at
0.75x one request after another; with every call made here, 21-23 ms and 0.92-1.05x.

The thread ends once no call has come for IDLE_EXIT_SECONDS, or REST_SECONDS after nothing
of specllama's runs in the process (rest(): no load, generation or idle work), and its OpenMP
team with it; the next call starts another. libgomp spins at its barriers only while it manages no more threads
than there are cores; a team that outlives its work (a thread that stays alive keeps one) makes
every graph of another thread's team sleep and wake at each barrier. Measured on our 2 cores
(Q4_K_M 1.5B, one token at 2,900 cached tokens): 48 ms on the main thread alone, 87 ms while a
second thread that had decoded was still alive, 51 ms once it had ended. So specllama, idle, does
not slow llama_cpp.Llama calls made on another thread of the same process.

The caller waits for its call as it would for the C call itself: a KeyboardInterrupt that
arrives meanwhile is raised once the call has returned, so nothing touches a context that
llama.cpp is still computing in.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, Optional

import llama_cpp

from ..errors import ContextFullError, DecodeError
from .ggml import LOG_SINK

IDLE_EXIT_SECONDS = 5.0
# after rest(): back-to-back generations (a script's loop) keep the thread, whose restart costs
# 1-1.6 ms (a thread and its OpenMP team; tiny model, 2 cores)
REST_SECONDS = 0.2


class _Call:
    __slots__ = ("fn", "args", "done", "result", "error")

    def __init__(self, fn: Callable[..., Any], args: tuple) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.result: Any = None
        self.error: Optional[BaseException] = None


class DecodeThread:
    """One daemon thread that makes the calls it is given, one at a time, in arrival order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cv = threading.Condition(self._lock)
        # guarded by _cv (its _lock): the four below
        self._calls: list[_Call] = []
        self._ident: Optional[int] = None  # the running thread's (None: none runs)
        self._pid: Optional[int] = None  # a forked child has no thread: it starts its own
        self._resting = False  # end the thread once its queue is empty (rest())

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args), made on the decode thread; its result, or its exception raised here."""
        if threading.get_ident() == self._ident:
            return fn(*args)
        call = _Call(fn, args)
        with self._cv:
            if self._ident is None or self._pid != os.getpid():
                self._start()
            self._calls.append(call)
            self._resting = False
            self._cv.notify()
        interrupted: Optional[BaseException] = None
        while not call.done.is_set():
            try:
                call.done.wait()
            except KeyboardInterrupt as e:  # raised when the call has returned, as the C call's would be
                interrupted = e
        if interrupted is not None:
            raise interrupted
        if call.error is not None:
            raise call.error
        return call.result

    def rest(self) -> None:
        """Nothing of specllama's runs in the process: the thread ends once no call came for
        REST_SECONDS, and its OpenMP team with it, instead of after IDLE_EXIT_SECONDS. A host's
        llama_cpp.Llama decoded at 0.71x its speed while the team of an idle SpecLlama's thread
        outlived its work."""
        with self._cv:
            self._resting = True
            self._cv.notify()

    def _start(self) -> None:
        self._calls.clear()
        self._pid = os.getpid()
        thread = threading.Thread(target=self._loop, name="specllama-decode", daemon=True)
        thread.start()
        self._ident = thread.ident

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._calls:
                    if not self._cv.wait(REST_SECONDS if self._resting else IDLE_EXIT_SECONDS) and not self._calls:
                        self._ident, self._resting = None, False  # under the lock: the next call starts a new thread
                        return
                call = self._calls.pop(0)
            try:
                call.result = call.fn(*call.args)
            except BaseException as e:  # handed to the caller
                call.error = e
            call.done.set()


DECODER = DecodeThread()


def llama_decode(ctx: Any, batch: Any) -> tuple[int, str]:
    """llama_cpp.llama_decode(ctx, batch) on the decode thread: its status, and what llama.cpp
    logged as an error meanwhile (why a batch failed; "" when nothing was)."""
    return DECODER.run(_decode, ctx, batch)


def _decode(ctx: Any, batch: Any) -> tuple[int, str]:
    with LOG_SINK.errors() as errors:
        status = int(llama_cpp.llama_decode(ctx, batch))
    return status, " ".join(" ".join(errors).split()) if status else ""


def check_status(status: int, why: str, name: str, pos: int, n_tokens: int) -> None:
    """Raise for a llama_decode status of n_tokens at pos (why: what llama.cpp logged)."""
    if status == 0:
        return
    if status == 1:
        raise ContextFullError(f"{name}: no KV cache slot for {n_tokens} tokens at position {pos}; "
                               "raise n_ctx or shorten the prompt")
    if status == 2:
        raise DecodeError(f"{name}: llama_decode was aborted")
    raise DecodeError(f"{name}: llama_decode failed with status {status} for {n_tokens} tokens at position {pos}"
                      + (f" (llama.cpp: {why})" if why else ""))
