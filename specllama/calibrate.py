"""Probes of the target on this machine, and their records in the cache (records.py).

batch_diffs: how far logits of rows verified in a batch of b tokens stray from decoding the
same rows one at a time, at the KV length the generation has reached (fidelity.py turns this
into each round's verify-size limit). reuse_diffs: how far rows on a reused prompt cache stray
from a fresh prefill's. costs: the decode times the draft controller weighs, with repeated
timings as evidence. Every probe takes stop(): idle work ends early (Preempted, the cache put
back as it was) when a generation wants the models. Deciding when to measure is planner.py's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Optional, Union

import numpy as np

from . import records
from .controller import Costs
from .controller.costs import STEP_CONTEXT, theil_sen
from .fidelity import BatchDiffs, kv_group
from .idle import Preempted
from .limits import MAX_VERIFY
from .runtime.batches import KV_PAD, kv_length
from .runtime.protocols import Drafter, Model
from .tree import Tree

log = logging.getLogger("specllama")

PROBE_TEXT = ("The lighthouse on the northern cape was built in 1843. def area(r): return 3.14159 * r * r\n"
              '{"name": "Maria", "age": 34, "city": "Lisbon"} and then the keepers wrote in their logs')
N_CONTEXT = 8  # tokens in the cache before the probed rows when nothing else is there
Stop = Callable[[], bool]


def probe_tokens(target: Model, n_min: int) -> list[int]:
    """The probe text's tokens, repeated until there are at least n_min."""
    tokens = target.tokenize(PROBE_TEXT, add_special=False)
    while len(tokens) < n_min:
        tokens = tokens + tokens
    return tokens


def never() -> bool:
    return False


def check_stop(stop: Stop) -> None:
    if stop():
        raise Preempted()


def max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    d = float(np.max(np.abs(a - b)))
    return d if np.isfinite(d) else float("inf")


# --- keys: one per measurement, whoever measures ------------------------------------------------

def fidelity_key(target: Model, group: int) -> str:
    return f"batch_diffs|{target.identity}|{group}"


def reuse_key(target: Model, group: int) -> str:
    return f"reuse_diffs|{target.identity}|{group}"


def costs_key(target: Model, draft: Optional[Drafter], max_verify: int = MAX_VERIFY) -> str:
    """The one key of a target and draft pair's costs: whoever measures them (load(), calibrate,
    doctor, bench) reads and writes the same entry."""
    return f"costs|{target.identity}|{draft.identity if draft is not None else '-'}|{max_verify}"


def apart_key(target: Model, n_lanes: int) -> str:
    return f"apart_diff|{target.identity}|{n_lanes}"


def piece_key(runtime: Model) -> str:
    return f"piece_diff|{runtime.identity}"


def acceptance_key(target: Model, draft: Drafter, greedy: bool) -> str:
    """The key of a model pair's draft acceptance record (greedy and sampled drafts apart: their
    confidences mean different things)."""
    return f"acceptance|{target.identity}|{draft.identity}|{'greedy' if greedy else 'sampled'}"


def fidelity_group(n_past: int, n_ctx: int) -> int:
    """The KV group rows verified after n_past cached tokens attend over (0: the short context)."""
    return kv_group(kv_length(max(n_past, N_CONTEXT) + 1, n_ctx))


def cached_batch_diffs(target: Model, group: int) -> Optional[BatchDiffs]:
    record = records.read(fidelity_key(target, group))
    if record is None:
        return None
    return BatchDiffs(record["n_kv"], tuple(record["diffs"]), record["complete"], record["seconds"],
                      tuple(record["verify_seconds"]))


def cached_reuse_diffs(target: Model, group: int) -> Optional[float]:
    record = records.read(reuse_key(target, group))
    return None if record is None else float(record["diff"])


# --- fidelity ----------------------------------------------------------------------------------

