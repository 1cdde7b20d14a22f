"""Measurements of the target on this machine, cached so each runs once per model and settings.

invariant_batch_size: the largest verify batch whose logits are bitwise identical to decoding
the same tokens one at a time. llama.cpp picks kernels by batch size (on our CPUs Q4_K rows
change by ~0.4 logits from 4 tokens on), so greedy output is only guaranteed identical to the
target alone when every verify pass stays within this size.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

import numpy as np

from . import paths
from .controller import Costs
from .runtime import Runtime

log = logging.getLogger("specllama")

PROBE_TEXT = ("The lighthouse on the northern cape was built in 1843. def area(r): return 3.14159 * r * r\n"
              '{"name": "Maria", "age": 34, "city": "Lisbon"} and then the keepers wrote in their logs')
N_CONTEXT = 8  # tokens in the cache before the probed rows, as in a real round


def _load(key: str) -> dict | None:
    return paths.read_cached("calibration.json", key)


def _store(key: str, value: dict) -> None:
    paths.write_cached("calibration.json", key, value)


def probe_invariant_batch_size(target: Runtime, max_batch: int) -> int:
    """Measure the largest b <= max_batch such that every batch of 2..b tokens gives, row for
    row, bitwise the logits of single-token decoding. Clears target's KV cache."""
    tokens = target.tokenize(PROBE_TEXT, add_special=False)
    while len(tokens) < N_CONTEXT + max_batch:
        tokens = tokens + tokens
    prefix, probe = tokens[:N_CONTEXT], tokens[N_CONTEXT:N_CONTEXT + max_batch]
    target.truncate(0)
    target.decode(prefix)
    single = []
    for token in probe:
        target.decode([token])
        single.append(target.logits(0).copy())
    best = 1
    for n in range(2, max_batch + 1):
        target.truncate(N_CONTEXT)
        target.decode(probe[:n], n_logits=n)
        if not all(np.array_equal(target.logits(i), single[i]) for i in range(n)):
            break
        best = n
    target.truncate(0)
    return best


def invariant_batch_size(target: Runtime, max_batch: int) -> int:
    """probe_invariant_batch_size, cached per model file, settings and llama.cpp build."""
    key = f"invariant_batch|{target.identity}|{max_batch}"
    cached = _load(key)
    if cached is not None:
        return int(cached["batch"])
    batch = probe_invariant_batch_size(target, max_batch)
    log.info("%s: verify batches up to %d tokens are bitwise identical to single-token decoding",
             target.name, batch)
    _store(key, {"batch": batch})
    return batch


VERIFY_SIZES = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def _time_decode(runtime: Runtime, n_context: int, tokens: list[int], n: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        runtime.truncate(n_context)
        t0 = time.perf_counter()
        runtime.decode(tokens[:n], n_logits=n)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_costs(target: Runtime, draft: Optional[Runtime], max_verify: int = 16, repeats: int = 2) -> Costs:
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


def costs(target: Runtime, draft: Optional[Runtime], max_verify: int = 16) -> Costs:
    """measure_costs, cached per target and draft identity."""
    key = f"costs|{target.identity}|{draft.identity if draft is not None else '-'}|{max_verify}"
    cached = _load(key)
    if cached is not None:
        return Costs(tuple(cached["verify"]), cached["draft_token"])
    result = measure_costs(target, draft, max_verify)
    _store(key, {"verify": list(result.verify), "draft_token": result.draft_token})
    return result
