"""What the controller weighs: the target's cost to verify n tokens and the draft's per token,
from a calibration that the rounds' own timings keep correcting (OnlineCosts)."""

from __future__ import annotations

import statistics
import sys
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np

from ..measuring.records import costs_problem
from ..runtime.batches import kv_length


@dataclass(frozen=True)
class Costs:
    """Measured seconds: verify[n - 1] for a target pass over n tokens; draft per token."""

    verify: tuple[float, ...]
    draft_token: float
    draft_batch: Optional[tuple[int, float]] = None  # (n, seconds): the draft decoding n tokens at once
    draft_kv: Optional[tuple[int, float]] = None  # (n_kv, seconds): a draft step after n_kv cached tokens

    def v(self, n: int) -> float:
        if n <= len(self.verify):
            return self.verify[n - 1]
        slope = self.verify[-1] - self.verify[-2] if len(self.verify) > 1 else self.verify[-1]
        return self.verify[-1] + slope * (n - len(self.verify))


MIN_RATIO = 0.05  # the least measured/calibrated ratio a fit may give
STEP_CONTEXT = 64  # cached tokens behind the calibration's draft step (cost_probes.measure_costs)


def ideal_speedup(costs: Costs, k: int) -> float:
    """Plain decoding's time for k + 1 tokens over a round's: k draft steps and a verify of k + 1
    rows, every draft kept; k = 0 is plain decoding."""
    if k == 0:
        return 1.0
    return (k + 1) * costs.v(1) / (k * costs.draft_token + costs.v(k + 1))


def kv_factor(costs: Costs, n_kv: int) -> float:
    """A draft step after n_kv cached tokens over one at the calibration's short context: each
    step attends over every cached token, so its cost grows in a line through the short step
    and the one timed at a long context (draft_kv; 1.0 without one). On our CPU the 0.5B
    draft's step took 38 ms at 64 tokens and 89 ms at 2,900: priced at 38 ms, a 2,900-token
    turn expected 1.12x from drafting where it could not beat plain decoding."""
    if costs.draft_kv is None or costs.draft_token <= 0 or costs.draft_kv[0] <= STEP_CONTEXT:
        return 1.0
    n_long, seconds = costs.draft_kv
    per_token = max(0.0, seconds / costs.draft_token - 1.0) / (n_long - STEP_CONTEXT)
    return 1.0 + per_token * max(0, n_kv - STEP_CONTEXT)


KV_SHORT = kv_length(STEP_CONTEXT + 1, sys.maxsize)  # the cells behind the calibration's passes


