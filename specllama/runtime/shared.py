"""A target context shared by several requests: each a lane (sequences of its own), and the rows
the lanes decode in one round computed in one llama_decode.

Requests decode in the models' turn (slots.Turns), one round at a time. A lane that reaches
its target pass parks its batch and gives the turn to whoever waits for it; the thread that
parks while everyone waiting for the turn has parked too, and every generating lane has parked
or had a short grace to, decodes every parked batch (a pass per group: at most n_batch rows,
and no more rows than any member's cap, the largest pass its fidelity level allows at its KV
length), or a pass per batch where this context's passes were timed cheaper so (PassCosts).
A pass that cannot place its rows (llama_decode 1) is decoded again lane by lane,
so only the lane that does not fit fails.

Each lane's rows are copied out of the pass: they stay valid while other lanes decode.

A lane's rows are not bitwise those of a context of its own: other lanes' cells sit between
its cells in the unified KV buffer, which changes how llama.cpp's attention sums (measured by
calibrate.measure_apart_diff). Requests that need bitwise rows decode in contexts of their own.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import OrderedDict, deque
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from collections.abc import Callable, Sequence
from typing import Any, Optional

import llama_cpp
import numpy as np

from ..errors import DecodeError
from .decoder import llama_decode
from .handles import Batch, new_context

Item = tuple[int, int, tuple[int, ...], bool]

# a parked batch waits for lanes between rounds (emitting their tokens) at most this share of
# a pass, and at most GRACE_MAX seconds: riding in the next pass saves them a whole pass
GRACE_SHARE = 0.25
GRACE_MAX = 0.05


PASS_WINDOW = 9  # a shape's last passes, whose median stands for its cost
MAX_TIMED_ROWS = 64  # passes up to this many rows are timed by shape (longer: prompt chunks)
APART_MARGIN = 0.9  # passes of their own must cost under this share of the one pass
REFRESH_EVERY = 16  # of the groups decoded apart, one in this many together: its cost stays measured


def fair_room(cap: int, n_active: int, others: Sequence[int] = ()) -> int:
    """The rows a lane may plan to fill of a pass of at most cap rows beside the other lanes
    generating (n_active with its own), whose latest batches held `others` rows (the most recent
    first; a lane not seen counts as drafting): its share, cap // n_active, and its part of what
    the lanes decoding plainly (a batch of one row) leave of theirs, split among the drafting
    lanes; rows past it are priced as a pass of their own.

    Each lane planned its longest chain as if the rest of the pass were its own, so two lanes
    drafting 15-16 rows each overflowed F16's 17-row pass and decoded apart. Lending what a
    drafting lane left in its last batch overflowed as often (traced: a lane of 12 rows beside
    one back at 7 that had 2 the round before): lanes plan at once, so a share lent is taken
    back at once. A lane decoding plainly mostly stays plain (its drafts do not pay)."""
    if n_active <= 1:
        return cap
    fair = max(1, cap // n_active)
    n_plain = sum(n == 1 for n in list(others)[:n_active - 1])
    n_drafting = n_active - n_plain  # its own lane's among them
    return max(1, min(cap - (n_active - 1), fair + n_plain * (fair - 1) // n_drafting))


class PassCosts:
    """A context's passes timed by shape (rows, lanes), and whether a group's batches cost less
    in passes of their own. On our CPU one pass of two lanes' draft steps took 40-60 ms where
    each step alone took 16-20 (the 0.5B Q4_K_M draft: a pass of 2 rows takes about twice one,
    and rows of two sequences more), while the F16 target's two rows cost 1.4x its one."""

    def __init__(self) -> None:
        self._seen: dict[tuple[int, int], deque] = {}
        self._n_apart = 0

    def observe(self, n_rows: int, n_lanes: int, seconds: float) -> None:
        if n_rows <= MAX_TIMED_ROWS:
            self._seen.setdefault((n_rows, n_lanes), deque(maxlen=PASS_WINDOW)).append(seconds)

    def cost(self, n_rows: int, n_lanes: int) -> Optional[float]:
        """The median of the shape's last passes (None: fewer than three timed)."""
        seen = self._seen.get((n_rows, n_lanes))
        return statistics.median(seen) if seen is not None and len(seen) >= 3 else None

    def apart(self, sizes: list[int]) -> bool:
        """Whether batches of these sizes, each a lane's, go in passes of their own: where both
        ways were timed and apart costs clearly less. Untimed shapes go together (so they get
        timed), and one group in REFRESH_EVERY that would go apart too."""
        together = self.cost(sum(sizes), len(sizes))
        alone = [self.cost(n, 1) for n in sizes]
        if together is None or any(c is None for c in alone) or \
                sum(c for c in alone if c is not None) >= APART_MARGIN * together:
            return False
        self._n_apart += 1
        return self._n_apart % REFRESH_EVERY != 0


