"""For each request, which proposer and policy it decodes with, from what was measured on this
machine, and what to measure when the process is idle.

No probe runs on a request's path: a request at a KV length whose verify limit is not known
decodes plainly there, one on a reused prompt cache whose reuse difference is not known judges
near-ties with an assumed one (fidelity.ASSUMED_REUSE_DIFF: over-counted, never missed), one
without decode costs decodes plainly, and each missing measurement is queued (idle.py). Costs
check themselves: a cached curve is used only if it is plausible and a few live decodes agree
with it (records.py); a curve the rounds keep contradicting is replaced by what they measure.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, Optional

from . import records
from .calibrate import (acceptance_key, cached_batch_diffs, cached_reuse_diffs, costs_key, fidelity_group,
                        first_costs, measure_batch_diffs, measure_costs, measure_reuse_diffs, quick_costs,
                        time_draft_step)
from .controller import Acceptance, Controller, Costs, FixedDraft, OnlineCosts, Policy, draft_can_pay
from .fidelity import DiffTable, Level, ReuseTable, group_label, kv_group
from .idle import IdleWork, Preempted, Task, in_pieces
from .limits import AUTO_WIDTH, MAX_DRAFT, MAX_N_DRAFT, MAX_VERIFY
from .prompt_cache import PromptCache
from .proposers import DraftModelProposer, PromptLookupProposer, Proposer
from .runtime.batches import KV_PAD, kv_length
from .runtime.protocols import Drafter, Model
from .runtime.session import common_prefix
from .request import Request

log = logging.getLogger("specllama")

CATCH_UP_MIN = 64  # a draft this far behind the target's live sequence catches up while idle
DRAFT_KV_MIN = 512  # a conversation this long times the draft's step at its length while idle


class Planner:
    """A target and draft pair's measurements, the policy each request gets from them, and the
    measurements queued for idle time. stash() keeps the conversations in RAM (saved states)
    before a probe takes the context."""

    def __init__(self, target: Model, draft: Optional[Drafter], lookup: Optional[bool], stash: Callable[[], None],
                 idle: IdleWork, draft_cache: Optional[PromptCache] = None,
                 n_piece: Callable[[Any], int] = lambda runtime: 0):
        self.target, self.draft, self.lookup, self.idle = target, draft, lookup, idle
        # the rows a model's prefill goes in pieces of where measured bitwise (slots.Pool.n_piece)
        self._stash, self._draft_cache, self._n_piece = stash, draft_cache, n_piece
        self._conversation: list[int] = []  # the last generation's tokens, for the draft to catch up with
        self._conversation_scope = ""  # its prompt-cache scope
        self._costs: Optional[Costs] = None
        self.costs_record: Optional[dict] = None  # what the costs in use came from, with its evidence
        self.costs_from = "not measured"  # the same in words, for each request's stats
        self._probed = False  # the costs in use come from a probe (this process's or the cache's)
        self._online_costs: Optional[OnlineCosts] = None
        self._v1_live: list[float] = []  # one-token decodes timed at load (stand for the first plain rounds)
        self._drift_probed = False  # rounds contradicted the curve and a probe was queued (once per object)
        # the draft's confidence calibration, learned across calls and kept on disk per pair;
        # greedy and sampled drafts mean different things by confidence (top probability; q of
        # a sampled token)
        self._acceptance = {greedy: Acceptance() if draft is None else
                            Acceptance.from_record(records.read(acceptance_key(target, draft, greedy)))
                            for greedy in (True, False)}
        self._n_judged_cached = {greedy: a.n_judged for greedy, a in self._acceptance.items()}
        self._n_judged_kept = {True: 0, False: 0}  # drafts judged when each record was last written
        self._explained: set[Level] = set()
        self.batch_diffs = DiffTable(lambda group: cached_batch_diffs(target, group), self._want_fidelity,
                                     target.n_ctx)
        self.reuse_diffs = ReuseTable(lambda group: cached_reuse_diffs(target, group), self._want_reuse, target.n_ctx)

    @property
    def speculates(self) -> bool:
        """Whether anything proposes tokens (a draft model or prompt lookup)."""
        return self.draft is not None or self.lookup is True

    # --- decode costs ----------------------------------------------------------------------

    def check_cached_costs(self) -> None:
        """At load: take the cached curve if it is plausible and live decodes agree with it;
        otherwise queue a measurement for idle time (and say why). A curve without the draft's
        timed batch is used meanwhile, and measured again when idle."""
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
            self._costs = Costs(tuple(record["verify"]), record["draft_token"], draft_batch, draft_kv)
            self.costs_record, self.costs_from, self._probed = record, "cached probe", True
            if self.draft is None or draft_batch is not None:
                return
            # written before the draft's batch was timed: until it is, its prefills and catch-ups
            # are priced by the target's curve, which read a 118-token prefill of the Q4_K_M
            # draft beside the F16 target at about 87 ms where it took 0.55 s, and lanes beside
            # other requests started prefills that stalled them all
            log.info("%s: the cached decode costs predate timing the draft's batch; measuring them again when "
                     "idle", self.target.name)
        else:
            self._start_from_first_costs(problem)
        self._queue_costs_probe()

    def _start_from_first_costs(self, why: str) -> None:
        """Costs that draft from the first request, where none cached describe this machine: a
        first estimate timed now (calibrate.first_costs, about 1 s) that the rounds correct."""
        short = self.batch_diffs.known(0)
        costs, self._v1_live = first_costs(self.target, self.draft, short.verify_seconds if short else ())
        self._costs, self._online_costs, self.costs_from = costs, None, "first estimate timed at load"
        self.costs_record = {**records.costs_value(costs.verify, costs.draft_token, v1_repeats=self._v1_live,
                                                   draft_batch=list(costs.draft_batch) if costs.draft_batch else None),
                             "how": f"a first estimate timed at load, not cached (the curve: {why})"}

    def _queue_costs_probe(self) -> None:
        self.idle.add(Task("costs", self._measure_costs, what="the decode-cost curve", takes_context=True))

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

    @property
    def costs_pending(self) -> bool:
        """Whether the decode-cost curve is still to be probed (a first estimate in use meanwhile)."""
        return self.speculates and not self._probed

    def costs(self, measure: bool = False) -> Optional[Costs]:
        """The decode costs in use (None: none yet); measure=True probes them now where they were
        not probed yet (a first estimate is in use until then)."""
        if not self._probed and measure:
            self._stash()
            self._measure_costs(lambda: False, attempts=1)
        return self._costs

    def _measure_costs(self, stop: Callable[[], bool], attempts: int = 2) -> bool:
        self._stash()
        problem = None
        for _ in range(attempts):
            costs, evidence = measure_costs(self.target, self.draft, MAX_VERIFY, stop=stop)
            problem = records.costs_problem(costs.verify, costs.draft_token, **evidence)
            if problem is None:
                break
        self._costs, self._online_costs, self._probed = costs, None, True
        self.costs_from = "probe" if problem is None else "probe, not cached (the machine looked busy)"
        self._v1_live = evidence["v1_repeats"][-3:] if problem is None else []
        if problem is not None:  # used for now, never cached, measured again when idle
            log.warning("%s: the machine looked busy while measuring decode costs (%s); using them for now, not "
                        "caching them, measuring again when idle", self.target.name, problem)
            self.costs_record = {**records.costs_value(costs.verify, costs.draft_token, **evidence),
                                 "how": f"in use, not cached: {problem}"}
            return False
        self.costs_record = records.write(costs_key(self.target, self.draft),
                                          records.costs_value(costs.verify, costs.draft_token, **evidence),
                                          "probe while idle")
        self.queue_catch_up()  # the probe took the draft's context; a long conversation's step is timed
        return True

    def learned(self, policy: Policy) -> None:
        """After a generation: keep what the pair's drafts taught (not a seeded generation's,
        which starts fresh); where the rounds kept contradicting the curve, replace it."""
        if not isinstance(policy, Controller):
            return
        for greedy, acceptance in self._acceptance.items():
            if acceptance is policy.draft_acceptance.pair and self.draft is not None \
                    and acceptance.n_judged != self._n_judged_kept[greedy]:  # something new was judged
                records.write(acceptance_key(self.target, self.draft, greedy), acceptance.record(), "live rounds")
                self._n_judged_kept[greedy] = acceptance.n_judged
        corrected = policy.costs.drift()
        if corrected is None or self._costs is None:
            return
        # the rounds decide this object's choices now; the disk gets a probe's curve, with its
        # checks: rounds in contexts of their own read one F16 token at 123 ms where the probe
        # timed 82 ms in the same process, and a 34 s demo's rounds wrote a Q4_K_M curve 1.5-2x
        # its probe's, which every later process read
        log.info("%s: rounds measured one token at %.0f ms against %.0f ms in the cached curve; following them, "
                 "and measuring the curve again when idle", self.target.name, corrected.v(1) * 1e3,
                 self._costs.v(1) * 1e3)
        self.costs_record = {**records.costs_value(corrected.verify, corrected.draft_token),
                             "how": "in use, not cached: live rounds off the cached curve by more than 1.5x"}
        self._costs, self._online_costs = corrected, OnlineCosts(corrected, verify_kv=self.batch_diffs.groups)
        self.costs_from = "live rounds"
        if not self._drift_probed:  # once: where rounds keep disagreeing with the probe, this object follows them
            self._drift_probed = True
            self._queue_costs_probe()

    @staticmethod
    def learned_so_far(policy: Policy) -> tuple[int, int]:
        """(rounds timed, drafts judged) in the figures policy decides from, for sources()."""
        if not isinstance(policy, Controller):
            return 0, 0
        return policy.costs.n_observed, policy.draft_acceptance.n_judged

    def sources(self, policy: Policy, before: tuple[int, int]) -> dict:
        """Where the figures a request decided from came from: the cache, this process, its own
        rounds (before: learned_so_far(policy) as it started), or assumptions."""
        if not isinstance(policy, Controller):
            return {"decode_costs": "not used (a fixed n_draft, or plain decoding)"}
        n_timed, n_judged = self.learned_so_far(policy)
        costs = self.costs_from if not policy.costs.frozen else f"{self.costs_from}, frozen for a seeded request"
        if n_timed:
            costs += f"; {n_timed} rounds timed in this process, {n_timed - before[0]} in this request"
        n_cached = next((self._n_judged_cached[greedy] for greedy, acceptance in self._acceptance.items()
                         if acceptance is policy.draft_acceptance.pair), 0)  # 0: a seeded request's own
        if n_judged == 0:
            acceptance = "assumed: no draft judged yet (hoped for until a few are)"
        else:
            acceptance = (f"{n_cached} drafts judged in the cache, " if n_cached else "") + \
                f"{n_judged - n_cached} in this process, {n_judged - before[1]} in this request"
        return {"decode_costs": costs, "draft_acceptance": acceptance}

    # --- fidelity and reuse, measured on the live conversation when idle ------------------------

    def _want_fidelity(self, n_past: int, bound: float) -> None:
        group = fidelity_group(n_past, self.target.n_ctx)
        where = partial(probe_position_in, self.target, group, MAX_VERIFY)

        def run(stop: Callable[[], bool]) -> None:
            at = where()
            if at is None:
                raise Preempted()
            self._stash()
            self.batch_diffs.groups[group] = measure_batch_diffs(self.target, at, bound, stop, "probe while idle")

        self.idle.add(Task(f"fidelity|{group}|{bound}", run, lambda: where() is not None,
                           what=f"the verify limit at {group_label(group)}", depth=group))

    def _want_reuse(self, n_past: int) -> None:
        group = kv_group(kv_length(n_past + 1, self.target.n_ctx))
        where = partial(probe_position_in, self.target, group, 13)

        def run(stop: Callable[[], bool]) -> None:
            at = where()
            if at is None:
                raise Preempted()
            self._stash()
            self.reuse_diffs.groups[group] = measure_reuse_diffs(self.target, at, stop)

        self.idle.add(Task(f"reuse|{group}", run, lambda: where() is not None,
                           what=f"the reuse difference at {group_label(group)}", depth=group))

    def want_catch_up(self, scope: str = "") -> None:
        """After a generation: the reuse difference where the conversation now ends is queued (the
        next turn reuses it all once it is known), and a draft far behind the target's
        conversation catches up while idle, so the next turn drafts from its first token; there
        its step is timed where the costs know none at such a length (_draft_kv_wanted)."""
        if self.target.cached:
            self.reuse_diffs.get(len(self.target.cached) - 1)
        # the conversation as it ends now: a probe queued before the task may take the target's
        # context first (its state kept in RAM), and the draft then caught up with the probe's
        self._conversation, self._conversation_scope = list(self.target.cached), scope
        self.queue_catch_up()

    def queue_catch_up(self) -> None:
        draft, cache = self.draft, self._draft_cache
        if draft is None or cache is None or draft.follows_target:
            return
        if len(self._conversation) - common_prefix(draft.cached, self._conversation) < CATCH_UP_MIN and \
                not self._draft_kv_wanted(len(self._conversation)):
            return

        def run(stop: Callable[[], bool]) -> None:
            tokens, scope, runtime = self._conversation, self._conversation_scope, cache.runtime
            n_batch = runtime.n_batch
            with in_pieces(runtime, self._n_piece(runtime), stop):  # a request waits a piece, not a chunk
                for end in range(common_prefix(draft.cached, tokens) // n_batch * n_batch + n_batch,
                                 len(tokens) + n_batch, n_batch):
                    if stop():
                        raise Preempted()
                    cache.prefill(tokens[:min(end, len(tokens))], canonical=False, scope=scope)
            if self._draft_kv_wanted(len(draft.cached)):
                self._time_draft_kv(stop)

        self.idle.add(Task("draft catch-up", run, what="the draft catching up with the conversation", restores=True))

    def _draft_kv_wanted(self, n_kv: int) -> bool:
        """Whether a draft step timed after n_kv cached tokens would teach the cached costs how
        its cost grows with the context: none is recorded at three quarters of that or more."""
        if self._costs is None or n_kv < DRAFT_KV_MIN or records.read(costs_key(self.target, self.draft)) is None:
            return False
        return self._costs.draft_kv is None or self._costs.draft_kv[0] < 0.75 * n_kv

    def _time_draft_kv(self, stop: Callable[[], bool]) -> None:
        """A draft step at the end of the conversation (idle), kept in the costs record and used."""
        assert self.draft is not None and self._costs is not None
        n_kv, seconds = time_draft_step(self.draft, stop)
        self._costs = replace(self._costs, draft_kv=(n_kv, seconds))
        if self._online_costs is not None:
            self._online_costs.learn_draft_kv(n_kv, seconds)
        log.info("%s: a draft step after %d cached tokens took %.0f ms (%.0f ms at the calibration's short "
                 "context)", self.target.name, n_kv, seconds * 1e3, self._costs.draft_token * 1e3)
        self.costs_record = records.amend(costs_key(self.target, self.draft), "draft_kv", [n_kv, seconds])

    def measure_short(self, levels: tuple[Level, ...], batching: bool = False) -> None:
        """At load: the short context's verify limit for each level, measured now if no cache
        holds it (5-8 s once per model file, settings and build). Every drafting round needs it,
        fixed lengths too, and so do requests whose rows share passes (batching); load is not a
        request's path; longer KV lengths wait for idle."""
        if not self.speculates and not batching:
            return
        for level in levels:
            if not level.limited:
                continue
            have = self.batch_diffs.known(0)
            if have is not None and have.covers(level.bound):
                continue
            if self.target.n_ctx < 2 * MAX_VERIFY:  # no room to probe: decodes plainly
                continue
            self._stash()
            self.batch_diffs.groups[0] = measure_batch_diffs(self.target, 0, level.bound, how="probe at load")

    # --- each request's plan ----------------------------------------------------------------------

    def explain_short_limit(self, level: Level) -> int:
        """The short-context limit of level (1 while not measured), explained once when known."""
        short = self.batch_diffs.get(0, level.bound)  # None: not measured yet, or no room to probe
        n_verify = 1 if short is None else short.largest_batch(level.bound)
        if short is None or level in self._explained:
            return n_verify
        self._explained.add(level)
        if n_verify == 1 and short.diffs:
            log.info("%s: on this backend no verify batch stays within the %s level (the closest differs from "
                     "single-token decoding by %.3g logits), so it decodes plainly; exact=\"rounding\" or \"off\" "
                     "allows drafting", self.target.name, level, short.diffs[0])
        elif n_verify < MAX_VERIFY:
            log.debug("%s: verify batches over %d tokens differ from single-token decoding by more than the %s "
                      "level allows; drafting at most %d tokens a round", self.target.name, n_verify, level,
                      n_verify - 1)
        return n_verify

    def plan(self, req: Request, prompt_cache: Optional[PromptCache],
             draft: Optional[Drafter] = None) -> tuple[Optional[Proposer], Policy]:
        """The request's proposer (None: plain decoding) and policy; draft: the context the
        request's slot drafts in (the first slot's by default)."""
        draft = draft if draft is not None else self.draft
        # a grammar's forced tokens are a source even where nothing else proposes
        forced = Proposer(None, None) if req.constraint is not None and req.constraint.grammar is not None \
            and req.n_draft != 0 else None
        if not self.speculates or req.n_draft == 0:
            return forced, FixedDraft(0)
        policy = self._policy(req, _working_clock(draft))
        if not (policy.has_draft or policy.lookup):
            return forced, FixedDraft(0)
        drafting = DraftModelProposer(draft, prompt_cache, canonical=req.seeded, scope=req.cache_scope) \
            if policy.has_draft and draft is not None and _reads(draft, req.prompt) else None
        return Proposer(drafting, PromptLookupProposer() if policy.lookup or drafting is None else None), policy

    def _policy(self, req: Request, clock: Callable[[], float] = time.perf_counter) -> Policy:
        level = req.level
        # the short-context limit; rounds at longer KV lengths get their own (Limits)
        limit = self.explain_short_limit(level) - 1 if level.limited else MAX_N_DRAFT
        has_draft = self.draft is not None
        if req.n_draft != "auto":
            assert isinstance(req.n_draft, int)
            return FixedDraft(min(req.n_draft, limit), has_draft=has_draft, lookup=self.lookup is True,
                              width=req.tree if isinstance(req.tree, int) else 1)
        # decode plainly without costs; and a seeded request, whose text must not depend on
        # what one load's first estimate timed, until a probe's curve is in use
        if self._costs is None or (req.seeded and not self._probed):
            return FixedDraft(0)
        acceptance: Any
        if req.seeded:  # the same seed must give the same text: decide from the cached curve alone
            costs, acceptance = OnlineCosts(self._costs, frozen=True), Acceptance()
        else:
            if self._online_costs is None:
                self._online_costs = OnlineCosts(self._costs, v1_live=self._v1_live, verify_kv=self.batch_diffs.groups)
            costs, acceptance = self._online_costs, self._acceptance[req.sampling.greedy]
        lookup = self.lookup is True or (self.lookup is None and has_draft)
        limit = min(limit, MAX_DRAFT)
        # not even an always-right draft beats plain decoding here: leave the draft model idle
        return Controller(costs, limit, has_draft=has_draft and draft_can_pay(costs, limit), lookup=lookup,
                          acceptance=acceptance, width=AUTO_WIDTH if req.tree == "auto" else int(req.tree),
                          n_tokens=req.max_tokens, clock=clock)