def theil_sen(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(intercept, slope) of a robust line through the points: the median of the slopes between
    points at distinct x (0 where there are none), then the median intercept."""
    i, j = np.triu_indices(len(x), 1)
    distinct = x[i] != x[j]
    slope = float(np.median((y[j] - y[i])[distinct] / (x[j] - x[i])[distinct])) if distinct.any() else 0.0
    return float(np.median(y - slope * x)), slope


def verify_kv_factors(short: Costs, seconds: Sequence[float]) -> np.ndarray:
    """Per size n = 1, 2, ...: a pass of n rows timed at a long context over the calibrated one
    at the short context (short: its curve). seconds are a fidelity probe's: one-token decodes'
    median, then one pass of each size, which scatter 15% from the next; a robust line through
    the sizes from 2 on stands for them, never below the size before."""
    fitted = np.array(seconds, dtype=float)
    if len(fitted) >= 3:
        n = np.arange(2, len(fitted) + 1, dtype=float)
        intercept, slope = theil_sen(n, fitted[1:])
        fitted[1:] = intercept + slope * n
    fitted = np.maximum.accumulate(np.maximum(fitted, fitted[0]))
    return fitted / np.array([short.v(n) for n in range(1, len(fitted) + 1)])


class OnlineCosts:
    """Running estimates of v(n) and the draft's cost per token, starting from a calibration.

    The calibrated curve (made non-decreasing) gives v(n)'s shape; what rounds measure scales
    it. Sizes 2 and up share one robust straight line through the ratios measured/calibrated
    (Theil-Sen, over the last rounds): one pass here scatters 15% from the next, so a per-size
    median makes neighbouring sizes look 30 ms apart and cuts drafts short, while a line
    through every size keeps the increments, which decide how far to draft, smooth. v(1), the
    figure every choice is weighed against, is measured by the occasional plain round, relative
    to the line's level at the time: the machine's load moves the whole curve, so v(1) follows
    it between plain rounds instead of going stale. The draft cost is the median of the last
    measured steps, each taken back to the short context by kv_factor. frozen=True keeps the
    calibration (seeded sampling: the same seed must give the same text, so no timing may steer
    the rounds). v1_live: one-token decodes this
    process timed moments ago beside the curve (checking or measuring it at load), which stand
    for the first plain rounds: a fresh process's first generation need not decode its first
    three rounds plainly to learn what load just measured. They were timed at the curve's short
    context, so they count at their own level: v(1) follows the batch rounds' level (a long
    context's as much as a busier machine's) until plain rounds measure it.

    verify_kv: the fidelity probes' measurements by KV group (live: groups measured later count
    from then on), each with its KV length (n_kv) and the passes it timed (verify_seconds): a
    pass's cost at a longer context follows them (kv_scale), so the ratios measure the machine,
    and v(1) and each further row are priced at the context's length. Frozen costs ignore them.
    """

    def __init__(self, seed: Costs, *, window: int = 9, frozen: bool = False, refresh: int = 64,
                 v1_live: Sequence[float] = (), verify_kv: Optional[Mapping[int, Any]] = None):
        self.seed, self.frozen, self.refresh = seed, frozen, refresh
        self._verify_kv = {} if verify_kv is None or frozen else verify_kv
        self._kv_points: list[tuple[int, np.ndarray]] = []  # (cells, verify_kv_factors) by length
        self._kv_key: list[int] = []  # the measurements _kv_points were made from
        # the calibrated curve's shape, non-decreasing: a pass over more tokens never costs less
        self._shape = Costs(tuple(np.maximum.accumulate(seed.verify).tolist()), seed.draft_token)
        self._one: deque = deque(maxlen=window)  # [measured / calibrated v(1), the line's level then]
        self._batches: deque = deque(maxlen=4 * window)  # (n, measured / calibrated v(n)), n >= 2
        self._draft: deque = deque(maxlen=window)  # a draft step of this lane's row alone
        self._draft_shared: deque = deque(maxlen=window)  # a step beside other lanes' (and their turns)
        self._catch_up: deque = deque(maxlen=window)  # measured / modelled seconds of a draft batch
        self._last_one = 0  # n_observed when v(1) was last measured
        self._line: Optional[tuple[float, float, int, int]] = None  # cached fit
        self.n_observed = 0
        if not frozen:
            self._one.extend([ratio, ratio] for ratio in (s / self._shape.v(1) for s in v1_live if s > 0))
        self._n_stand_ins = len(self._one)  # each plain round's own measurement replaces one

    def observe_verify(self, n: int, seconds: float, n_kv: int = 0) -> None:
        """A pass of n rows after n_kv cached tokens took seconds."""
        if self.frozen or seconds <= 0:
            return
        ratio = seconds / (self._shape.v(n) * self.kv_scale(n, n_kv)[n - 1])
        self.n_observed += 1
        if n == 1:
            if self._n_stand_ins:
                self._one.popleft()
                self._n_stand_ins -= 1
            self._one.append([ratio, self._level() if len(self._batches) >= 3 else None])
            self._last_one = self.n_observed
        else:
            self._batches.append((n, ratio))
            self._line = None
            unplaced = [measured for measured in self._one if measured[1] is None]
            if unplaced and len(self._batches) >= 3:
                level = self._level()  # plain rounds before any line: the first level after
                for measured in unplaced:
                    measured[1] = level

    def wants(self, n: int) -> bool:
        """Whether v(1) has too few recent measurements to trust (never when frozen)."""
        if self.frozen or n != 1:
            return False
        return len(self._one) < 3 or self.n_observed - self._last_one > self.refresh

    def observe_draft_step(self, seconds: float, shared: bool = False, n_kv: int = 0) -> None:
        """A draft step's seconds after n_kv cached tokens; shared: taken while other lanes
        generated (their draft rows in the step, their turns between steps), which is what a
        step costs at that load and not alone: one window for both, and a burst of requests left
        a lone request pricing its draft steps at 2-3x their time, drafting less, so measuring
        fewer of them."""
        if not self.frozen and seconds > 0:
            (self._draft_shared if shared else self._draft).append(seconds / kv_factor(self.seed, n_kv))

    def draft_cost(self, shared: bool, n_kv: int = 0) -> float:
        """Seconds a draft step costs after n_kv cached tokens, alone or beside other lanes
        (their figure once three such steps were measured; the step alone until then)."""
        step = statistics.median(self._draft_shared) if shared and len(self._draft_shared) >= 3 else self.draft_token
        return step * kv_factor(self.seed, n_kv)

    def learn_draft_kv(self, n_kv: int, seconds: float) -> None:
        """A draft step timed after n_kv cached tokens (idle, on the live conversation): the
        steps' growth with the context follows it from now on."""
        self.seed = replace(self.seed, draft_kv=(n_kv, seconds))

    def observe_catch_up(self, n_tokens: int, seconds: float) -> None:
        """The draft decoded n_tokens at once (its prefill, or catching up) in seconds."""
        if not self.frozen and n_tokens >= 2 and seconds > 0:
            self._catch_up.append(seconds / self._draft_batch(n_tokens))

    def catch_up(self, n_tokens: int) -> float:
        """Seconds for the draft to decode n_tokens in one batch (_draft_batch), times the
        median of what catch-ups measured against that. A batch's cost grows far slower than
        its size (on our CPU the 0.5B draft decodes 48 tokens at once in 12x its one-token
        time), so a cost per token measured on the usual 2-token catch-ups would price a
        48-token one at nearly three times its time."""
        ratio = statistics.median(self._catch_up) if self._catch_up else 1.0
        return self._draft_batch(n_tokens) * ratio

    def _draft_batch(self, n_tokens: int) -> float:
        """The calibration's figure for n_tokens at once: a line through the draft's one-token
        step and its timed batch, where the calibration has one (the draft's own shape); else
        its step scaled by the target's curve, which here read an 80-token prefill of the
        Q4_K_M draft beside the F16 target at about 62 ms where it takes about 0.45 s (a
        memory-bound target's curve rises far slower than a compute-bound draft's)."""
        n = max(n_tokens, 1)
        batch = self.seed.draft_batch
        if batch is not None and self.seed.draft_token > 0:
            n_batch, seconds = batch
            per_token = max(0.0, seconds - self.seed.draft_token) / (n_batch - 1)
            return self.draft_token * (1.0 + per_token * (n - 1) / self.seed.draft_token)
        return self.draft_token * self._shape.v(n) / self._shape.v(1)

    def kv_scale(self, n_max: int, n_kv: int) -> np.ndarray:
        """Per size n = 1..n_max: a pass of n rows after n_kv cached tokens over one at the
        calibration's short context. 1 there; at each length a probe timed, what its passes
        took; in a line between (each row attends over every cell), and beyond the longest on
        the line from the short context through it. On our CPU (F16 1.5B) rounds at 2,900 tokens
        took 205 / 251 / 317 / 395 ms for 1 / 2 / 4 / 6 rows against 165 / 182 / 215 / 246
        calibrated: each further row cost about twice the short curve's."""
        key = [id(d) for d in list(self._verify_kv.values())]
        if key != self._kv_key:
            self._kv_key = key
            self._kv_points = sorted(((d.n_kv, verify_kv_factors(self._shape, d.verify_seconds))
                                      for d in list(self._verify_kv.values())
                                      if d.n_kv > KV_SHORT and len(d.verify_seconds) >= 3), key=lambda p: p[0])
        cells, ones = kv_length(n_kv + 1, sys.maxsize), np.ones(n_max)  # the probes' cap is the context's
        if not self._kv_points or cells <= KV_SHORT:
            return ones
        sizes = np.arange(n_max)
        xs = [KV_SHORT] + [c for c, _ in self._kv_points]
        ys = [ones] + [np.maximum(1.0, f[np.minimum(sizes, len(f) - 1)]) for _, f in self._kv_points]
        if cells >= xs[-1]:
            return 1.0 + (ys[-1] - 1.0) * (cells - KV_SHORT) / (xs[-1] - KV_SHORT)
        i = int(np.searchsorted(xs, cells)) - 1  # xs[i] < cells < xs[i + 1]
        w = (cells - xs[i]) / (xs[i + 1] - xs[i])
        return (1.0 - w) * ys[i] + w * ys[i + 1]

    def _fit(self) -> tuple[float, float, int, int]:
        """(intercept, slope, n_lo, n_hi) of the ratio line over measured sizes n_lo..n_hi."""
        if self._line is None:
            if not self._batches:
                overall = statistics.median(r for r, _ in self._one) if self._one else 1.0
                self._line = (overall, 0.0, 2, 2)
            else:
                n, r = np.array(self._batches, dtype=float).T
                self._line = (*theil_sen(n, r), int(n.min()), int(n.max()))
        return self._line

    def _ratio(self, n: int) -> float:
        if n == 1 and len(self._one) >= 3:
            if all(level for _, level in self._one):
                return statistics.median(r / level for r, level in self._one) * self._level()
            return statistics.median(r for r, _ in self._one)
        intercept, slope, n_lo, n_hi = self._fit()
        # no extrapolating the trend; and however wild the rounds, no cost at or below zero
        return max(intercept + slope * min(max(n, n_lo), n_hi), MIN_RATIO)

    def _level(self) -> float:
        return self._ratio(2)

    def v(self, n: int) -> float:
        return float(self.table(n)[n])

    @property
    def draft_token(self) -> float:
        return statistics.median(self._draft) if len(self._draft) >= 3 else self.seed.draft_token

    def table(self, n_max: int, n_kv: int = 0) -> np.ndarray:
        """[0, v(1), ..., v(n_max)] after n_kv cached tokens"""
        v = np.array([self._shape.v(n) * self._ratio(n) for n in range(1, n_max + 1)]) * self.kv_scale(n_max, n_kv)
        v[1:] = np.maximum.accumulate(v[1:])  # more tokens never cost less
        return np.concatenate(([0.0], v))

    def drift(self, factor: float = 1.5, n_min: int = 24) -> Optional[Costs]:
        """The curve the rounds measure, where it has stayed off the calibration by more than
        factor (either way) over a window of at least n_min rounds, with v(1) and batches both
        measured; None while it agrees (or too little was measured, or frozen, or the rounds'
        curve fails the check a probed one must pass: records.costs_problem).

        v(1) counts as measured only by rounds of one row: load's one-token timings stand in for
        it by following the batches' level, and lanes under load, whose passes hold several
        rows, then wrote a curve with one token at 52 ms where every round of one row took
        92-108 ms (F16 pair, this CPU). Nor is v(1) put outside what those rounds measured."""
        live = [ratio for ratio, _ in list(self._one)[self._n_stand_ins:]]
        if self.frozen or self.n_observed < n_min or len(live) < 3 or len(self._batches) < 9:
            return None
        _, _, n_lo, n_hi = self._fit()
        sizes = [1, *range(n_lo, n_hi + 1)]
        ratios = [self._ratio(n) for n in sizes]
        if max(max(ratios), 1 / min(ratios)) <= factor:
            return None
        v = self.table(len(self.seed.verify))
        v[1] = float(np.clip(v[1], min(live) * self._shape.v(1), max(live) * self._shape.v(1)))
        v[1:] = np.maximum.accumulate(v[1:])
        verify = tuple(float(x) for x in v[1:])
        if costs_problem(verify, self.draft_token) is not None:
            return None
        return Costs(verify, self.draft_token, self.seed.draft_batch, self.seed.draft_kv)

    def as_dict(self) -> dict:
        v = self.table(16)
        return {"v_ms": {n: round(float(v[n]) * 1000, 2) for n in (1, 2, 3, 4, 6, 8, 12, 16)},
                "draft_token_ms": round(self.draft_token * 1000, 2),
                **({"draft_step_beside_lanes_ms": round(self.draft_cost(True) * 1000, 2)}
                   if len(self._draft_shared) >= 3 else {}),
                "draft_batch_ms": {n: round(self.catch_up(n) * 1000, 2) for n in (2, 8, 32)},
                "draft_token_ms_at_kv": {n: round(self.draft_cost(False, n) * 1000, 2) for n in (1024, 4096)},
                **({"v_ms_at_kv": {n: [round(float(x) * 1000, 2) for x in self.table(4, n)[[1, 2, 4]]]
                                   for n in (1024, 4096)}} if self._kv_points else {}),
                "n_observed": self.n_observed,
                "frozen": self.frozen}


