"""Timing the decodes the draft controller weighs, on this machine: a probe's curve (every
verify size, repeated, with the evidence a busy machine shows in: measure_costs), a first
estimate to start from (first_costs), live one-token timings that say whether a cached curve
still holds (quick_costs), and the draft's step at a conversation's length (time_draft_step).
Where they are kept is records.py's, under calibrate.costs_key; every probe takes stop()."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Optional, Union

import numpy as np

from .calibrate import N_CONTEXT, PROBE_TEXT, Stop, check_stop, never, probe_tokens
from ..controller import Costs
from ..controller.costs import STEP_CONTEXT, theil_sen
from ..decoding.limits import MAX_VERIFY
from ..runtime.protocols import Drafter, Model

VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16)
# a size's timings go on past the asked repeats until they add up to this much (at most
# MAX_REPEATS runs): a decode of a millisecond or two (a GPU's, a tiny model's) varies by its
# own size with the OS's scheduling, and two runs of it made a curve whose batch of 2 timed
# 1 ms against 2 ms for 1, which calibrate rightly refused as a busy machine's
TIMED_FLOOR = 0.03
MAX_REPEATS = 32


def _time_decode(runtime: Union[Model, Drafter], n_context: int, tokens: list[int], n: int, repeats: int,
                 stop: Stop = never, all_rows: bool = True, floor: float = 0.0) -> list[float]:
    """Each of repeats decodes of n tokens (all rows kept, or the last) on n_context cached ones,
    in seconds, and more while they add up to less than floor (MAX_REPEATS in all)."""
    out: list[float] = []
    while len(out) < repeats or (sum(out) < floor and len(out) < MAX_REPEATS):
        check_stop(stop)
        runtime.truncate(n_context)
        t0 = time.perf_counter()
        if n == 1 or not all_rows:
            runtime.decode(tokens[:n])
        else:
            runtime.decode(tokens[:n], n_logits=n)  # type: ignore[call-arg]  # the target's
        out.append(time.perf_counter() - t0)
    return out


def _one_token(runtime: Union[Model, Drafter], tokens: list[int], n_bursts: int, stop: Stop) -> list[float]:
    """n_bursts timings of a one-token decode on STEP_CONTEXT cached tokens, each the fastest of a
    burst of runs adding up to a third of TIMED_FLOOR (one run where a decode takes that long):
    the evidence a busy machine shows in, comparable with the curve's fastest-of timings."""
    return [min(_time_decode(runtime, STEP_CONTEXT, tokens, 1, 1, stop, floor=TIMED_FLOOR / 3))
            for _ in range(n_bursts)]


def measure_costs(target: Model, draft: Optional[Drafter], max_verify: int = MAX_VERIFY, repeats: int = 2,
                  stop: Stop = never) -> tuple[Costs, dict]:
    """Time the target's decode of n = 1..max_verify tokens and the draft's single-token decode:
    (the costs, the evidence: one-token decodes and draft steps repeated at the start, middle
    and end, so a busy moment shows as disagreement: _one_token). Each size takes the fastest of
    repeats runs, or more where they add up to under TIMED_FLOOR (the least disturbed). Clears
    both caches."""
    tokens = probe_tokens(target, STEP_CONTEXT + max_verify)
    context, probe = tokens[:STEP_CONTEXT], tokens[STEP_CONTEXT:STEP_CONTEXT + max_verify]
    try:
        target.truncate(0)
        target.decode(context)
        _time_decode(target, STEP_CONTEXT, probe, 1, 1, stop)  # warm-up
        v1_repeats = _one_token(target, probe, 3, stop)
        sizes = [n for n in VERIFY_SIZES if n <= max_verify]
        measured = {}
        for i, n in enumerate(sizes):
            measured[n] = min(_time_decode(target, STEP_CONTEXT, probe, n, repeats, stop, floor=TIMED_FLOOR))
            if i == len(sizes) // 2:
                v1_repeats += _one_token(target, probe, 1, stop)
        v1_repeats += _one_token(target, probe, 1, stop)
        verify = tuple(float(np.interp(n, sizes, [measured[s] for s in sizes])) for n in range(1, max_verify + 1))
    finally:
        target.truncate(0)
    draft_repeats: list[float] = []
    draft_batch: Optional[tuple[int, float]] = None  # the context at once: the draft's prefills and catch-ups
    if draft is not None:
        try:
            draft_batch = (len(context), min(_time_decode(draft, 0, context, len(context), 2, stop, all_rows=False)))
            _time_decode(draft, STEP_CONTEXT, probe, 1, 1, stop)
            draft_repeats = _one_token(draft, probe, max(3, repeats), stop)
        finally:
            draft.truncate(0)
    costs = Costs(verify, min(draft_repeats) if draft_repeats else 0.0, draft_batch)
    return costs, {"v1_repeats": v1_repeats, "draft_repeats": draft_repeats,
                   "draft_batch": list(draft_batch) if draft_batch else None}