def probe_batch_diffs(target: Model, n_past: int, bound: float, max_batch: int = MAX_VERIFY,
                      stop: Stop = never) -> BatchDiffs:
    """Teacher-forced probe at the KV length of n_past cached tokens.

    Decodes max_batch probe tokens one at a time, then the same tokens again as one batch of
    b = 2, 3, ... tokens, comparing every row (later rows attend to the batch's own KV, so the
    drift a batch leaves in the cache is included). A target that verifies trees also decodes a
    tree of b tokens (a chain with a sibling leaf under each of its first nodes); a size's
    difference is the larger of the two shapes'. Stops after the first size that differs by
    more than bound. The cache is back at n_past tokens afterwards."""
    max_batch = min(max_batch, target.n_ctx - n_past)  # a small context has room for fewer rows
    tokens = probe_tokens(target, max_batch)[:max(max_batch, 0)]
    trees = target.n_branches > 1
    leaves = [(tokens[(d + 7) % len(tokens)] + 1) % target.n_vocab for d in range(len(tokens))] if trees else []
    t_start = time.perf_counter()
    target.truncate(n_past)
    single, times, leaf_single = [], [], []
    diffs: list[float] = []
    try:
        for d, token in enumerate(tokens):
            check_stop(stop)
            if trees and d > 0:  # a sibling of tokens[d], alone after tokens[:d]
                target.decode([leaves[d]])
                leaf_single.append(target.logits(0).copy())
                target.truncate(n_past + d)
            t0 = time.perf_counter()
            target.decode([token])
            times.append(time.perf_counter() - t0)
            single.append(target.logits(0).copy())
        verify_seconds = [float(np.median(times))]
        for b in range(2, max_batch + 1):
            check_stop(stop)
            target.truncate(n_past)
            t0 = time.perf_counter()
            target.decode(tokens[:b], n_logits=b)
            verify_seconds.append(time.perf_counter() - t0)
            diffs.append(max(max_abs_diff(target.logits(i), single[i]) for i in range(b)))
            if trees and b > 2:
                diffs[-1] = max(diffs[-1], _tree_diff(target, n_past, tokens, leaves, single, leaf_single, b))
            if diffs[-1] > bound:
                break
    finally:
        target.truncate(n_past)
    return BatchDiffs(kv_length(n_past + 1, target.n_ctx), tuple(diffs), len(diffs) >= max_batch - 1,
                      time.perf_counter() - t_start, tuple(verify_seconds))


