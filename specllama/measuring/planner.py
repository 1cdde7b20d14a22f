"""For each request, which proposer and policy it decodes with, from what was measured on this
machine, and what to measure when the process is idle.

No probe runs on a request's path: a request at a KV length whose verify limit is not known
decodes plainly there, or with a shorter context's limit where the level allows a difference
(fidelity.DiffTable.assumed, checked on a live round); one on a reused prompt cache whose reuse
difference is not known judges near-ties with an assumed one (fidelity.ASSUMED_REUSE_DIFF:
over-counted, never missed); decode costs start from a first estimate timed at load
(cost_book.py); and each missing measurement is queued (idle.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Optional

from . import records
from .calibrate import (acceptance_key, cached_batch_diffs, cached_reuse_diffs, fidelity_group,
                        measure_batch_diffs, measure_reuse_diffs)
from ..controller import Acceptance, Controller, FixedDraft, OnlineCosts, Policy, draft_can_pay
from .cost_book import CostBook
from .fidelity import DiffTable, Level, ReuseTable, group_label, kv_group
from .idle import IdleWork, Preempted, Task, in_pieces
from ..decoding.limits import AUTO_WIDTH, MAX_DRAFT, MAX_N_DRAFT, MAX_VERIFY
from ..caching.prompt_cache import PromptCache
from ..decoding.proposers import DraftModelProposer, PromptLookupProposer, Proposer
from ..runtime.batches import KV_PAD, kv_length
from ..runtime.protocols import Drafter, Model
from ..runtime.session import common_prefix
from ..request import Request
from ..decoding.stats import Stats

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
        self.book = CostBook(target, draft, idle, stash, self.batch_diffs, self.queue_catch_up)  # the decode costs

    @property
    def speculates(self) -> bool:
        """Whether anything proposes tokens (a draft model or prompt lookup)."""
        return self.draft is not None or self.lookup is True

    @property
    def costs_pending(self) -> bool:
        """Whether the decode-cost curve is still to be probed (a first estimate in use meanwhile)."""
        return self.speculates and not self.book.probed

    def after(self, policy: Policy, scope: str, on_first_slot: bool) -> None:
        """(the models' turn held) After a generation: what its rounds taught, and, where it ran
        on the first slot's contexts (the ones the planner measures on), what to measure next."""
        self.learned(policy)
        if on_first_slot:
            self.want_catch_up(scope)

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
        self.book.follow(policy.costs)

    @staticmethod
    def learned_so_far(policy: Policy) -> tuple[int, int]:
        """(rounds timed, drafts judged) in the figures policy decides from, for sources()."""
        if not isinstance(policy, Controller):
            return 0, 0
        return policy.costs.n_observed, policy.draft_acceptance.n_judged

    def account(self, stats: Stats, req: Request, policy: Policy, before: tuple[int, int]) -> None:
        """A generation's stats: where its figures came from, and the cost probe if it is pending."""
        stats.sources = self.sources(policy, before)
        if req.n_draft == "auto" and self.costs_pending:
            stats.measurements_pending.append("the decode-cost curve (a first estimate and the rounds' timings "
                                              "stand in)")

    def sources(self, policy: Policy, before: tuple[int, int]) -> dict:
        """Where the figures a request decided from came from: the cache, this process, its own
        rounds (before: learned_so_far(policy) as it started), or assumptions."""
        if not isinstance(policy, Controller):
            return {"decode_costs": "not used (a fixed n_draft, or plain decoding)"}
        n_timed, n_judged = self.learned_so_far(policy)
        costs = self.book.source + (", frozen for a seeded request" if policy.costs.frozen else "")
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
                not self.book.draft_kv_wanted(len(self._conversation), DRAFT_KV_MIN):
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
            if self.book.draft_kv_wanted(len(draft.cached), DRAFT_KV_MIN):
                self.book.time_draft_kv(stop)

        self.idle.add(Task("draft catch-up", run, what="the draft catching up with the conversation", restores=True))

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
        curve = self.book.curve
        if curve is None or (req.seeded and not self.book.probed):
            return FixedDraft(0)
        acceptance: Any
        if req.seeded:  # the same seed must give the same text: decide from the cached curve alone
            costs, acceptance = OnlineCosts(curve, frozen=True), Acceptance()
        else:
            costs, acceptance = self.book.shared(), self._acceptance[req.sampling.greedy]
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