def time_draft_step(draft: Drafter, stop: Stop = never) -> tuple[int, float]:
    """(n_kv, seconds): the fastest of three draft steps at the end of what the draft holds (its
    last token decoded again: the cache is as it was)."""
    tokens = list(draft.cached)
    return len(tokens), min(_time_decode(draft, len(tokens) - 1, tokens[-1:], 1, 3, stop))


def quick_costs(target: Model, draft: Optional[Drafter]) -> tuple[list[float], Optional[list[float]]]:
    """A few live decodes to check a cached curve against: three timings each of one target
    token and one draft step (compare their fastest, as the curve keeps the fastest of its
    repeats: a median would read a moment's disturbance as a slower machine). Clears both
    caches."""
    context = target.tokenize(PROBE_TEXT, add_special=False)[:N_CONTEXT + 4]
    out: list[Optional[list[float]]] = []
    for model in (target, draft):
        if model is None:
            out.append(None)
            continue
        try:
            model.truncate(0)
            model.decode(context[:N_CONTEXT])
            _time_decode(model, N_CONTEXT, context[N_CONTEXT:], 1, 1)
            out.append(_time_decode(model, N_CONTEXT, context[N_CONTEXT:], 1, 3))
        finally:
            model.truncate(0)
    assert out[0] is not None
    return out[0], out[1]


FIRST_SIZES = (2, 4, 8)  # passes a first estimate times where the load's fidelity probe did not
FIRST_DRAFT_BATCH = 32  # tokens of the draft's batch a first estimate times


def first_costs(target: Model, draft: Optional[Drafter], verify_seconds: Sequence[float] = ()
                ) -> tuple[Costs, list[float]]:
    """Costs to start drafting from where this machine has none cached: (the costs, the target's
    one-token timings). The verify curve's shape comes from the passes the short-context
    fidelity probe timed at load (verify_seconds: one pass of 1, 2, ... rows; none at the "off"
    level, which runs no probe, where passes of FIRST_SIZES rows are timed here, once each):
    a robust line through the sizes from 2 on, never below one row, never falling. One-token
    decodes of each model (quick_costs) and a batch of the draft are timed now. About 1 s for
    the F16 1.5B target and the 0.5B draft on our CPU, against 5-10 s for the probe it stands in
    for; the rounds' own timings correct it from the first round on (OnlineCosts), and the
    probe still runs when the process is idle, or in warm_up(). Clears both caches."""
    v1, draft_steps = quick_costs(target, draft)
    sizes = {n: float(s) for n, s in enumerate(verify_seconds, 1) if n >= 2 and s > 0}
    missing = [n for n in FIRST_SIZES if n not in sizes and n <= MAX_VERIFY]
    if len(sizes) < len(FIRST_SIZES) and missing:
        tokens = probe_tokens(target, N_CONTEXT + max(missing))
        try:
            target.truncate(0)
            target.decode(tokens[:N_CONTEXT])
            for n in missing:
                sizes[n] = _time_decode(target, N_CONTEXT, tokens[N_CONTEXT:], n, 1)[0]
        finally:
            target.truncate(0)
    one = min(v1)
    rows = np.array(sorted(sizes), dtype=float)
    intercept, slope = theil_sen(rows, np.array([sizes[int(n)] for n in rows])) if sizes else (one, 0.0)
    verify = np.maximum.accumulate([one, *(max(one, intercept + slope * n) for n in range(2, MAX_VERIFY + 1))])
    draft_batch = None
    if draft is not None and draft_steps:
        context = probe_tokens(target, FIRST_DRAFT_BATCH)[:FIRST_DRAFT_BATCH]
        draft_batch = (len(context), min(_time_decode(draft, 0, context, len(context), 2, all_rows=False)))
        draft.truncate(0)
    costs = Costs(tuple(float(x) for x in verify), min(draft_steps) if draft_steps else 0.0, draft_batch)
    return costs, v1