def _tree_diff(target: Model, n_past: int, tokens: list[int], leaves: list[int], single: list,
               leaf_single: list, b: int) -> float:
    """Largest |difference| of a b-token tree's rows from the same rows decoded alone: a chain
    of probe tokens, then a leaf under each of its first nodes (about half the tree, within
    the branches the target's context has)."""
    c = b - min(b - -(-(b + 1) // 2), target.n_branches - 1)
    target.truncate(n_past)
    # tokens[0] is the root; the chain tokens[1:c] under it, and a leaf under each of tokens[0:b - c]
    target.decode_tree(tokens[0], [*tokens[1:c], *leaves[1:b - c + 1]],
                       Tree([*range(-1, c - 2), *range(-1, b - c - 1)]))
    chain = max(max_abs_diff(target.logits(i), single[i]) for i in range(c))
    return max(chain, *(max_abs_diff(target.logits(c + j), leaf_single[j]) for j in range(b - c)))


def measure_batch_diffs(target: Model, n_past: int, bound: float, stop: Stop = never,
                        how: str = "probe") -> BatchDiffs:
    """probe_batch_diffs for the KV group of n_past, stored under fidelity_key. n_past = 0
    probes after a few tokens of its own (the short context; the cache is cleared)."""
    group = fidelity_group(n_past, target.n_ctx)
    if n_past == 0:
        target.truncate(0)
        target.decode(target.tokenize(PROBE_TEXT, add_special=False)[:N_CONTEXT])
        try:
            diffs = probe_batch_diffs(target, N_CONTEXT, bound, stop=stop)
        finally:
            target.truncate(0)
    else:
        diffs = probe_batch_diffs(target, n_past, bound, stop=stop)
    log.info("%s at KV length %d: verify batches differ from single-token rows by %s (measured in %.1f s)",
             target.name, diffs.n_kv, ", ".join(f"{b}: {d:.3g}" for b, d in enumerate(diffs.diffs, 2)),
             diffs.seconds)
    records.write(fidelity_key(target, group), diffs.as_dict(), how)
    return diffs


def calibrate_fidelity(target: Model, n_groups: int = 4, bound: float = float("inf"),
                       fresh: bool = False) -> list[BatchDiffs]:
    """Fidelity at the start of KV groups 0..n_groups-1 (KV lengths 256, 512, 768, 1280, ...),
    the cache filled with probe text to get there; the cached records where they cover bound,
    unless fresh. Clears the target's cache."""
    filler = target.tokenize(PROBE_TEXT, add_special=False)
    out = []
    try:
        for group in range(n_groups):
            n_past = 0 if group == 0 else KV_PAD << (group - 1)  # rows attend over KV length 512, 768, ...
            if group and n_past + MAX_VERIFY > target.n_ctx:
                break
            have = None if fresh else cached_batch_diffs(target, group)
            if have is not None and have.covers(bound):
                out.append(have)
                continue
            if group:
                text = filler * (n_past // len(filler) + 1)
                target.sync(text[:n_past + 1])  # extends what the previous group left in the cache
                target.truncate(n_past)
            out.append(measure_batch_diffs(target, n_past, bound, how="specllama calibrate"))
    finally:
        target.truncate(0)
    return out


# --- reuse -------------------------------------------------------------------------------------

REUSE_SEGMENT = 8  # probe tokens that stand for an earlier answer, decoded one by one on a reused cache
REUSE_ROWS = 4  # probe tokens that stand for the new turn, prefilled on top of them


def probe_reuse_diffs(target: Model, n_past: int, stop: Stop = never) -> float:
    """How far rows computed on a reused cache stray from rows on a fresh prefill, at the KV
    length of n_past cached tokens. A fresh prefill computes a conversation in large batches; a
    reused cache holds an earlier answer decoded one token at a time (or in verify batches),
    prefills only the new turn on top of it, and re-decodes the last prompt token alone when its
    prompt was cut short. So probe text is appended on top of the cache each of these ways, and
    every row compared with the same row of the all-in-one-batch run: the new turn's rows, the
    last row decoded alone, and the next (generated) row. The cache is back at n_past after."""
    tokens = target.tokenize(PROBE_TEXT, add_special=False)[:REUSE_SEGMENT + REUSE_ROWS + 1]
    answer, turn, generated = tokens[:REUSE_SEGMENT], tokens[REUSE_SEGMENT:-1], tokens[-1:]
    if n_past + len(tokens) > target.n_ctx:
        return math.nan
    try:
        target.truncate(n_past)  # fresh: one batch, then the generated row
        target.decode(answer + turn, n_logits=len(turn))
        fresh = [target.logits(i).copy() for i in range(len(turn))]
        target.decode(generated)
        fresh.append(target.logits(0).copy())
        target.truncate(n_past)  # reused: the answer token by token, the new turn as a batch
        for token in answer:
            check_stop(stop)
            target.decode([token])
        target.decode(turn, n_logits=len(turn))
        reused = [target.logits(i).copy() for i in range(len(turn))]
        target.decode(generated)
        reused.append(target.logits(0).copy())
        check_stop(stop)
        target.truncate(n_past)  # cut short: all but the last prompt token as a batch, then that one alone
        target.decode(answer + turn[:-1])
        target.decode(turn[-1:])
        last_alone = target.logits(0).copy()
    finally:
        target.truncate(n_past)
    return max(max(max_abs_diff(a, b) for a, b in zip(fresh, reused)),
               max_abs_diff(last_alone, fresh[len(turn) - 1]))


def measure_reuse_diffs(target: Model, n_past: int, stop: Stop = never) -> float:
    """probe_reuse_diffs for the KV group of n_past, stored under reuse_key (NaN: no room)."""
    t0 = time.perf_counter()
    diff, seconds = probe_reuse_diffs(target, n_past, stop), time.perf_counter() - t0
    if not math.isnan(diff):
        log.info("%s at KV length %d: rows on a reused prompt cache differ from a fresh prefill's by %.3g "
                 "(measured in %.1f s)", target.name, kv_length(n_past + 1, target.n_ctx), diff, seconds)
        records.write(reuse_key(target, kv_group(kv_length(n_past + 1, target.n_ctx))),
                      {"diff": diff, "seconds": seconds}, "probe")
    return diff


# --- costs ---------------------------------------------------------------------------------------

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
