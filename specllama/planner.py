"""For each request, which proposer and policy it decodes with, from what was measured on this
machine: verify-batch fidelity per KV length, the reuse difference, decode costs."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional, Union

from .calibrate import batch_diffs, costs as measured_costs, reuse_diffs
from .constraints import Constraint
from .controller import Acceptance, Controller, Costs, FixedDraft, OnlineCosts, Policy, draft_can_pay
from .fidelity import DiffTable, Level, ReuseTable
from .limits import AUTO_WIDTH, MAX_DRAFT, MAX_N_DRAFT, MAX_VERIFY
from .prompt_cache import PromptCache
from .proposers import DraftModelProposer, PromptLookupProposer, Proposer
from .runtime.protocols import Drafter, Model
from .sampling import SamplingSettings

log = logging.getLogger("specllama")


@dataclass(frozen=True)
class Request:
    """One generation, checked: the prompt and the options resolved against load()'s."""

    prompt: list[int]
    sampling: SamplingSettings
    max_tokens: int
    seed: Optional[int]
    stop: tuple[str, ...]
    n_draft: Union[int, str]
    level: Level
    constraint: Optional[Constraint] = None  # this request's own: its state follows the text
    n_logprobs: Optional[int] = None
    tree: Union[int, str] = "auto"

    @property
    def seeded(self) -> bool:
        """Sampling with a seed: the same seed must give the same text, whatever ran before."""
        return self.seed is not None and not self.sampling.greedy


class Planner:
    """A target and draft pair's measurements, and the policy each request gets from them.

    stash() is called before a measurement decodes probe text from position 0, so the
    conversations in the contexts are kept first."""

    def __init__(self, target: Model, draft: Optional[Drafter], lookup: Optional[bool],
                 stash: Callable[[], None]):
        self.target, self.draft, self.lookup = target, draft, lookup
        self._stash = stash
        self._costs: Optional[Costs] = None
        self._online_costs: Optional[OnlineCosts] = None
        # the draft's confidence calibration, learned across calls; greedy and sampled drafts
        # mean different things by confidence (top probability; q of a sampled token)
        self._acceptance = {True: Acceptance(), False: Acceptance()}
        self._explained: set[Level] = set()
        # how far verify batches stray from single-token rows, per KV length, measured on demand
        self.batch_diffs = DiffTable(lambda n_past, bound: batch_diffs(target, n_past, bound), target.n_ctx)
        # how far rows on a reused prompt cache stray from a fresh prefill's, likewise
        self.reuse_diffs = ReuseTable(lambda n_past: reuse_diffs(target, n_past), target.n_ctx)

    @property
    def speculates(self) -> bool:
        """Whether anything proposes tokens (a draft model or prompt lookup)."""
        return self.draft is not None or self.lookup is True

    def costs(self) -> Costs:
        """Measured target verify costs and draft cost per token (cached per machine)."""
        if self._costs is None:
            self._costs = measured_costs(self.target, self.draft, MAX_VERIFY)
        return self._costs

    def explain_short_limit(self, level: Level) -> int:
        """Measure (or read) the short-context limit of level and say what it means, once."""
        short = self.batch_diffs.get(0, level.bound)  # None: a context too small to probe
        n_verify = 1 if short is None else short.largest_batch(level.bound)
        if level in self._explained:
            return n_verify
        self._explained.add(level)
        if n_verify == 1 and short is not None and short.diffs:
            log.warning("%s: on this backend no verify batch stays within the %s level (the closest differs "
                        "from single-token decoding by %.3g logits), so it decodes plainly; exact=\"rounding\" "
                        "or \"off\" allows drafting", self.target.name, level, short.diffs[0])
        elif n_verify < MAX_VERIFY:
            log.info("%s: verify batches over %d tokens differ from single-token decoding by more than the %s "
                     "level allows; drafting at most %d tokens a round", self.target.name, n_verify, level,
                     n_verify - 1)
        return n_verify

    def plan(self, req: Request, prompt_cache: Optional[PromptCache]) -> tuple[Optional[Proposer], Policy]:
        """The request's proposer (None: plain decoding) and policy."""
        # a grammar's forced tokens are a source even where nothing else proposes
        forced = Proposer(None, None) if req.constraint is not None and req.constraint.grammar is not None \
            and req.n_draft != 0 else None
        if not self.speculates or req.n_draft == 0:
            return forced, FixedDraft(0)
        policy = self._policy(req)
        if not (policy.has_draft or policy.lookup):
            return forced, FixedDraft(0)
        draft = DraftModelProposer(self.draft, prompt_cache, canonical=req.seeded) \
            if policy.has_draft and self.draft is not None else None
        return Proposer(draft, PromptLookupProposer() if policy.lookup or draft is None else None), policy

    def _policy(self, req: Request) -> Policy:
        level = req.level
        # first-use measurements decode probe text from position 0: keep the conversations first
        short = self.batch_diffs.groups.get(0)
        if (level.limited and (short is None or not short.covers(level.bound))) or \
                (req.n_draft == "auto" and self._costs is None):
            self._stash()
        # the short-context limit; rounds at longer KV lengths get their own (Limits)
        limit = self.explain_short_limit(level) - 1 if level.limited else MAX_N_DRAFT
        has_draft = self.draft is not None
        if req.n_draft != "auto":
            assert isinstance(req.n_draft, int)
            return FixedDraft(min(req.n_draft, limit), has_draft=has_draft, lookup=self.lookup is True,
                              width=req.tree if isinstance(req.tree, int) else 1)
        acceptance: Any
        if req.seeded:  # the same seed must give the same text: decide from the calibration alone
            costs, acceptance = OnlineCosts(self.costs(), frozen=True), Acceptance()
        else:
            if self._online_costs is None:
                self._online_costs = OnlineCosts(self.costs())
            costs, acceptance = self._online_costs, self._acceptance[req.sampling.greedy]
        lookup = self.lookup is True or (self.lookup is None and has_draft)
        limit = min(limit, MAX_DRAFT)
        # not even an always-right draft beats plain decoding here: leave the draft model idle
        return Controller(costs, limit, has_draft=has_draft and draft_can_pay(costs, limit), lookup=lookup,
                          acceptance=acceptance, width=AUTO_WIDTH if req.tree == "auto" else int(req.tree),
                          n_tokens=req.max_tokens)
