"""Work that waits for the process to be idle: measurements a request found missing, and the
draft catching up with the last conversation.

A request never waits for a measurement: where one is missing it decodes as plain decoding
would there, and the measurement is queued here. A daemon thread runs the queue while no
generation runs (the server between requests, `specllama chat` while the person types, a
script between calls), a short grace after the last generation so back-to-back requests do
not collide with it. Work checks `stop()` between llama.cpp calls: a generation that wants the
models makes the work in progress end early (restoring what it changed) and retry later, so a
request waits one decode at most. A measurement the machine disturbed (it returns False) is
retried later, waiting longer each time (10 s, 20 s, ... up to 5 minutes), so probes never keep a
busy machine busier; and no work starts while other processes hold the cores its llama.cpp threads
need (cores.py): it would time them, and slow them down. Work in progress ends early the same way
when another process starts using them. warm_up() runs the whole queue in the
caller's thread, at once.
"""

from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

from .cores import SPARE_CORES, OthersArrive, cores_used_by_others
from ..runtime.batches import Interrupted
from ..runtime.decoder import DECODER

log = logging.getLogger("specllama")

GRACE_SECONDS = 0.5  # idle this long after a generation before work starts
BUSY_RETRY_SECONDS = 10.0  # a disturbed measurement waits this long, doubling each time,
BUSY_RETRY_MAX_SECONDS = 300.0  # up to this
NOT_READY_POLL_SECONDS = 1.0  # a task waiting for a longer context looks again (a generation notifies sooner)
BUSY_POLL_SECONDS = 5.0  # while other processes hold the cores, look again this often


def idle_wanted(default: bool) -> bool:
    """Whether an object runs idle work in a thread of its own: SPECLLAMA_IDLE_WORK=1 or 0 in the
    environment decides for a whole process tree; otherwise default (off for load(): a library
    that decodes in the background competes with its host's own threads, which idle work cannot
    see (a llama_cpp.Llama beside one ran at 0.61 of its speed); on for `specllama serve` and
    `specllama chat`, which own their process)."""
    setting = os.environ.get("SPECLLAMA_IDLE_WORK", "").strip()
    return default if setting == "" else setting != "0"


class _Process:
    """llama.cpp work in this process: loads, generations and explicit measurements run side by
    side as before, and idle work (any SpecLlama's) runs only while none of them does. Two
    objects' idle threads decoding while a third model loaded crashed llama.cpp (a segfault in
    llama_decode during llama_model_load), so idle work is exclusive process-wide and yields
    to any of them at its next decode."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        # guarded by _cv: the two below (one per process, whatever object or thread asks)
        self._n_active = 0  # loads and generations running or waiting
        self._idle = False  # one object's idle work is running

    @contextmanager
    def busy(self) -> Iterator[None]:
        """Around a load, a generation, warm_up(), close(): idle work anywhere ends first."""
        with self._cv:
            self._n_active += 1
            while self._idle:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._n_active -= 1
                self._cv.notify_all()
                if not self._n_active and not self._idle:
                    DECODER.rest()  # nothing of ours decodes now: the host's own threads get the cores

    @property
    def working(self) -> bool:
        """Whether an object's idle work is running now."""
        return self._idle

    def try_idle(self) -> bool:
        with self._cv:
            if self._n_active or self._idle:
                return False
            self._idle = True
            return True

    def end_idle(self) -> None:
        with self._cv:
            self._idle = False
            self._cv.notify_all()
            if not self._n_active:
                DECODER.rest()

    def wanted(self) -> bool:
        return self._n_active > 0


PROCESS = _Process()


class Preempted(Interrupted):
    """A generation wants the models: the work ends early, to be retried when idle again (raised
    between two batches of one decode, in_pieces, it keeps those decoded: runtime.batches)."""


class _Yield:
    """Whom a runtime passes the turn to while idle work decodes (runtime/protocols.Beside): pieces, as if
    others generated, and stop() looked at between them."""

    def __init__(self, stop: Callable[[], bool]):
        self._stop = stop

    def n_others(self) -> int:
        return 1

    def pass_turn(self) -> None:
        if self._stop():
            raise Preempted()


