"""Fidelity levels: how far a verify batch's logits may stray from single-token decoding.

llama.cpp picks kernels by batch size and by KV length. A row verified in a batch of b tokens
can therefore differ from the same row decoded alone. On our 2-core CPU, Q4_K rows move by
about 0.7 logits from 4-token batches on, F16 rows by about 0.02 from 2 tokens on. Once the
padded KV length reaches 512, every multi-token batch differs: single-token decoding then
takes flash attention's split-KV path (ggml-cpu ops.cpp) and batches do not.

So the difference is measured per batch size and per KV length (see calibrate.py), and each
level turns those measurements into a verify-size limit for every round:

    bitwise   only sizes whose rows were bitwise identical: greedy output is token for token
              plain decoding, at any context length; where no size is, decode plainly.
    rounding  sizes that differ by at most ROUNDING_BOUND logits (float rounding, not a
              different quantization path). Greedy output can then differ only where the
              target's top two logits are within twice that difference: near_ties counts them.
    off       no limit (llama.cpp's behaviour).

A float bound is also accepted: sizes that differ by at most that many logits.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, TypeVar

import numpy as np

from ..errors import InvalidParameterError
from ..decoding.limits import MAX_VERIFY
from ..runtime.batches import KV_PAD, kv_length

log = logging.getLogger("specllama")

# Measured with `specllama calibrate` on our 2-core CPUs (Intel Sapphire Rapids, AMD EPYC): F16
# rows differ by float rounding, 0.008-0.05 up to KV length 1024 and 0.105-0.129 at 1280-2048,
# growing with the length; Q4_K rows differ by 0.47-0.82 wherever another path runs (a
# different activation quantization, not rounding). 0.25 sits between the two, about 2x from
# each side.
ROUNDING_BOUND = 0.25
# the difference rows on a reused prompt cache are assumed to carry until it is measured at their
# KV length (measured here: Q4_K_M 0.33-0.52 logits, F16 0.010-0.071): near-ties are over-counted
# for a turn or two rather than missed, and output is what the reuse computes either way
ASSUMED_REUSE_DIFF = 1.0
UNLIMITED = 1 << 30


@dataclass(frozen=True)
class Level:
    """A fidelity level: the largest max |logit difference| a verify batch may have."""

    name: str  # "bitwise", "rounding", "off", or "bound" for a number the caller chose
    bound: float

    @property
    def limited(self) -> bool:
        return self.bound != math.inf

    def __str__(self) -> str:
        return f"bound {self.bound:g}" if self.name == "bound" else self.name


LEVELS = {"bitwise": Level("bitwise", 0.0), "rounding": Level("rounding", ROUNDING_BOUND),
          "off": Level("off", math.inf)}


def parse_level(exact: Any) -> Level:
    """"bitwise", "rounding", "off", a bound in logits, or True/False (bitwise/off)."""
    if isinstance(exact, bool):
        return LEVELS["bitwise" if exact else "off"]
    if isinstance(exact, str) and exact in LEVELS:
        return LEVELS[exact]
    if isinstance(exact, (int, float)) and math.isfinite(exact) and exact >= 0:
        return Level("bound", float(exact))
    raise InvalidParameterError("exact", exact, '"bitwise", "rounding" (default), "off", '
                                                "or a bound in logits >= 0")


def kv_group(n_kv: int) -> int:
    """KV lengths measured together: 256, 512, 768-1024, 1280-2048, ... (doubling)."""
    return max(0, math.ceil(math.log2(n_kv / KV_PAD)))


def group_label(group: int) -> str:
    top = KV_PAD << group
    return f"KV <= {top}" if group <= 1 else f"KV {(top >> 1) + KV_PAD}-{top}"


@dataclass(frozen=True)
class BatchDiffs:
    """Largest |logit difference| between rows verified in a batch of b tokens and the same rows
    decoded one at a time, at one KV length; diffs[b - 2] for b = 2, 3, ...

    Measurement stops at the first size over the bound it was taken for, so later sizes are
    unknown unless `complete`.
    """

    n_kv: int
    diffs: tuple[float, ...]
    complete: bool
    seconds: float = 0.0  # how long the measurement took
    verify_seconds: tuple[float, ...] = ()  # time of one decode of 1, 2, ... tokens, as measured

    def diff(self, n_batch: int) -> float:
        return 0.0 if n_batch <= 1 else self.diffs[n_batch - 2]

    def covers(self, bound: float) -> bool:
        """Whether the largest allowed size under bound is known from what was measured."""
        return self.complete or any(d > bound for d in self.diffs)

    def largest_batch(self, bound: float) -> int:
        """The largest b such that every size 2..b differs by at most bound."""
        for i, d in enumerate(self.diffs):
            if d > bound:
                return i + 1
        return len(self.diffs) + 1

    def as_dict(self) -> dict:
        return {"n_kv": self.n_kv, "diffs": list(self.diffs), "complete": self.complete,
                "seconds": self.seconds, "verify_seconds": list(self.verify_seconds)}


T = TypeVar("T")


class Groups(dict[int, T]):
    """Measurements per KV group: what this process measured, or what the on-disk cache holds
    (cached(group)), read once per group so a round never reads the disk."""

    def __init__(self, cached: Callable[[int], Optional[T]]):
        super().__init__()
        self._cached, self._not_cached = cached, set[int]()

    def lookup(self, group: int) -> Optional[T]:
        if group not in self and group not in self._not_cached:
            found = self._cached(group)
            if found is None:
                self._not_cached.add(group)
            else:
                self[group] = found
        return self.get(group)


class DiffTable:
    """One target's BatchDiffs per KV group: what was measured, in this process or cached on
    disk (cached(group)). A group not measured yet is asked for through missing(n_past, bound),
    which queues the probe for when the process is idle; until then get() says what is known
    (None: nothing), and rounds there decode plainly."""

    def __init__(self, cached: Callable[[int], Optional[BatchDiffs]], missing: Callable[[int, float], None],
                 n_ctx: int):
        self._missing = missing
        self.n_ctx = n_ctx
        self.groups: Groups[BatchDiffs] = Groups(cached)
        # group -> how far a verify pass's first row strayed from the same row decoded alone,
        # checked once on a live round where the group's limit is assumed (assumed())
        self.checked: dict[int, float] = {}

    def known(self, group: int) -> Optional[BatchDiffs]:
        return self.groups.lookup(group)

    def assumed(self, group: int, bound: float) -> Optional[int]:
        """The limit a KV group not measured yet takes meanwhile: the nearest shorter measured
        group's, at a level that allows a difference (bound > 0), unless the live check found
        its rows more than half the bound off; None: plain decoding there until measured. On
        our CPU, F16 rows differ by 0.008-0.05 logits up to KV 1024 and 0.105-0.129 at 1280-2048:
        what a batch does to a row is mostly the kernel path its size takes, which the short
        context measured; the check catches a longer context's other path (Q4_K rows differ by
        0.47-0.82 wherever one runs)."""
        # a longer context's other path found at one group runs at every longer one too
        if bound <= 0 or group == 0 or any(self.checked.get(g, 0.0) > bound / 2 for g in range(1, group + 1)):
            return None
        for shorter in range(group - 1, -1, -1):
            have = self.known(shorter)
            if have is not None and have.covers(bound):
                return have.largest_batch(bound)
        return None

    def get(self, n_past: int, bound: float) -> Optional[BatchDiffs]:
        """Measurements for a verify starting at n_past, or what is known of them."""
        n_kv = kv_length(n_past + 1, self.n_ctx)
        have = self.known(kv_group(n_kv))
        if have is not None and have.covers(bound):
            return have
        if n_past == 0 or n_past + MAX_VERIFY <= n_kv:  # a probe can run here (rows within one padding step)
            self._missing(n_past, bound)
        return have


class ReuseTable:
    """How far rows on a reused prompt cache stray from a fresh prefill's, per KV group: measured
    (cached(group)), or asked for through missing(n_past) and ASSUMED_REUSE_DIFF until then
    (NaN with measure=False)."""

    def __init__(self, cached: Callable[[int], Optional[float]], missing: Callable[[int], None], n_ctx: int):
        self._missing = missing
        self.n_ctx = n_ctx
        self.groups: Groups[float] = Groups(cached)

    def get(self, n_past: int, measure: bool = True) -> float:
        found = self.groups.lookup(kv_group(kv_length(n_past + 1, self.n_ctx)))
        if found is not None:
            return found
        if not measure:
            return math.nan
        self._missing(n_past)
        return ASSUMED_REUSE_DIFF

    def known(self, n_past: int) -> bool:
        """Whether the difference at a row at n_past was measured (in this process or cached)."""
        return not math.isnan(self.get(n_past, measure=False))


class Limits:
    """The verify-size limit of each round, and the difference its rows may carry.

    reuse: for a generation on a prompt cache that a fresh prefill would not compute bit for
    bit, the measured difference that reuse adds to every row.
    shared: for a generation in a lane of a shared context (sharing.py), the measured difference
    its rows carry from other lanes' cells, on every row (plain rounds too).
    """

    def __init__(self, level: Level, table: Optional[DiffTable], reuse: Optional[ReuseTable] = None,
                 shared: Optional[float] = None):
        self.level = level
        self.table = table
        self.reuse = reuse
        self.shared = shared
        self.used: dict[str, int] = {}  # KV group label -> the limit rounds met there
        self.waiting: set[str] = set()  # measurements this generation went without (queued for idle time)
        self._drift = 0.0  # largest difference of any batch so far: later rows attend to its KV

    def reach(self, n_past: int) -> None:
        """Ask, on first reach of this KV length, for what tolerance() needs beside the verify
        limits (measured when idle; until then near-ties there cannot be judged)."""
        if self.reuse is not None and not self.reuse.known(n_past):
            self.reuse.get(n_past)  # queues the probe
            group = kv_group(kv_length(n_past + 1, self.reuse.n_ctx))
            self.waiting.add(f"the reuse difference at {group_label(group)} (near-ties judged with an assumed "
                             f"{ASSUMED_REUSE_DIFF:g} logits)")

    def max_batch(self, n_past: int) -> int:
        """Largest verify batch for rows at positions n_past.. (1 = decode plainly)."""
        if not self.level.limited or self.table is None:
            return UNLIMITED
        diffs = self.table.get(n_past, self.level.bound)
        n_kv = kv_length(n_past + 1, self.table.n_ctx)
        group = kv_group(n_kv)
        # until the probe has run (when the process is idle, or in warm_up()): a shorter
        # context's limit where the level allows a difference, else 1 (plain decoding)
        assumed = self.table.assumed(group, self.level.bound) if diffs is None else None
        limit = diffs.largest_batch(self.level.bound) if diffs is not None else assumed or 1
        self.used[group_label(group)] = limit
        if diffs is None:
            self.waiting.add(f"the verify limit at {group_label(group)}" + (
                "" if assumed is None else f" (a shorter context's assumed, near-ties judged with an assumed "
                                           f"{self.level.bound:g} logits)"))
        # a batch past the padding step would attend over a longer KV than its single-token
        # rows did, which past 512 is another kernel path
        return min(limit, n_kv - n_past)

    def wants_check(self, n_past: int) -> bool:
        """Whether a verify pass from n_past runs where the limit is assumed and unchecked."""
        if not self.level.limited or self.table is None:
            return False
        group = kv_group(kv_length(n_past + 1, self.table.n_ctx))
        return group not in self.table.checked and self.table.groups.get(group) is None and \
            self.table.assumed(group, self.level.bound) is not None

    def checked(self, n_past: int, diff: float) -> None:
        """A live round's first row differed by diff from the same row decoded alone."""
        assert self.table is not None
        group = kv_group(kv_length(n_past + 1, self.table.n_ctx))
        self.table.checked[group] = diff
        if diff <= self.level.bound / 2:
            # the checking round's rows were judged as if 1.0 logits off; its cells, decoded again
            # as a batch within the limit, carry what any batch here may: at most the bound
            self._drift = min(self._drift, self.level.bound)
        else:
            log.info("at %s a verify pass's first row differs from single-token decoding by %.3g logits, past half "
                     "the %s level's bound: plain decoding there until the limit is measured", group_label(group),
                     diff, self.level)

    def tolerance(self, n_past: int, n_batch: int) -> float:
        """Twice the largest difference rows of this batch may carry (0: bitwise; NaN at an
        unlimited level, where near-ties are not judged)."""
        if not self.level.limited or self.table is None:
            return math.nan  # unmeasured: near-ties cannot be judged
        group = kv_group(kv_length(n_past + 1, self.table.n_ctx))
        diffs = self.table.groups.get(group)
        d = diffs.diff(n_batch) if diffs is not None and n_batch > 1 else 0.0
        if diffs is None and n_batch > 1 and self.table.assumed(group, self.level.bound) is not None:
            # an assumed limit's rows: as far off as the level allows once a live round's check
            # agreed, and until then (the check's own round) as far as any path here strays
            d = self.level.bound if group in self.table.checked else max(self.level.bound, ASSUMED_REUSE_DIFF)
        self._drift = max(self._drift, d)
        # rows on a reused cache and rows of a verify batch each stray from plain decoding on
        # a fresh prefill; the two differences add up at most
        reused = self.reuse.get(n_past) if self.reuse is not None else 0.0
        # a lane's other-cells difference, measured at a short context: where batches of this KV
        # length were measured to differ more, that larger figure (both are float rounding)
        shared = 0.0 if self.shared is None else max(self.shared, max(diffs.diffs, default=0.0) if diffs else 0.0)
        return 2.0 * (self._drift + reused + shared)


def top_gap(row: np.ndarray) -> float:
    """The row's largest logit minus its second largest (0 when two share the top)."""
    second, first = np.partition(row, -2)[-2:]
    return float(first - second)


def near_tie(row: np.ndarray, tolerance: float) -> bool:
    """Whether another logit is within tolerance of the row's largest: the rows where a
    difference of tolerance / 2 per logit could change the greedy choice."""
    return tolerance > 0 and int(np.count_nonzero(row >= row.max() - tolerance)) > 1
