"""Slots: the contexts requests decode in side by side, and the turn their rounds take.

A slot is a target context and a draft context on the models a SpecLlama loaded (the weights
shared, only the KV caches new). The first slot is the contexts load() made; more are made
when a request arrives while every slot generates, up to n_parallel. Each request decodes in a
slot of its own, exactly as it would alone: its rounds are the same batches on a KV cache that
holds only its own tokens, so its output is the one it would have alone, at every fidelity
level. The rounds of all requests take turns on the models in arrival order (Turns): on a
machine whose decode already uses every core, running two at once only stalls both.

With batch_requests a second group of slots exists (Pool.lanes, sharing.py): lanes of shared
contexts, whose rounds park their passes so that one pass decodes every lane's rows.

The prompt cache's saved states belong to all slots of a model (any slot can restore a state
another saved), and a request is handed the free slot whose live sequence shares the longest
prefix with its prompt; among lanes, a new one where that would drop more of another
conversation than the prompt keeps, and too little for the prompt cache to save (Slot.drops).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional

import psutil

from ..errors import BusyError, InvalidParameterError
from ..measuring.idle import PROCESS
from ..caching.prompt_cache import MIN_SAVE, Budget, PromptCache
from ..runtime.protocols import SlotUnavailable
from ..runtime.protocols import Beside, Drafter, Model
from ..runtime.session import common_prefix

log = logging.getLogger("specllama")

# a slot beyond the first is made only while this many times its size stays free
RAM_HEADROOM = 2.0


class Turns:
    """A lock handed out in arrival order: threading.Lock lets a thread that releases it and
    asks again at once keep it, so the first request would starve a second one."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        # guarded by _cv: the three below
        self._holder: Optional[int] = None  # the thread holding the turn
        self._queue: deque[object] = deque()
        self._lost: set[int] = set()  # threads whose pass_turn() was interrupted before taking it back

    @property
    def _held(self) -> bool:
        return self._holder is not None

    def acquire(self, blocking: bool = True) -> bool:
        with self._cv:
            if not self._held and not self._queue:
                self._holder = threading.get_ident()
                return True
            if not blocking:
                return False
            me = object()
            self._queue.append(me)
            try:
                while self._held or self._queue[0] is not me:
                    self._cv.wait()
            except BaseException:  # interrupted while waiting: give up the place in the queue
                self._queue.remove(me)
                self._cv.notify_all()
                raise
            self._queue.popleft()
            self._holder = threading.get_ident()
            return True

    def release(self) -> None:
        """Give the turn up. RuntimeError for a thread not holding it, but once after its
        pass_turn() was interrupted while it waited to take the turn back (its with-block's
        release then has nothing to give up)."""
        me = threading.get_ident()
        with self._cv:
            if self._holder == me:
                self._holder = None
                self._cv.notify_all()
            elif me in self._lost:
                self._lost.discard(me)
            else:
                raise RuntimeError("the models' turn released by a thread that does not hold it")

    def n_waiting(self) -> int:
        """Threads waiting for the turn."""
        with self._cv:
            return len(self._queue)

    def holding(self) -> bool:
        """Whether this thread holds the turn."""
        with self._cv:
            return self._holder == threading.get_ident()

    def pass_turn(self) -> None:
        """(the turn held) Let the threads waiting for it go first, then take it back: a long
        prefill does this between its chunks, so the requests streaming beside it go on."""
        with self._cv:
            if not self._queue or self._holder != threading.get_ident():
                return
        self.release()
        try:
            self.acquire()
        except BaseException:  # not holding it now: the caller's release has nothing to give up
            with self._cv:
                self._lost.add(threading.get_ident())
            raise

    def __enter__(self) -> "Turns":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class Slot:
    """One request's contexts: the target's and the draft's, each with its prompt cache."""

    index: int
    target: Model
    draft: Optional[Drafter]
    target_cache: PromptCache
    draft_cache: Optional[PromptCache]
    owner: Optional[int] = None  # the thread generating in it (None: free)
    n_bytes: int = 0  # what making it took (RAM); 0 for the first slot
    lane: bool = False  # its target is a lane of the shared context (rows share passes)

    def drops(self, prompt: list[int], scope: str = "") -> bool:
        """Whether prefilling prompt here drops another conversation: more of the live sequence
        than the prompt keeps of it, and too little for the prompt cache to save (under
        MIN_SAVE: a chat UI's title and its answer). A conversation's next turn, or the same
        prompt asked again, keeps more than it drops unless the prompt is shorter than the answer
        after it; then the new lane prefills only that short prompt, and the answer stays live."""
        cached = self.target.cached
        n_keep = min(common_prefix(cached, prompt), len(prompt) - 1) if self.target_cache.scope == scope else 0
        return n_keep < len(cached) - n_keep < MIN_SAVE

    @contextmanager
    def passing_turns(self, beside: Beside, n_piece: Callable[[Any], int]) -> Iterator[None]:
        """Within (while a generation owns the slot, as nothing else decodes in it then): the
        other generations this slot's runtimes pass the turn to between the chunks of a long
        decode, and the rows their chunks go in pieces of while others generate (n_piece(runtime);
        0: whole chunks)."""
        with ExitStack() as stack:
            for runtime in (self.target, self.draft):
                if runtime is not None:
                    stack.enter_context(runtime.passing_turns(beside, n_piece(runtime)))
            yield

    def close(self) -> None:
        for runtime in (self.draft, self.target):
            if runtime is not None:
                runtime.close()


