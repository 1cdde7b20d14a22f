"""Measurements on disk, each with its evidence: what was measured, when, how, and whether it
checked out. A decode-cost curve is kept only if it is plausible and stable; a cached one is
checked against a few live decodes before anything decides from it.

Pure functions (no llama.cpp), tested on synthetic curves.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any, Optional

from .. import paths

FILE = "calibration.json"
# repeated one-token decodes (or draft steps) whose median is this far above their fastest say
# the machine was busy for most of them (a single slow one is a spike the fastest-of rule absorbs);
# a quiet 2-core VM reached 1.3x, a busy one 25x
STABLE = 1.5
# a bigger batch may time below a smaller one (CPU kernels work in blocks of 4 or 8 rows: on 2
# x86 cores a Q4_K_M batch of 4 decodes faster than one of 3), but not below this fraction of it
MONOTONE = 0.6
# a cached curve whose one-token cost live decodes put this far off (either way) is stale
STALE = 1.5
# timings this close are the same timing on any quiet machine: the OS's scheduling moves a
# decode by about this much, which on a GPU's (or a tiny model's) 0.5-2 ms decodes is more
# than the ratios above allow (calibrate refused most curves of a 0.4 ms model as a busy
# machine's); a busy machine moves them by whole decodes
JITTER = 0.0005


def read(key: str) -> Optional[dict]:
    return paths.read_cached(FILE, key)


def write(key: str, value: dict, how: str) -> dict:
    """Store value under key with its provenance (when, how); returns what was stored."""
    record = {**value, "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "how": how}
    paths.write_cached(FILE, key, record)
    return record


def _varied(values: Sequence[float]) -> bool:
    """Whether repeated timings say the machine was busy for most of them: their spread is over
    STABLE and their median further from their fastest than JITTER (a zero timing: busy)."""
    ratio = spread(values)
    if math.isinf(ratio):
        return bool(values)
    return ratio > STABLE and statistics.median(values) - min(values) > JITTER


def spread(values: Sequence[float]) -> float:
    """median / fastest of repeated timings (1.0: most were as fast as the fastest; inf: a zero
    or no timing)."""
    positive = [v for v in values if v > 0]
    return statistics.median(positive) / min(positive) if len(positive) == len(values) and positive else math.inf


def costs_problem(verify: Sequence[float], draft_token: float, v1_repeats: Sequence[float] = (),
                  draft_repeats: Sequence[float] = (), draft_batch: Optional[Sequence[float]] = None) -> Optional[str]:
    """Why a measured cost curve cannot be trusted, or None when it checks out: most repeated
    probes must be as fast as the fastest (else the machine was busy), a batch never costs far
    less than a smaller one, the curve's rows have no negative marginal cost, and its one-token cost agrees with
    the repeated one-token timings."""
    if not verify or any(not (v > 0 and math.isfinite(v)) for v in verify) or draft_token < 0:
        return "a timing was zero, negative or missing"
    if v1_repeats and _varied(v1_repeats):
        return f"one-token decodes varied: their median took {spread(v1_repeats):.1f}x the fastest"
    if draft_repeats and _varied(draft_repeats):
        return f"draft steps varied: their median took {spread(draft_repeats):.1f}x the fastest"
    if draft_batch is not None and draft_token > 0 and not draft_token < draft_batch[1] < draft_batch[0] * draft_token:
        return (f"the draft decoded {draft_batch[0]:.0f} tokens at once in {draft_batch[1] * 1e3:.0f} ms, against "
                f"{draft_token * 1e3:.0f} ms for one")
    for n in range(1, len(verify)):
        if verify[n] < verify[n - 1] * MONOTONE - JITTER:
            return (f"a batch of {n + 1} timed {verify[n] * 1e3:.0f} ms, below {verify[n - 1] * 1e3:.0f} ms for "
                    f"{n}")
    if len(verify) >= 3 and marginal(verify) < -0.02 * verify[0] - JITTER / len(verify):
        return f"each further row would cost {marginal(verify) * 1e3:.1f} ms (negative)"
    if v1_repeats:
        typical = statistics.median(v1_repeats)
        if max(typical, verify[0]) / min(typical, verify[0]) > STABLE and abs(typical - verify[0]) > JITTER:
            return (f"the curve's one-token cost {verify[0] * 1e3:.0f} ms disagrees with repeated one-token "
                    f"decodes ({typical * 1e3:.0f} ms)")
    return None


def marginal(verify: Sequence[float]) -> float:
    """The cost of one more row, as the median of pairwise slopes over sizes 2 and up."""
    ys = list(verify[1:])
    slopes = [(ys[j] - ys[i]) / (j - i) for i in range(len(ys)) for j in range(i + 1, len(ys))]
    return statistics.median(slopes) if slopes else 0.0


def stale(record: dict, v1_now: float, draft_now: Optional[float]) -> Optional[str]:
    """Why a cached curve no longer describes this machine (live decodes disagree), or None."""
    v1 = record["verify"][0]
    if max(v1, v1_now) / max(min(v1, v1_now), 1e-9) > STALE:
        return (f"one token took {v1 * 1e3:.0f} ms when measured ({record.get('measured_at', '?')}), "
                f"{v1_now * 1e3:.0f} ms now")
    draft = record.get("draft_token", 0.0)
    if draft_now is not None and draft > 0 and max(draft, draft_now) / max(min(draft, draft_now), 1e-9) > STALE:
        return f"a draft step took {draft * 1e3:.0f} ms when measured, {draft_now * 1e3:.0f} ms now"
    return None


def amend(key: str, name: str, value: Any) -> Optional[dict]:
    """Add a figure measured later to the record under key, with its own time (the record's
    provenance stays); None where there is no record."""
    record = read(key)
    if record is None:
        return None
    record = {**record, name: value, f"{name}_measured_at": time.strftime("%Y-%m-%d %H:%M:%S")}
    paths.write_cached(FILE, key, record)
    return record


def describe(record: Optional[dict]) -> str:
    """When and how a record was measured, for doctor and calibrate."""
    if record is None:
        return "not measured yet"
    return f"measured {record.get('measured_at', 'at an unknown time')} ({record.get('how', 'unknown')})"


def draft_batch(record: dict) -> Optional[tuple[int, float]]:
    """The record's timed draft batch (n tokens, seconds), or None where it has none or a bad one
    (records written before it was measured)."""
    return _timed(record, "draft_batch")


def draft_kv(record: dict) -> Optional[tuple[int, float]]:
    """The record's draft step timed at a long context (n_kv cached tokens, seconds), or None."""
    return _timed(record, "draft_kv")


def _timed(record: dict, name: str) -> Optional[tuple[int, float]]:
    value = record.get(name)
    if not isinstance(value, (list, tuple)) or len(value) != 2:
        return None
    try:
        n, seconds = int(value[0]), float(value[1])
    except (TypeError, ValueError):
        return None
    return (n, seconds) if n >= 2 and 0 < seconds < 600 else None


def costs_value(verify: Sequence[float], draft_token: float, **evidence: Any) -> dict:
    return {"verify": list(verify), "draft_token": draft_token, **evidence}
