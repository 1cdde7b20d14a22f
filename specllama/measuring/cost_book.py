"""The decode costs a target and draft pair's requests decide from, and where they came from.

In order of trust: a probe's curve (measure_costs: every verify size, repeated, checked for a
busy machine), cached per model, settings, build and machine, used only if it is plausible and a
few live decodes agree with it (records.py); a curve the rounds keep contradicting is replaced by
what they measure. Where none describes this machine, a first estimate timed at load
(cost_probes.first_costs) stands in and the rounds correct it from the first one on (OnlineCosts),
so a script's first request drafts; the probe is queued for idle time (or warm_up()).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Optional

from . import records
from .calibrate import costs_key
from .cost_probes import first_costs, measure_costs, quick_costs, time_draft_step
from ..controller import Costs, OnlineCosts
from .fidelity import DiffTable
from .idle import IdleWork, Task
from ..decoding.limits import MAX_VERIFY
from ..runtime.protocols import Drafter, Model

log = logging.getLogger("specllama")


class CostBook:
    """The costs in use (curve), their record and source in words, and the running estimates
    unseeded requests share (online). stash() keeps the conversations in RAM before the probe
    takes the contexts; probed() runs after a probe (the draft catches up again)."""

    def __init__(self, target: Model, draft: Optional[Drafter], idle: IdleWork, stash: Callable[[], None],
                 batch_diffs: DiffTable, probed: Callable[[], None]):
        self.target, self.draft, self.idle = target, draft, idle
        self._stash, self._batch_diffs, self._after_probe = stash, batch_diffs, probed
        self.curve: Optional[Costs] = None
        self.record: Optional[dict] = None  # what the curve came from, with its evidence
        self._written = False  # a probe's record of these models is in the calibration file
        self.source = "not measured"  # the same in words, for each request's stats
        self.probed = False  # the curve is a probe's (this process's or the cache's)
        self.online: Optional[OnlineCosts] = None
        self._v1_live: list[float] = []  # one-token decodes timed at load (stand for the first plain rounds)
        self._drift_probed = False  # rounds contradicted the curve and a probe was queued (once per object)

    def check_cached(self) -> None:
        """At load: take the cached curve if it is plausible and live decodes agree with it;
        otherwise time a first estimate and queue the probe for idle time (and say why). A curve
        without the draft's timed batch is used meanwhile, and probed again when idle."""
        record = records.read(costs_key(self.target, self.draft))
        draft_batch = None if record is None else records.draft_batch(record)
        draft_kv = None if record is None else records.draft_kv(record)
        problem = "not measured on this machine yet" if record is None else records.costs_problem(
            record["verify"], record["draft_token"], record.get("v1_repeats", ()), record.get("draft_repeats", ()),
            draft_batch)
        if record is not None and problem is None:
            problem = self._stale(record)
            if problem is not None:
                log.info("%s: the cached decode costs no longer describe this machine (%s); measuring them again "
                         "when idle", self.target.name, problem)
        if problem is None:
            assert record is not None
            self.curve = Costs(tuple(record["verify"]), record["draft_token"], draft_batch, draft_kv)
            self.record, self.source, self.probed, self._written = record, "cached probe", True, True
            if self.draft is None or draft_batch is not None:
                return
            # written before the draft's batch was timed: until it is, its prefills and catch-ups
            # are priced by the target's curve, which read a 118-token prefill of the Q4_K_M
            # draft beside the F16 target at about 87 ms where it took 0.55 s, and lanes beside
            # other requests started prefills that stalled them all
            log.info("%s: the cached decode costs predate timing the draft's batch; measuring them again when "
                     "idle", self.target.name)
        else:
            self._first_estimate(problem)
        self._queue_probe()

    def _first_estimate(self, why: str) -> None:
        """Costs that draft from the first request, where none cached describe this machine: a
        first estimate timed now (cost_probes.first_costs, about 1 s) that the rounds correct."""
        short = self._batch_diffs.known(0)
        costs, self._v1_live = first_costs(self.target, self.draft, short.verify_seconds if short else ())
        self.curve, self.online, self.source = costs, None, "first estimate timed at load"
        self.record = {**records.costs_value(costs.verify, costs.draft_token, v1_repeats=self._v1_live,
                                             draft_batch=list(costs.draft_batch) if costs.draft_batch else None),
                       "how": f"a first estimate timed at load, not cached (the curve: {why})"}

    def _queue_probe(self) -> None:
        self.idle.add(Task("costs", self._measure, what="the decode-cost curve", takes_context=True))

    def _stale(self, record: dict) -> Optional[str]:
        """Why live decodes disagree with a cached curve, or None; a disagreement is timed again
        before it counts, so one disturbed moment at load does not discard a good curve."""
        v1_now, draft_now = quick_costs(self.target, self.draft)
        self._v1_live = v1_now
        if records.stale(record, min(v1_now), None if draft_now is None else min(draft_now)) is None:
            return None
        v1_again, draft_again = quick_costs(self.target, self.draft)
        self._v1_live = v1_again
        return records.stale(record, min(v1_now + v1_again),
                             None if draft_now is None or draft_again is None else min(draft_now + draft_again))

    def get(self, measure: bool = False) -> Optional[Costs]:
        """The curve in use (None: none yet); measure=True probes it now where it was not probed
        yet (a first estimate is in use until then)."""
        if not self.probed and measure:
            self._stash()
            self._measure(lambda: False, attempts=1)
        return self.curve

    def _measure(self, stop: Callable[[], bool], attempts: int = 2) -> bool:
        self._stash()
        problem = None
        for _ in range(attempts):
            costs, evidence = measure_costs(self.target, self.draft, MAX_VERIFY, stop=stop)
            problem = records.costs_problem(costs.verify, costs.draft_token, **evidence)
            if problem is None:
                break
        self.curve, self.online, self.probed = costs, None, True
        self.source = "probe" if problem is None else "probe, not cached (the machine looked busy)"
        self._v1_live = evidence["v1_repeats"][-3:] if problem is None else []
        if problem is not None:  # used for now, never cached, measured again when idle
            log.warning("%s: the machine looked busy while measuring decode costs (%s); using them for now, not "
                        "caching them, measuring again when idle", self.target.name, problem)
            self.record = {**records.costs_value(costs.verify, costs.draft_token, **evidence),
                           "how": f"in use, not cached: {problem}"}
            return False
        self.record = records.write(costs_key(self.target, self.draft),
                                    records.costs_value(costs.verify, costs.draft_token, **evidence),
                                    "probe while idle")
        self._written = True
        self._after_probe()  # the probe took the draft's context; a long conversation's step is timed
        return True

    def shared(self) -> OnlineCosts:
        """The running estimates unseeded requests share (the curve's, corrected by their rounds)."""
        assert self.curve is not None
        if self.online is None:
            self.online = OnlineCosts(self.curve, v1_live=self._v1_live, verify_kv=self._batch_diffs.groups)
        return self.online

    def follow(self, rounds: OnlineCosts) -> None:
        """After a generation: where its rounds kept contradicting the curve, replace it."""
        corrected = rounds.drift()
        if corrected is None or self.curve is None:
            return
        # the rounds decide this object's choices now; the disk gets a probe's curve, with its
        # checks: rounds in contexts of their own read one F16 token at 123 ms where the probe
        # timed 82 ms in the same process, and a 34 s demo's rounds wrote a Q4_K_M curve 1.5-2x
        # its probe's, which every later process read
        log.info("%s: rounds measured one token at %.0f ms against %.0f ms in the cached curve; following them, "
                 "and measuring the curve again when idle", self.target.name, corrected.v(1) * 1e3,
                 self.curve.v(1) * 1e3)
        self.record = {**records.costs_value(corrected.verify, corrected.draft_token),
                       "how": "in use, not cached: live rounds off the cached curve by more than 1.5x"}
        self.curve, self.online = corrected, OnlineCosts(corrected, verify_kv=self._batch_diffs.groups)
        self.source = "live rounds"
        if not self._drift_probed:  # once: where rounds keep disagreeing with the probe, this object follows them
            self._drift_probed = True
            self._queue_probe()

    def draft_kv_wanted(self, n_kv: int, min_kv: int) -> bool:
        """Whether a draft step timed after n_kv (>= min_kv) cached tokens would teach the cached
        costs how its cost grows with the context: none is recorded at three quarters of that or more."""
        if self.curve is None or n_kv < min_kv or not self._written:
            return False
        return self.curve.draft_kv is None or self.curve.draft_kv[0] < 0.75 * n_kv

    def time_draft_kv(self, stop: Callable[[], bool]) -> None:
        """A draft step at the end of the conversation (idle), kept in the costs record and used."""
        assert self.draft is not None and self.curve is not None
        n_kv, seconds = time_draft_step(self.draft, stop)
        self.curve = replace(self.curve, draft_kv=(n_kv, seconds))
        if self.online is not None:
            self.online.learn_draft_kv(n_kv, seconds)
        log.info("%s: a draft step after %d cached tokens took %.0f ms (%.0f ms at the calibration's short "
                 "context)", self.target.name, n_kv, seconds * 1e3, self.curve.draft_token * 1e3)
        self.record = records.amend(costs_key(self.target, self.draft), "draft_kv", [n_kv, seconds])
