"""Probes of the target on this machine, and their records in the cache (records.py).

batch_diffs: how far logits of rows verified in a batch of b tokens stray from decoding the
same rows one at a time, at the KV length the generation has reached (fidelity.py turns this
into each round's verify-size limit). reuse_diffs: how far rows on a reused prompt cache stray
from a fresh prefill's. The decode times the draft controller weighs are cost_probes.py's.
Every probe takes stop(): idle work ends early (Preempted, the cache put back as it was) when a
generation wants the models. Deciding when to measure is planner.py's.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Optional

import numpy as np

from . import records
from .fidelity import BatchDiffs, kv_group
from .idle import Preempted
from ..decoding.limits import MAX_VERIFY
from ..runtime.batches import KV_PAD, kv_length
from ..runtime.protocols import Drafter, Model
from ..decoding.tree import Tree

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