@dataclass(eq=False)
class _Job:
    """A lane's batch, parked until a pass decodes it."""

    items: list[Item]
    cap: int
    taken: bool = False
    done: bool = False
    status: int = 0
    why: str = ""  # what llama.cpp logged when its pass failed
    rows: dict[int, np.ndarray] = field(default_factory=dict)
    n_rows: int = 0
    seconds: float = 0.0  # the pass's llama_decode
    n_lanes: int = 1  # lanes whose rows were in the pass
    waited: float = 0.0  # seconds it waited, parked, for other lanes' rounds (not its pass's)

    def for_others(self, n_own: int) -> float:
        """Of the pass's seconds, the share of the other lanes' rows beside this lane's n_own: two
        draft lanes' steps in one pass of the 0.5B draft took 42-57 ms against 18 ms for one,
        and each lane priced its steps at the whole pass, so beside another it hardly drafted."""
        return self.seconds * max(0, self.n_rows - n_own) / self.n_rows if self.n_rows else 0.0


class Parking:
    """The shared contexts whose lanes' threads take one turn (a target's and its draft's): a
    batch parked in either counts as parked for both, so neither waits on a thread parked in
    the other."""

    def __init__(self) -> None:
        self.contexts: list[SharedContext] = []

    def n_parked(self) -> int:
        # (the turn held) each list is guarded by its context's _cv, and only the caller's is held:
        # taking the other's too could deadlock against a thread doing the same the other way
        # round. Every park and every flush happens with the models' turn held, as this read
        # does, so the count is exact but for an interrupted lane withdrawing its batch (outside
        # the turn), which only makes a grace wait shorter or longer.
        return sum(len(context._parked) for context in self.contexts)


@dataclass(frozen=True)
class Lane:
    """Where a Runtime decodes in a shared context: its first sequence, its share of the cells,
    the context that decodes its batches (shared.SharedContext), and the most rows a pass holding
    its rows may have where a decode names none (its context's default_cap). It is also what
    the loop plans a lane's rounds from (protocols.LaneLoad)."""

    shared: Any
    base: int
    n_ctx: int
    default_cap: int = 1

    def cap(self, cap: Optional[int]) -> int:
        """The most rows a pass holding a decode's rows may have: cap, or where the decode names
        none, the lane's default."""
        return self.default_cap if cap is None else cap

    def n_active(self) -> int:
        return max(1, self.shared.n_active())

    def room(self, cap: int) -> int:
        return int(self.shared.room(self.base, cap))