def draft_can_pay(costs: OnlineCosts, k_max: int) -> bool:
    """Whether a draft that is always right would beat plain decoding at some length <= k_max."""
    ks = np.arange(1, k_max + 1)
    v = costs.table(k_max + 1)
    return k_max > 0 and bool(np.max((ks + 1) / (ks * costs.draft_token + v[ks + 1])) > 1.0 / v[1])


def shared_pass_costs(v: np.ndarray, n_other: int, n_lanes: int, n_max: int,
                      n_cap: Optional[int] = None) -> np.ndarray:
    """[0, v'(1), ..., v'(n_max)]: what n rows of one lane cost the requests together when its
    rows ride in a pass with n_other rows of n_lanes - 1 other lanes (v: the pass costs, up to
    at least n_other + n_max rows). v'(1) is the lane's share of plain batching's pass, one row
    a lane, v(n_lanes) / n_lanes; each further row costs what it adds to the pass as it is. A
    lane that maximises its own tokens per second under v' drafts exactly where its drafts
    raise the tokens per second of all lanes above plain batching's: drafts pay only while the
    rows they add are cheap beside the pass. Shared from the pass as it is, v(n_other + 1) /
    n_lanes, other lanes' drafts raised the bar's pass and lowered the bar: in a burst of 8
    requests on our CPU (F16), one that planned alone drafted 16, the others then priced a
    plain row at 48 ms where plain batching's is 27, drafted too and prefilled the draft, and
    the burst ran at 0.76x plain batching.

    n_cap: the most rows the pass may hold (the fidelity level's limit). Rows past its room
    cannot ride with the others' (SharedContext decodes them in a pass of their own): they
    cost the lane's own pass, v(n), and what the others lose of the shared pass, v(n_other)
    less their share of it. Priced as if they shared, two lanes drafting long chains each
    fill the pass alone, and at two requests the lanes ran slower than one at a time."""
    if n_lanes <= 1 or n_other <= 0:
        return v[:n_max + 1]
    n = np.arange(1, n_max + 1)
    base, share = v[n_other + 1], v[min(n_lanes, n_other + 1)] / n_lanes
    shared = share + v[n_other + n] - base
    if n_cap is not None:
        apart = share + v[n] + v[n_other] - base
        shared = np.where(n_other + n <= n_cap, shared, apart)
    return np.concatenate(([0.0], shared))


def planning_load(n_other: int, n_lanes: int, n_active: int) -> tuple[int, int]:
    """(n_other, n_lanes) to plan a lane's next round for, from its last pass (the rows and
    lanes in it beside its own) and the lanes generating now: at least a row of every one of
    them. A pass that held a lane's rows alone, because the others were still drafting, is no
    sign the load has gone; planning as if alone, the lane would draft its longest chains and
    make every other lane wait for its draft steps and its long pass."""
    return max(n_other, n_active - 1), max(n_lanes, n_active)
