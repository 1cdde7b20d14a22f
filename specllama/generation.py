"""One generation's steps around the decode loop, apart from the object that runs them
(engine.SpecLlama._run): the prompt into the target, its rounds in the models' turn, the
accepted tokens out, and its figures when it ends."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any, Optional

from .measuring.fidelity import Limits
from .caching.prompt_cache import PromptCache, Reuse
from .request import Request
from .runtime.ggml import resident_bytes
from .runtime.protocols import Drafter, Model
from .decoding.sampling import SamplingSettings
from .decoding.stats import Stats
from .streams import ProgressReport


def prefill(cache: PromptCache, req: Request, turn: Any, stats: Stats, t_start: float) -> Reuse:
    """The prompt into cache's runtime, in the models' turn, and what it reused into stats.
    Bitwise output and seeded sampling reuse only what a fresh prefill computes bit for bit;
    otherwise all that matches. req.on_progress is told how the prefill goes."""
    report = ProgressReport(req.on_progress, len(req.prompt)) if req.on_progress is not None else None
    with turn:
        reuse = cache.prefill(req.prompt, req.canonical, req.cache_scope, report)
        if report is not None:
            report.done()
    stats.t_prefill = time.perf_counter() - t_start
    stats.n_prompt_cached, stats.prompt_cache, stats.prompt_cache_exact = reuse.n_reused, reuse.source, reuse.exact
    return reuse


def finish_stats(stats: Stats, req: Request, tokens: list[int], finish: str, stopped: bool, limits: Limits,
                  policy: Any, t_start: float, n_replayed: int, target: Model, draft: Optional[Drafter]) -> None:
    stats.n_generated = len(tokens)
    stats.verify_limits = limits.used
    stats.measurements_pending = sorted(limits.waiting)
    if req.constraint is not None:
        stats.n_constrained_rows, stats.t_constraint = req.constraint.n_rows, req.constraint.seconds
    stats.controller = policy.as_dict()
    _keep_near_ties(stats, len(tokens) + (finish == "stop" and not stopped), req.sampling)
    stats.t_total = time.perf_counter() - t_start
    stats.n_replayed = n_replayed
    for runtime, name in ((target, "n_bytes_target"), (draft, "n_bytes_draft")):
        if runtime is not None and runtime.memory_use is not None:
            setattr(stats, name, runtime.memory_use.total)
    stats.n_bytes_resident = resident_bytes()


def _keep_near_ties(stats: Stats, n_decided: int, sampling: SamplingSettings) -> None:
    """Near-ties among the tokens this generation decided (the emitted ones, and an end-of-
    generation token that ended it); rounds may have run past max_tokens or a stop string."""
    if not sampling.greedy:
        stats.near_ties = None  # sampled rows have no single choice to flip
    stats.near_tie_positions = [p for p in stats.near_tie_positions if p < n_decided]
    if stats.near_ties is not None:
        stats.near_ties = len(stats.near_tie_positions)


def in_turns(steps: Iterator[Any], turn: Any) -> Iterator[Any]:
    """steps, each one computed in the models' turn (the other slots' rounds wait for it, and
    this one waits for theirs): between steps, nothing is held."""
    while True:
        with turn:
            step = next(steps, None)
        if step is None:
            return
        yield step


def accepted_tokens(steps: Iterator[Any]) -> Iterator[tuple[int, str, Any]]:
    """(token, who chose it (Step.origin), its logprobs or None) for every token the rounds accept."""
    for step in steps:
        for i, token in enumerate(step.tokens):
            yield token, step.origin(i), None if step.logprobs is None else step.logprobs[i]