class SharedContext:
    """One context of the target's model for n_lanes lanes of n_branches sequences each, with
    n_ctx cells a lane (a unified KV buffer: a shared prefix is stored once per lane). any_pass:
    its lanes' decodes may ride in any pass (a draft's: its rows decide proposals only); else a
    lane's decode is alone unless it names a cap (a target's verify pass)."""

    def __init__(self, first: Any, n_lanes: int, any_pass: bool = False):
        settings = first.settings
        self.name, self.n_lanes, self.n_branches = first.name, n_lanes, first.n_branches
        self._stack = ExitStack()
        self._model = first.handles[0].view()  # the first runtime frees it
        self._first = first
        try:
            self._ctx = new_context(self._model, replace(settings, n_ctx=settings.n_ctx * n_lanes), self._stack,
                                    n_seq=max(2, n_lanes * self.n_branches), name=f"{first.name} (shared)")
            self.n_batch = int(llama_cpp.llama_n_batch(self._ctx.ptr))
            self._batch = Batch(self.n_batch, self._stack, max(2, n_lanes * self.n_branches))
        except BaseException:
            self._stack.close()
            raise
        self.n_vocab = first.n_vocab
        self.turn: Any = None  # the models' turn (slots.Turns); None: every batch decoded at once
        self._cv = threading.Condition()
        self._parked: list[_Job] = []  # guarded by _cv, as _t_pass, the counts and _rows_of below
        self.lanes: list[Any] = []  # guarded by the models' turn (a slot is made in it)
        self._lane_of = lambda base: Lane(self, base, settings.n_ctx, self.n_batch if any_pass else 1)
        self.n_active: Callable[[], int] = lambda: 1  # lanes generating now (set by their slots)
        self.parking = Parking()
        self.parking.contexts.append(self)
        self._t_pass = 0.0  # the last pass's seconds: how long a parked batch waits for others
        self.n_passes = 0  # llama_decode calls
        self.n_shared_passes = 0  # of them, passes with more than one lane's rows
        self.pass_costs = PassCosts()
        self._rows_of: OrderedDict[int, int] = OrderedDict()  # lane base: its latest batch's rows, oldest first

    def room(self, base: int, cap: int) -> int:
        """The rows the lane at base may plan for its next pass of at most cap rows (fair_room)."""
        with self._cv:
            others = [n for lane, n in reversed(self._rows_of.items()) if lane != base]
        return fair_room(cap, max(1, self.n_active()), others)

    def join(self, other: "SharedContext") -> None:
        """Park with other's lanes (one turn for both contexts)."""
        self.parking = other.parking
        self.parking.contexts.append(self)

    def lane(self, index: int) -> Any:
        """The Runtime on lane index (made on first use; IndexError past n_lanes)."""
        if not 0 <= index < self.n_lanes:
            raise IndexError(f"{self.name} has lanes 0..{self.n_lanes - 1}, not {index}")
        while len(self.lanes) <= index:
            first = self._first
            ctx = self._ctx.view()  # freed by close(), after every lane
            runtime = type(first)(self._model, ctx, first.name, ExitStack(), first.identity,
                                  first.settings.rollback, n_seq=self.n_branches,
                                  lane=self._lane_of(len(self.lanes) * self.n_branches))
            runtime.settings = first.settings
            self.lanes.append(runtime)
        return self.lanes[index]

    def load(self, index: int) -> Lane:
        """Lane index as a round plans on it (protocols.LaneLoad)."""
        lane = self.lane(index).lane
        assert lane is not None
        return lane

    def close(self) -> None:
        """Free the lanes' batches, then the context (the model stays with its first runtime)."""
        for runtime in self.lanes:
            runtime.close()
        self.lanes.clear()
        self._stack.close()

    # --- passes --------------------------------------------------------------------------------

    def decode(self, batch: Batch, cap: int, base: int = 0) -> _Job:
        """Decode the filled batch of the lane at base (call in the models' turn, which is held
        again on return): its job, done (status: llama_decode's; rows: its logits by batch row;
        the pass's rows, lanes and seconds; what it waited for other lanes)."""
        job = _Job(batch.items(), max(1, cap))
        t_parked = time.perf_counter()
        deadline = t_parked + min(GRACE_SHARE * self._t_pass, GRACE_MAX)
        with self._cv:
            self._rows_of.pop(base, None)
            self._rows_of[base] = len(job.items)
            self._parked.append(job)
            self._cv.notify_all()
        try:
            while True:
                now = self._now(job, deadline)
                if now:
                    self._flush()
                if job.done:
                    job.waited = max(0.0, time.perf_counter() - t_parked - job.seconds)
                    return job
                self.turn.release()  # the others' rounds reach their passes
                if now is None:  # no one waits for the turn: a lane between rounds may park soon
                    with self._cv:
                        self._cv.wait(max(0.0, deadline - time.perf_counter()))
                self.turn.acquire()
        except BaseException:
            self._withdraw(job)
            raise

    def _now(self, job: _Job, deadline: float) -> Optional[bool]:
        """(the turn held) Whether to decode the parked batches now: True when no one waits for
        the turn but parked lanes, and every lane generating has parked or its grace is over;
        None to wait for the lanes between rounds; False to let the waiting threads go first."""
        with self._cv:
            if job.done:
                return False
            n_waiting = 0 if self.turn is None else self.turn.n_waiting()
            n_parked = self.parking.n_parked()
            if n_waiting > n_parked - 1:
                return False
            if self._behind_drafts():
                return False
            if self.turn is None or n_parked >= self.n_active() or time.perf_counter() >= deadline:
                return True
            return None

    def _behind_drafts(self) -> bool:
        """Whether this (the target's) context lets the draft's parked steps go first: the
        lanes drafting then reach this pass too, and the machine stays busy while it waits."""
        first, *others = self.parking.contexts
        return self.turn is not None and first is self and any(context._parked for context in others)

    def _withdraw(self, job: _Job) -> None:
        """Interrupted while parked: take the batch back unless a pass is decoding it, then hold
        the turn again (the caller rolls its lane back, which touches the context)."""
        with self._cv:
            if job in self._parked:
                self._parked.remove(job)
        if self.turn is not None and not self.turn.holding():
            while True:
                try:
                    self.turn.acquire()  # waits for a pass decoding the batch to end
                    return
                except KeyboardInterrupt:
                    continue

    def _flush(self) -> None:
        with self._cv:
            jobs, self._parked = self._parked, []
            for job in jobs:
                job.taken = True
        try:
            for group in _groups(jobs, self.n_batch):
                if len(group) > 1 and self.pass_costs.apart([len(job.items) for job in group]):
                    for job in group:
                        self._run([job])
                else:
                    self._run(group)
        finally:
            with self._cv:
                for job in jobs:
                    if not job.done:  # an error mid-way: the rest report it
                        job.done, job.status = True, job.status or 2
                self._cv.notify_all()

    def _run(self, group: list[_Job]) -> None:
        status, why = self._decode(group)
        if status != 0 and len(group) > 1:  # which lane does not fit: each alone
            mem = llama_cpp.llama_get_memory(self._ctx.ptr)
            for job in group:
                p0 = min(pos for _, pos, _, _ in job.items)
                for seq in {s for _, _, seqs, _ in job.items for s in seqs}:
                    llama_cpp.llama_memory_seq_rm(mem, seq, p0, -1)
            for job in group:
                job.status, job.why = self._decode([job])
                job.done = True
            return
        for job in group:
            job.status, job.why, job.done = status, why, True

    def _decode(self, group: list[_Job]) -> tuple[int, str]:
        """One llama_decode of the group's rows: its status and what llama.cpp logged if it failed."""
        offset = 0
        for job in group:
            self._batch.fill_items(job.items, offset)
            offset += len(job.items)
        self._batch.c.n_tokens = offset
        t0 = time.perf_counter()
        status, why = llama_decode(self._ctx.ptr, self._batch.c)
        seconds = time.perf_counter() - t0
        self._t_pass = seconds
        self.n_passes += 1
        self.n_shared_passes += len(group) > 1
        if status != 0:
            return status, why
        self.pass_costs.observe(offset, len(group), seconds)
        n_rows, offset = offset, 0
        for job in group:
            job.n_rows, job.seconds, job.n_lanes = n_rows, seconds, len(group)
            for i, (_, _, _, keep) in enumerate(job.items):
                if keep:
                    ptr = llama_cpp.llama_get_logits_ith(self._ctx.ptr, offset + i)
                    if not ptr:
                        raise DecodeError(f"{self.name}: llama.cpp returned no logits for batch row {offset + i}")
                    job.rows[i] = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
            offset += len(job.items)
        return 0, ""


def _groups(jobs: list[_Job], n_batch: int) -> list[list[_Job]]:
    """Parked batches in passes, in arrival order: a pass holds at most n_batch rows and at most
    the cap of every batch in it (a batch over its own cap, a long prompt's chunk, goes alone)."""
    groups: list[list[_Job]] = []
    n, cap = 0, 0
    for job in jobs:
        size = len(job.items)
        if groups and n + size <= min(n_batch, cap, job.cap):
            groups[-1].append(job)
            n += size
            cap = min(cap, job.cap)
        else:
            groups.append([job])
            n, cap = size, job.cap
    return groups