@contextmanager
def in_pieces(runtime: Any, n_piece: int, stop: Callable[[], bool]) -> Iterator[None]:
    """Idle work's long decodes on runtime go in pieces of n_piece rows and up (where measured to
    be the whole chunks bit for bit, concurrency_probes.py; 0: chunks stay whole), stop() looked at
    between them: a request that arrives meanwhile waits a piece (about runtime/batches.PIECE_SECONDS),
    not a chunk (2.4 s for the 0.5B draft's 512 rows on 2 cores). The pieces decoded before a stop
    stay: the work goes on from there."""
    with runtime.passing_turns(_Yield(stop), n_piece):
        yield


@dataclass
class Task:
    """One piece of idle work: run(stop) does it (raising Preempted when stop() says so, and
    returning False when it should run again later: a measurement the machine disturbed);
    ready() says whether it can run now (a probe at a KV length needs a context that long)."""

    key: str
    run: Callable[[Callable[[], bool]], Optional[bool]]
    ready: Callable[[], bool] = lambda: True
    what: str = ""  # for the log line
    n_tries: int = 0
    # it decodes from position 0 (the conversation is saved to RAM first): it runs after the
    # work that measures on the live conversation's own tokens, which it would take away
    takes_context: bool = False
    # how deep into the live conversation it measures (a KV group): a probe leaves the cache cut
    # at its own depth, so deeper ones run first, while the conversation still reaches them
    depth: int = 0
    # it brings a context back to the conversation (the draft catching up): it runs after the
    # work that takes the context, which would undo it (the costs probe ran after the catch-up
    # and warm_up() left the draft empty: a chat's next turn at 2,900 tokens never drafted)
    restores: bool = False
    n_disturbed: int = 0  # runs the machine disturbed (run returned False)
    not_before: float = 0.0  # monotonic time before which the idle thread leaves it (warm_up does not)
    # idle this long before the idle thread starts it: work with one long llama.cpp call that
    # cannot stop midway (a whole prefill chunk measured against its pieces) waits for a quiet
    # longer than between a chat UI's or an agent's back-to-back requests, which it would delay
    quiet: float = GRACE_SECONDS
    # it measures what only requests side by side, or later idle work, use (a prefill in
    # pieces): a one-shot command, one request and gone, leaves it (warm_up(alone=True))
    beside: bool = False


