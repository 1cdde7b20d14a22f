"""Measurements of the target on this machine, cached so each runs once per model and settings.

invariant_batch_size: the largest verify batch whose logits are bitwise identical to decoding
the same tokens one at a time. llama.cpp picks kernels by batch size (on our CPUs Q4_K rows
change by ~0.4 logits from 4 tokens on), so greedy output is only guaranteed identical to the
target alone when every verify pass stays within this size.
"""

from __future__ import annotations

import json
import logging

import numpy as np

from . import paths
from .runtime import Runtime

log = logging.getLogger("specllama")

PROBE_TEXT = ("The lighthouse on the northern cape was built in 1843. def area(r): return 3.14159 * r * r\n"
              '{"name": "Maria", "age": 34, "city": "Lisbon"} and then the keepers wrote in their logs')
N_CONTEXT = 8  # tokens in the cache before the probed rows, as in a real round


def _load(key: str) -> dict | None:
    try:
        return json.loads((paths.cache_dir() / "calibration.json").read_text()).get(key)
    except (OSError, ValueError):
        return None


def _store(key: str, value: dict) -> None:
    path = paths.cache_dir() / "calibration.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


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
