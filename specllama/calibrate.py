"""Measurements of the target on this machine, cached so each runs once per model and settings.

batch_diffs: how far logits of rows verified in a batch of b tokens stray from decoding the
same rows one at a time, at the KV length the generation has reached (fidelity.py turns this
into each round's verify-size limit). costs: the decode times the draft controller weighs.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Optional, Union

import numpy as np

from . import paths
from .controller import Costs
from .fidelity import BatchDiffs, kv_group
from .limits import MAX_VERIFY
from .runtime.batches import KV_PAD, kv_length
from .runtime.protocols import Drafter, Model
from .tree import Tree

log = logging.getLogger("specllama")

PROBE_TEXT = ("The lighthouse on the northern cape was built in 1843. def area(r): return 3.14159 * r * r\n"
              '{"name": "Maria", "age": 34, "city": "Lisbon"} and then the keepers wrote in their logs')
N_CONTEXT = 8  # tokens in the cache before the probed rows when nothing else is there


def _load(key: str) -> dict | None:
    return paths.read_cached("calibration.json", key)


def store(key: str, value: dict) -> None:
    paths.write_cached("calibration.json", key, value)


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    d = float(np.max(np.abs(a - b)))
    return d if np.isfinite(d) else float("inf")


def probe_batch_diffs(target: Model, n_past: int, bound: float, max_batch: int = MAX_VERIFY) -> BatchDiffs:
    """Teacher-forced probe at the KV length of n_past cached tokens.

    Decodes max_batch probe tokens one at a time, then the same tokens again as one batch of
    b = 2, 3, ... tokens, comparing every row (later rows attend to the batch's own KV, so
    the drift a batch leaves in the cache is included). A target that verifies trees also
    decodes a tree of b tokens (a chain with a sibling leaf under each of its first nodes),
    and a size's difference is the larger of the two shapes'. Stops after the first size that
    differs by more than bound. The cache is back at n_past tokens afterwards.
    """
    max_batch = min(max_batch, target.n_ctx - n_past)  # a small context has room for fewer rows
    tokens = target.tokenize(PROBE_TEXT, add_special=False)
    while len(tokens) < max_batch:
        tokens = tokens + tokens
    tokens = tokens[:max(max_batch, 0)]
    trees = target.n_branches > 1
    leaves = [(tokens[(d + 7) % len(tokens)] + 1) % target.n_vocab for d in range(len(tokens))] if trees else []
    t_start = time.perf_counter()
    target.truncate(n_past)
    single, times, leaf_single = [], [], []
    diffs: list[float] = []
    try:
        for d, token in enumerate(tokens):
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
            target.truncate(n_past)
            t0 = time.perf_counter()
            target.decode(tokens[:b], n_logits=b)
            verify_seconds.append(time.perf_counter() - t0)
            diffs.append(max(_max_abs_diff(target.logits(i), single[i]) for i in range(b)))
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
    chain = max(_max_abs_diff(target.logits(i), single[i]) for i in range(c))
    return max(chain, *(_max_abs_diff(target.logits(c + j), leaf_single[j]) for j in range(b - c)))


def batch_diffs(target: Model, n_past: int, bound: float) -> BatchDiffs:
    """probe_batch_diffs for the KV group of n_past, cached per model file, settings and
    llama.cpp build. n_past = 0 probes after a few tokens of its own (the short context)."""
    key = f"batch_diffs|{target.identity}|{kv_group(kv_length(max(n_past, N_CONTEXT) + 1, target.n_ctx))}"
    cached = _load(key)
    if cached is not None:
        diffs = BatchDiffs(cached["n_kv"], tuple(cached["diffs"]), cached["complete"], cached["seconds"],
                           tuple(cached["verify_seconds"]))
        if diffs.covers(bound):
            return diffs
    if n_past == 0:
        target.truncate(0)
        target.decode(target.tokenize(PROBE_TEXT, add_special=False)[:N_CONTEXT])
        n_past = N_CONTEXT
        try:
            diffs = probe_batch_diffs(target, n_past, bound)
        finally:
            target.truncate(0)
    else:
        diffs = probe_batch_diffs(target, n_past, bound)
    log.info("%s at KV length %d: verify batches differ from single-token rows by %s (measured in %.1f s)",
             target.name, diffs.n_kv, ", ".join(f"{b}: {d:.3g}" for b, d in enumerate(diffs.diffs, 2)),
             diffs.seconds)
    store(key, diffs.as_dict())
    return diffs


REUSE_SEGMENT = 8  # probe tokens that stand for an earlier answer, decoded one by one on a reused cache
REUSE_ROWS = 4  # probe tokens that stand for the new turn, prefilled on top of them


def probe_reuse_diffs(target: Model, n_past: int) -> float:
    """How far rows computed on a reused cache stray from rows on a fresh prefill, at the KV
    length of n_past cached tokens.

    A fresh prefill computes a conversation in large batches. A reused cache holds an earlier
    answer decoded one token at a time (or in verify batches), prefills only the new turn on
    top of it, and re-decodes the last prompt token alone when its prompt was cut short. So
    probe text is appended on top of the cache each of these ways, and every row compared
    with the same row of the all-in-one-batch run: the new turn's rows, the last row decoded
    alone, and the next (generated) row. The cache is back at n_past tokens afterwards.
    """
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
            target.decode([token])
        target.decode(turn, n_logits=len(turn))
        reused = [target.logits(i).copy() for i in range(len(turn))]
        target.decode(generated)
        reused.append(target.logits(0).copy())
        target.truncate(n_past)  # cut short: all but the last prompt token as a batch, then that one alone
        target.decode(answer + turn[:-1])
        target.decode(turn[-1:])
        last_alone = target.logits(0).copy()
    finally:
        target.truncate(n_past)
    return max(max(_max_abs_diff(a, b) for a, b in zip(fresh, reused)),
               _max_abs_diff(last_alone, fresh[len(turn) - 1]))


def reuse_diffs(target: Model, n_past: int) -> float:
    """probe_reuse_diffs for the KV group of n_past, cached per model file, settings and build."""
    key = f"reuse_diffs|{target.identity}|{kv_group(kv_length(n_past + 1, target.n_ctx))}"
    cached = _load(key)
    if cached is not None:
        return float(cached["diff"])
    t0 = time.perf_counter()
    diff = probe_reuse_diffs(target, n_past)
    seconds = time.perf_counter() - t0
    if math.isnan(diff):
        return diff
    log.info("%s at KV length %d: rows on a reused prompt cache differ from a fresh prefill's by %.3g "
             "(measured in %.1f s)", target.name, kv_length(n_past + 1, target.n_ctx), diff, seconds)
    store(key, {"diff": diff, "seconds": seconds})
    return diff


def calibrate_fidelity(target: Model, n_groups: int = 4, bound: float = float("inf")) -> list[BatchDiffs]:
    """batch_diffs at the start of KV groups 0..n_groups-1 (KV lengths 256, 512, 768, 1280, ...),
    the cache filled with probe text to get there. Measures every size unless bound is given.
    Clears the target's cache."""
    filler = target.tokenize(PROBE_TEXT, add_special=False)
    out = [batch_diffs(target, 0, bound)]
    try:
        for group in range(1, n_groups):
            n_past = KV_PAD << (group - 1)  # rows from here on attend over KV length 512, 768, 1280, ...
            if n_past + MAX_VERIFY > target.n_ctx:
                break
            text = filler * (n_past // len(filler) + 1)
            target.sync(text[:n_past + 1])  # extends what the previous group left in the cache
            target.truncate(n_past)
            out.append(batch_diffs(target, n_past, bound))
    finally:
        target.truncate(0)
    return out


VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def _time_decode(runtime: Union[Model, Drafter], n_context: int, tokens: list[int], n: int, repeats: int) -> float:
    """The fastest of repeats decodes of n tokens (all rows kept) on n_context cached ones."""
    best = float("inf")
    for _ in range(repeats):
        runtime.truncate(n_context)
        t0 = time.perf_counter()
        if n == 1:
            runtime.decode(tokens[:1])
        else:
            runtime.decode(tokens[:n], n_logits=n)  # type: ignore[call-arg]  # the target's
        best = min(best, time.perf_counter() - t0)
    return best


def measure_costs(target: Model, draft: Optional[Drafter], max_verify: int = 16, repeats: int = 2) -> Costs:
    """Time the target's decode of n = 1..max_verify tokens and the draft's single-token decode.

    Uses the fastest of `repeats` runs (the least disturbed by other work). Clears both caches.
    """
    tokens = target.tokenize(PROBE_TEXT, add_special=False)
    while len(tokens) < 64 + max_verify:
        tokens = tokens + tokens
    context, probe = tokens[:64], tokens[64:64 + max_verify]
    target.truncate(0)
    target.decode(context)
    _time_decode(target, 64, probe, 1, 1)  # warm-up
    sizes = [n for n in VERIFY_SIZES if n <= max_verify]
    measured = {n: _time_decode(target, 64, probe, n, repeats) for n in sizes}
    verify = tuple(float(np.interp(n, sizes, [measured[s] for s in sizes])) for n in range(1, max_verify + 1))
    target.truncate(0)
    draft_token = 0.0
    if draft is not None:
        draft.truncate(0)
        draft.decode(context)
        _time_decode(draft, 64, probe, 1, 1)
        draft_token = _time_decode(draft, 64, probe, 1, max(3, repeats))
        draft.truncate(0)
    return Costs(verify, draft_token)


def costs_key(target: Model, draft: Optional[Drafter], max_verify: int = MAX_VERIFY) -> str:
    """The one key of a target and draft pair's costs: whoever measures them (load(), calibrate,
    doctor, bench) reads and writes the same entry."""
    return f"costs|{target.identity}|{draft.identity if draft is not None else '-'}|{max_verify}"


def costs(target: Model, draft: Optional[Drafter], max_verify: int = MAX_VERIFY) -> Costs:
    """measure_costs, cached under costs_key."""
    key = costs_key(target, draft, max_verify)
    cached = _load(key)
    if cached is not None:
        return Costs(tuple(cached["verify"]), cached["draft_token"])
    result = measure_costs(target, draft, max_verify)
    store(key, {"verify": list(result.verify), "draft_token": result.draft_token})
    return result