class IdleWork:
    """The queue of idle work of one SpecLlama and the thread that runs it.

    models: the lock whoever uses the models holds (a generation, or a step of idle work);
    wanted(): whether a generation is waiting for it or running; n_threads: the threads its
    llama.cpp work runs on, which other processes must leave the cores for (None: no check).
    """

    MAX_TRIES = 20  # a task preempted this often is left for warm_up()

    def __init__(self, models: Any, wanted: Callable[[], bool], start: bool = True,
                 n_threads: Optional[int] = None):
        self._models, self._wanted, self._n_threads = models, wanted, n_threads
        self.cores_taken = False  # other processes held the cores at the last look (the log line says so once)
        self._cv = threading.Condition()
        # guarded by _cv: the three below; a task itself runs in the models' turn (self._models)
        self._tasks: dict[str, Task] = {}
        self._closed = False
        self._last_busy = time.monotonic()
        self.done: list[str] = []  # what ran, in order (what doctor and tests read)
        self._thread: Optional[threading.Thread] = None
        if start:
            self._thread = threading.Thread(target=self._loop, name="specllama-idle", daemon=True)
            self._thread.start()

    def add(self, task: Task) -> None:
        """Queue task unless one with its key is queued already."""
        with self._cv:
            if task.key not in self._tasks and not self._closed:
                self._tasks[task.key] = task
                self._cv.notify_all()

    def pending(self, alone: bool = False) -> list[str]:
        """What is queued, in words (alone: what one request at a time uses, which
        warm_up(alone=True) runs)."""
        with self._cv:
            return [t.what or t.key for t in self._tasks.values() if not (alone and t.beside)]

    def busy(self) -> None:
        """A generation just ran: wait a grace period before idle work starts again."""
        with self._cv:
            self._last_busy = time.monotonic()
            self._cv.notify_all()

    def warm_up(self, alone: bool = False) -> list[str]:
        """Run every queued task that can run (alone: those one request at a time uses), now,
        in this thread; what ran."""
        ran: list[str] = []
        beside = {t.key for t in list(self._tasks.values()) if t.beside} if alone else set()
        # a task a later one queued again (the costs probe takes the draft's context) runs again, once
        while (task := self._first_ready({key for key in ran if ran.count(key) > 1} | beside)) is not None:
            with self._models, PROCESS.busy():
                if not self._run(task, lambda: False):
                    break
            ran.append(task.key)
        return ran

    def _first_ready(self, skip: Optional[set[str]] = None, now: Optional[float] = None,
                     quiet: float = math.inf) -> Optional[Task]:
        """The task to run next: one that can run now, those measuring on the live conversation
        (deepest first) before those that take the context from it, and those that restore it
        last; now: leave those whose retry after a disturbed run is not due, and those that want
        a longer quiet than the seconds since the last generation (warm_up() runs them anyway)."""
        skip = skip or set()
        tasks = sorted((t for t in list(self._tasks.values()) if t.key not in skip and t.n_tries < self.MAX_TRIES
                        and (now is None or t.not_before <= now) and t.quiet <= quiet),
                       key=lambda t: (t.restores, t.takes_context, -t.depth))
        return next((t for t in tasks if t.ready()), None)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._tasks.clear()
            self._cv.notify_all()

    def _next(self) -> Optional[Task]:
        """The next task once the process is idle (None: closed)."""
        with self._cv:
            while True:
                if self._closed:
                    return None
                now = time.monotonic()
                quiet = now - self._last_busy
                task = self._first_ready(now=now, quiet=quiet) if not self._wanted() else None
                if task is not None:
                    return task
                # nothing can run yet: look again after the grace, when a retry is due, or a
                # while later (a probe waits for a context long enough; a new generation or
                # task notifies)
                self._cv.wait(timeout=self._wait_seconds(now, quiet) if self._tasks else None)

    def _wait_seconds(self, now: float, quiet: float) -> float:
        if quiet < GRACE_SECONDS:
            return max(0.05, GRACE_SECONDS - quiet)
        due = [t.not_before - now for t in self._tasks.values() if t.not_before > now]
        due += [t.quiet - quiet for t in self._tasks.values() if t.quiet > quiet]
        return max(0.05, min([NOT_READY_POLL_SECONDS, *due]))

    def _loop(self) -> None:
        while (task := self._next()) is not None:
            if self._cores_taken():
                continue
            if not self._models.acquire(blocking=False):
                self.busy()
                continue
            try:
                if not PROCESS.try_idle():
                    self.busy()
                    continue
                try:
                    if not self._wanted():
                        self._run_yielding(task)
                finally:
                    PROCESS.end_idle()
            finally:
                self._models.release()

    def _run_yielding(self, task: Task) -> None:
        """Run task until a generation wants the models or another process the cores. After the
        latter it waits a random while (0.2-1x BUSY_POLL_SECONDS): two processes' idle work
        started together meets again at every retry where both wait the same grace."""
        others = OthersArrive(self._n_threads) if self._n_threads else None
        if self._run(task, lambda: self._wanted() or PROCESS.wanted() or (others is not None and others())):
            return
        if others is not None and others.arrived:
            with self._cv:
                task.not_before = max(task.not_before,
                                      time.monotonic() + random.uniform(0.2, 1.0) * BUSY_POLL_SECONDS)

    def _cores_taken(self) -> bool:
        """Whether other processes hold the cores our threads need; if so every task waits
        BUSY_POLL_SECONDS before it is looked at again."""
        excess = cores_used_by_others(self._n_threads) if self._n_threads else None
        taken = excess is not None and excess > SPARE_CORES
        if taken and not self.cores_taken:
            log.info("idle work waits: other processes use %.1f of the cores its %d threads need",
                     excess, self._n_threads)
        self.cores_taken = taken
        if taken:
            due = time.monotonic() + BUSY_POLL_SECONDS
            with self._cv:
                for t in self._tasks.values():
                    t.not_before = max(t.not_before, due)
        return taken

    def _run(self, task: Task, stop: Callable[[], bool]) -> bool:
        """Run task (the models' lock held); whether it completed."""
        if task.key not in self._tasks or not task.ready():
            return False
        task.n_tries += 1
        t0 = time.perf_counter()
        try:
            if task.run(stop) is False:
                task.n_disturbed += 1
                task.not_before = time.monotonic() + min(BUSY_RETRY_MAX_SECONDS,
                                                         BUSY_RETRY_SECONDS * 2 ** (task.n_disturbed - 1))
                self.busy()
                return False
        except Preempted:
            self.busy()
            return False
        except Exception as e:  # a measurement that fails is reported, never fatal to the process
            log.warning("idle work %s failed: %s", task.what or task.key, e)
        with self._cv:
            self._tasks.pop(task.key, None)
            self.done.append(task.key)
        if task.what:
            log.debug("%s took %.1f s (while idle)", task.what, time.perf_counter() - t0)
        return True
