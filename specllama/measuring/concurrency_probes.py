"""Probes of what requests decoding side by side change, stored in the cache (records.py).

apart_diff: a lane's rows beside other lanes' in one shared context (sharing.py), against a
context of its own; measured once at load where lanes are asked for. piece_diff: a prompt
prefilled in pieces (runtime/batches.piece_end) between other requests' rounds, against whole
chunks; measured while idle where requests decode side by side, and a model's prefills beside
others go in pieces only where it measured 0: the pieces are then the chunks bit for bit, so
what a prompt computes (and the prompt cache's canonical prefix) does not depend on who else ran.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any, Optional

import numpy as np

from . import records
from .calibrate import Stop, apart_key, check_stop, max_abs_diff, never, piece_key
from .idle import IdleWork, Task
from ..runtime.batches import N_PIECE, piece_end
from ..runtime.protocols import Model

log = logging.getLogger("specllama")


def probe_apart_diff(solo: Model, shared: Any, n_prompt: int = 160, n_steps: int = 8) -> float:
    """The largest |logit difference| between a lane's one-token rows, decoded while another lane
    grows and rolls back beside it, and the same rows in a context of its own (solo, left empty).
    Teacher-forced on the solo rows' greedy choices; the lanes used are freed again."""
    rng, hi = np.random.default_rng(0), min(solo.n_vocab, 20000)
    prompt, filler = ([int(t) for t in rng.integers(100, hi, size=n)] for n in (n_prompt, n_prompt // 2))
    lane, other = shared.lane(0), shared.lane(1)
    try:
        other.decode(filler)
        lane.decode(prompt)
        solo.discard(0)
        solo.decode(prompt)
        worst = max_abs_diff(lane.logits(0), solo.logits(0))
        token = int(np.argmax(solo.logits(0)))
        for _ in range(n_steps):
            n_other = len(other.cached)
            other.decode(filler[:4], n_logits=4)  # another lane's verify, half of it rejected
            other.truncate(n_other + 2)
            solo.decode([token])
            lane.decode([token])
            worst = max(worst, max_abs_diff(lane.logits(0), solo.logits(0)))
            token = int(np.argmax(solo.logits(0)))
        return worst
    finally:
        solo.discard(0)
        for runtime in (lane, other):
            runtime.discard(0)


def cached_apart_diff(solo: Model, n_lanes: int) -> Optional[float]:
    """The difference measure_apart_diff stored for these lanes, or None where not measured."""
    record = records.read(apart_key(solo, n_lanes))
    return None if record is None else float(record["diff"])


def measure_apart_diff(solo: Model, shared: Any) -> float:
    """probe_apart_diff, stored under apart_key once per model file, settings, build and number
    of lanes (callers read the cached one first: cached_apart_diff)."""
    t0 = time.perf_counter()
    diff, seconds = probe_apart_diff(solo, shared), time.perf_counter() - t0
    records.write(apart_key(solo, shared.n_lanes), {"diff": diff, "seconds": seconds}, "probe at load")
    log.info("%s: a lane's rows differ from a context of its own by %.3g logits (measured in %.1f s)",
             solo.name, diff, seconds)
    return diff


# --- a prefill in pieces (runtime/core.py: Runtime.decode) --------------------------------------

N_TAIL = 13  # the probe's last piece holds N_PIECE + N_TAIL rows: a piece with a tail merged in
# the probe's whole chunk is one llama.cpp call (4.2 s for the F16 1.5B's 512 rows on 2 cores): it
# starts only after this long without a request, past a chat UI's follow-up requests or an agent's
# next turn, which would otherwise wait for it
PROBE_QUIET_SECONDS = 5.0


def piece_bounds(n_batch: int, n_tokens: int, n_piece: int = N_PIECE) -> list[tuple[int, int]]:
    """The batches the probe cuts n_tokens into, chunk by chunk of n_batch: pieces of n_piece,
    2 n_piece, 4 n_piece.. rows up to the chunk's end, as piece_end cuts a prefill beside others."""
    bounds = []
    for chunk_start in range(0, n_tokens, n_batch):
        start, chunk_end, n_want = chunk_start, min(chunk_start + n_batch, n_tokens), n_piece
        while start < chunk_end:
            end = piece_end(start, chunk_end, n_want, n_piece)
            bounds.append((start, end))
            start, n_want = end, 2 * n_want
    return bounds


def probe_length(runtime: Model, n_piece: int = N_PIECE, n_steps: int = 2) -> int:
    """The context the piece probe needs: a whole chunk, a piece, a last piece with a tail, steps."""
    return runtime.n_batch + 2 * n_piece + N_TAIL + n_steps


def probe_piece_diff(runtime: Model, stop: Stop = never, n_steps: int = 2, n_piece: int = N_PIECE) -> float:
    """The largest |logit difference| between a prompt of one whole chunk and a short one after
    it, prefilled chunk by chunk, and the same prompt in pieces (piece_bounds): its last row and
    n_steps greedy steps after it. inf where its context or chunk is too small to cut pieces."""
    n_batch, n_tokens = runtime.n_batch, probe_length(runtime, n_piece) - n_steps
    if n_batch < 4 * n_piece or n_tokens + n_steps > runtime.n_ctx:
        return math.inf
    rng, hi = np.random.default_rng(0), min(runtime.n_vocab, 20000)
    tokens = [int(t) for t in rng.integers(100, hi, size=n_tokens)]
    chunks = [(start, min(start + n_batch, n_tokens)) for start in range(0, n_tokens, n_batch)]
    try:
        rows = [_rows_after(runtime, tokens, bounds, stop, n_steps)
                for bounds in (chunks, piece_bounds(n_batch, n_tokens, n_piece))]
    finally:
        runtime.discard(0)
    return max(max_abs_diff(a, b) for a, b in zip(*rows))


def _rows_after(runtime: Model, tokens: list[int], bounds: list[tuple[int, int]], stop: Stop,
                n_steps: int) -> list[np.ndarray]:
    runtime.discard(0)
    for start, end in bounds:
        check_stop(stop)
        runtime.decode(tokens[start:end])
    rows = [runtime.logits(0).copy()]
    for _ in range(n_steps):
        runtime.decode([int(np.argmax(rows[-1]))])
        rows.append(runtime.logits(0).copy())
    return rows


def cached_piece_diff(runtime: Model) -> Optional[float]:
    record = records.read(piece_key(runtime))
    return None if record is None else float(record["diff"])


def measure_piece_diff(runtime: Model, stop: Stop = never, how: str = "probe while idle") -> float:
    """probe_piece_diff, stored under piece_key once per model file, settings and build."""
    t0 = time.perf_counter()
    diff = probe_piece_diff(runtime, stop)
    seconds = time.perf_counter() - t0
    records.write(piece_key(runtime), {"diff": diff, "seconds": seconds, "n_piece": N_PIECE}, how)
    log.info("%s: a prefill in pieces of %d rows differs from whole chunks by %.3g logits (measured in %.1f s)%s",
             runtime.name, N_PIECE, diff, seconds, "" if diff == 0 else "; prefills beside other requests stay whole")
    return diff


def _eligible(runtime: Any) -> bool:
    """Contexts of attention alone (no recurrent state to checkpoint at every piece, no MTP layers
    following the target's batches), with a chunk to cut and room to probe it."""
    return getattr(runtime, "memory", None) == "attention" and getattr(runtime, "mtp_head", True) is None \
        and runtime.n_batch >= 4 * N_PIECE and probe_length(runtime) <= runtime.n_ctx


def _n_piece(diff: float) -> int:
    return N_PIECE if diff == 0 else 0


def measure_pieces(pieces: dict[str, int], runtimes: tuple[Any, ...], fresh: bool = False) -> dict[str, float]:
    """Measure now (`specllama calibrate`) what plan_pieces would measure while idle, unless
    cached (fresh: again); the difference per model name."""
    out = {}
    for runtime in filter(_eligible, runtimes):
        diff = None if fresh else cached_piece_diff(runtime)
        diff = measure_piece_diff(runtime, how="specllama calibrate") if diff is None else diff
        pieces[runtime.identity], out[runtime.name] = _n_piece(diff), diff
    return out


def plan_pieces(pieces: dict[str, int], runtimes: tuple[Any, ...], idle: IdleWork, stash: Callable[[], None],
                after: Callable[[], None]) -> None:
    """Fill pieces (identity: the rows a model's prefill beside others, and the draft's catch-up
    while idle, go in pieces of: planner.queue_catch_up) from the cache, and queue the probe while
    idle for models not measured yet (_eligible ones): until it runs, their prefills stay whole.
    after(): once a probe ran."""
    for runtime in filter(_eligible, runtimes):
        diff = cached_piece_diff(runtime)
        if diff is not None:
            pieces[runtime.identity] = _n_piece(diff)
            continue

        def run(stop: Stop, runtime: Any = runtime) -> bool:
            diff = cached_piece_diff(runtime)  # `specllama calibrate` may have measured it meanwhile
            if diff is None:
                stash()
                diff = measure_piece_diff(runtime, stop)
                after()
            pieces[runtime.identity] = _n_piece(diff)
            return True

        idle.add(Task(f"pieces|{runtime.identity}", run, what=f"{runtime.name}'s prefill in pieces",
                      takes_context=True, quiet=PROBE_QUIET_SECONDS, beside=True))