def probe_position_in(target: Model, group: int, n_rows: int) -> Optional[int]:
    """Where a probe of n_rows rows measures KV group `group` on target's live sequence: the
    last position the cache holds whose rows stay in one padding step of the group (0 for the
    short context); None while the cache does not reach the group."""
    if group == 0:
        return 0
    n_ctx = target.n_ctx
    n = min(len(target.cached), n_ctx - n_rows)
    while n > 0:
        n_kv = kv_length(n + 1, n_ctx)
        if kv_group(n_kv) < group:
            return None
        if kv_group(n_kv) == group and n + n_rows <= n_kv:
            return n
        n = n_kv - n_rows if n + n_rows > n_kv else n_kv - KV_PAD - n_rows
    return None


def _working_clock(draft: Optional[Drafter]) -> Callable[[], float]:
    """The controller's clock: seconds now, less what the draft's decodes spent on other lanes
    (waiting for their passes, and their rows' share of the passes its rows rode in): the gaps
    between draft_more calls then time this lane's share of its steps, not the others'."""
    if draft is None:
        return time.perf_counter
    return lambda: time.perf_counter() - draft.t_waited_total


def _reads(draft: Drafter, prompt: list[int]) -> bool:
    """Whether the draft model can read the prompt: ids past its vocabulary (a 7B target's
    padding ids beside a 0.5B draft, sent as token ids) would fail in its decode, so such a
    request drafts with prompt lookup alone."""
    if max(prompt) < draft.n_vocab:
        return True
    log.info("the prompt holds token ids past %s's %d; this request drafts without it", draft.name, draft.n_vocab)
    return False