@dataclass
class Slots:
    """The slots of one SpecLlama; `first` is load()'s contexts. n_max: how many slots it may
    have (1 where a second context cannot be made: note says why)."""

    first: Slot
    n_max: int
    budget: Budget
    note: str = ""
    more: list[Slot] = field(default_factory=list)
    # a new slot's target and draft: contexts of their own (None), or lane i of shared contexts
    lane_of: Optional[Callable[[int], Model]] = None
    draft_lane_of: Optional[Callable[[int], Drafter]] = None

    @property
    def all(self) -> list[Slot]:
        return [self.first, *self.more]

    @property
    def n_busy(self) -> int:
        return sum(slot.owner is not None for slot in self.all)

    def free_for(self, prompt: list[int], scope: str = "") -> Optional[Slot]:
        """The free slot whose live sequence shares the most with prompt, of those in the
        prompt's cache scope (None: all busy)."""
        free = [slot for slot in self.all if slot.owner is None]
        return max(free, key=lambda slot: common_prefix(slot.target.cached, prompt)
                   if slot.target_cache.scope == scope else 0, default=None)

    def ram_short(self) -> str:
        """Why the RAM free now is too little for one more slot ("" where it is enough)."""
        last = self.more[-1].n_bytes if self.more else 0
        free = psutil.virtual_memory().available
        if last and free < RAM_HEADROOM * last:
            return (f"{free / 2**20:.0f} MiB of RAM free, under {RAM_HEADROOM:.0f}x the {last / 2**20:.0f} MiB a "
                    "slot takes")
        return ""

    def grow(self, owner: int) -> Slot:
        """A new slot, owner's from the start: contexts on the same models (call with the
        models' turn held: llama.cpp makes a context while nothing decodes). It is visible to
        free_for() once appended, so it is owned before: a request woken meanwhile took a slot
        made for another, and both decoded in it."""
        first = self.first
        make = self.lane_of if self.lane_of is not None else lambda _: first.target.sibling()
        target: Any = make(len(self.all))
        draft: Any = None
        try:
            if self.draft_lane_of is not None:
                draft = self.draft_lane_of(len(self.all))
            elif first.draft is not None:
                draft = first.draft.sibling()
        except BaseException:
            if self.lane_of is None:
                target.close()
            raise
        n_bytes = sum(rt.memory_use.total for rt in (target, draft) if rt is not None and rt.memory_use is not None)
        slot = Slot(len(self.all), target, draft, PromptCache(target, self.budget, owner=first.target_cache),
                    None if draft is None or first.draft_cache is None
                    else PromptCache(draft, self.budget, owner=first.draft_cache), n_bytes=n_bytes,
                    lane=first.lane)
        slot.owner = owner
        self.more.append(slot)
        log.info("%s: a request decodes in %s %d, beside %d others (%s)", first.target.name,
                 "lane" if slot.lane else "slot", slot.index, len(self.all) - 1,
                 "its rows share passes" if slot.lane else f"{n_bytes / 2**20:.0f} MiB for its contexts")
        return slot

    def close_more(self) -> None:
        """Free the slots beyond the first (before the models the first slot's runtimes own)."""
        for slot in self.more:
            slot.close()
        self.more.clear()


def why_single(target: Model, draft: Optional[Drafter]) -> str:
    """Why requests on these models decode one at a time ("" where slots can be made)."""
    for runtime in (target, draft):
        if runtime is not None and runtime.why_no_sibling:
            return runtime.why_no_sibling
    return ""


class Pool:
    """Who generates where: the slots, the streams open in them, and the models' turn (each
    generation's rounds, idle work's steps and exclusive() take it)."""

    def __init__(self, slots: Slots, idle_busy: Callable[[], None]):
        self.slots, self._idle_busy = slots, idle_busy
        self.lanes: Optional[Slots] = None  # slots on the shared context (sharing.py), where made
        self.turn = Turns()
        # rows a model's prefill chunks go in pieces of beside others (by identity; measured bitwise
        # by the piece probe, concurrency_probes.py); unmeasured models prefill whole chunks
        self.pieces: dict[str, int] = {}  # guarded by turn: written by idle work's probe, read by decodes
        self._cv = threading.Condition()
        self.streams: weakref.WeakSet[Any] = weakref.WeakSet()  # open ones: dropped ones close as they go
        # guarded by _cv: the three below, and which slot a generation owns (Slot.owner)
        self.n_generating = 0  # generations holding or waiting for a slot
        self._n_growing = 0  # slots being made
        self._exclusive = False

    def n_piece(self, runtime: Any) -> int:
        return self.pieces.get(runtime.identity, 0)

    def n_others(self) -> int:
        """(a generation's thread) The other generations running or waiting for a slot: a stream
        between two rounds is not waiting for the turn, but comes back for it at once."""
        return max(0, self.n_generating - 1)

    def pass_turn(self) -> None:
        self.turn.pass_turn()

    @contextmanager
    def generation(self, prompt: list[int], check_open: Callable[[], None], lane: bool = False,
                   scope: str = "") -> Iterator[Slot]:
        """A slot for a generation, for as long as it runs (a lane where lane and the
        lanes exist): the free one sharing the most with prompt, a new one while under n_max, or
        the next to be freed by another thread. BusyError while exclusive(), or when this
        thread's own open streams hold every slot."""
        me = threading.get_ident()
        group = self.lanes if lane and self.lanes is not None else self.slots
        with self._cv:
            slot = self._take(group, prompt, me, scope)
            self.n_generating += 1
        try:
            with PROCESS.busy():  # idle work anywhere in the process ends first
                while slot is None:  # a new slot, made in the models' turn
                    slot = self._grow(group, me, prompt, check_open, scope)
                check_open()  # closed while it waited to start
                with slot.passing_turns(self, self.n_piece):
                    yield slot
        finally:
            with self._cv:
                if slot is not None:
                    slot.owner = None
                self.n_generating -= 1
                self._cv.notify_all()
            self._idle_busy()

    def _take(self, slots: Slots, prompt: list[int], me: int, scope: str) -> Optional[Slot]:
        """(the condition held) A free slot now, or None with a new one reserved; waits for
        one that another thread frees."""
        while True:
            if self._exclusive:
                raise BusyError("this SpecLlama's models are in exclusive use (a calibration or doctor); "
                                "generate once it ends")
            slot = slots.free_for(prompt, scope)
            # a lane costs no memory: another is made rather than drop a short conversation the
            # prompt cache would not save (the chat UI's title, asked again with its next turn)
            if (slot is None or slot.lane and slot.drops(prompt, scope)) and self._can_grow(slots):
                self._n_growing += 1
                return None
            if slot is not None:
                slot.owner = me
                return slot
            if all(s.owner == me for s in slots.all) and not self._n_growing:
                n = len(slots.all)
                why = f" ({slots.note})" if slots.note else ""
                raise BusyError(f"this SpecLlama is generating in all its {n} slot{'s' * (n > 1)}{why}, for "
                                "streams this thread holds open; finish or close() one of them first"
                                + ("" if slots.note else ", or load() with a larger n_parallel"))
            self._cv.wait()

    def _can_grow(self, slots: Slots) -> bool:
        """(the condition held) Whether a slot may be made now: under n_max, with the RAM for it
        (where it is short, n_max is lowered to the slots there are)."""
        if len(slots.all) + self._n_growing >= slots.n_max:
            return False
        short = slots.ram_short()
        if short:
            slots.n_max = len(slots.all)
            log.warning("%s: %s; serving at most %d requests at once", slots.first.target.name, short, slots.n_max)
        return not short

    def _grow(self, slots: Slots, me: int, prompt: list[int], check_open: Callable[[], None],
              scope: str) -> Optional[Slot]:
        """A new slot owned by me; where llama.cpp cannot make one, no more are tried and the
        next free slot is waited for (None: take again)."""
        new: Optional[Slot] = None
        try:
            with self.turn:
                check_open()
                new = slots.grow(me)
        except (SlotUnavailable, InvalidParameterError) as e:
            log.warning("%s: no further slot (%s); requests beyond %d wait for one to be free",
                        slots.first.target.name, e, len(slots.all))
        finally:
            with self._cv:
                self._n_growing -= 1
                if new is None:
                    slots.n_max = len(slots.all)
                self._cv.notify_all()
        if new is not None:
            return new
        with self._cv:
            return self._take(slots, prompt, me, scope)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """The models to the caller alone (BusyError while anything generates)."""
        with self._cv:
            if self.n_generating:
                raise BusyError("this SpecLlama is generating (another thread, or a stream that is still open); "
                                "finish or close() that stream first")
            self._exclusive = True
        try:
            with self.turn, PROCESS.busy():
                yield
        finally:
            with self._cv:
                self._exclusive = False
            self._idle_busy()

    def open(self, stream: Any) -> None:
        """A stream end_all() closes once started (held weakly: one its caller drops is freed)."""
        with self._cv:
            self.streams.add(stream)

    def end_all(self) -> None:
        """Close every open stream (from any thread) and wait until no generation runs."""
        for stream in list(self.streams):
            if stream.started:  # one never started raises ClosedError when it is
                stream.close()
        with self._cv:
            while self.n_generating:
                self._cv.wait(timeout=0.1)
