"""Requests whose rows share the target's passes: lanes of one shared target context.

With load(..., batch_requests=True) and n_parallel > 1, a SpecLlama also makes one target
context of n_parallel lanes (runtime/shared.py). A request that may share (its fidelity level
allows the difference a lane's rows carry, and it is not seeded) decodes in a lane slot: its own
sequences in the target's and the draft's shared contexts, its own prompt cache entries; its target rows ride in one
llama_decode with the other lanes' rows of the same round, where its level allows a pass of
that many rows at its KV length. Other requests decode in slots of their own, as without it.

What a lane's rows carry: other lanes' cells between its own change llama.cpp's attention sums,
so a lane's rows differ from a context of its own even decoded alone. That difference is
measured once per model file, settings and build (measure_apart_diff, a few seconds, at load),
and a lane's near-ties are judged with it on every row, plain rounds included.

batch_requests="auto" (the server's default) makes lanes only where requests at the load's level
can use them: the Q4_K_M test target's lane rows differ by 0.42 logits on our CPU, over the
rounding bound, so its requests take turns in contexts of their own and no lane memory is held.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

from ..measuring.concurrency_probes import cached_apart_diff, measure_apart_diff
from ..measuring.fidelity import Level
from ..caching.prompt_cache import Budget, PromptCache
from ..runtime.protocols import Drafter, Model
from .slots import Pool, Slot, Slots

log = logging.getLogger("specllama")

AUTO = "auto"  # batch_requests: lanes where the load's level allows what their rows carry


def why_not_shared(target: Model, draft: Optional[Drafter], n_parallel: int) -> str:
    """Why requests on these models cannot share passes ("" where they can)."""
    if n_parallel < 2:
        return "n_parallel is 1"
    if target.memory != "attention":
        return f"{target.name} keeps a {target.memory} memory, whose rollback is per context"
    if getattr(target, "settings", None) is None or not hasattr(target, "sibling"):
        return f"{target.name} is not a model this process loaded from a file"
    if draft is not None and (draft.follows_target or not hasattr(draft, "sibling")
                              or getattr(draft, "memory", "attention") != "attention"):
        return "the draft cannot have a lane per request (MTP layers, a recurrent memory, or RPC workers)"
    return ""


def open_sharing(first: Slot, n_lanes: int, budget: Budget, pool: Pool, level: Level,
                 mode: Union[bool, str]) -> tuple[Optional["Sharing"], str]:
    """The lanes load() asked for (mode True), or with mode "auto" the lanes requests at level
    can use: none where the difference a lane's rows carry (cached, else measured on the target's
    shared context before anything else is made) is over level's bound. (the lanes or None, why
    there are none)."""
    from ..runtime.shared import SharedContext

    diff = cached_apart_diff(first.target, n_lanes)
    if mode == AUTO and diff is not None and diff > level.bound:
        return None, _over(diff, level)
    context = SharedContext(first.target, n_lanes)
    try:
        if diff is None:
            diff = measure_apart_diff(first.target, context)
        if mode == AUTO and diff > level.bound:
            context.close()
            return None, _over(diff, level)
        return Sharing(first, context, diff, budget, pool), ""
    except BaseException:
        context.close()
        raise


def _over(diff: float, level: Level) -> str:
    return (f"a lane's rows differ from a context of its own by {diff:.3g} logits, over the {level} level's bound "
            f"({level.bound:g}); batch_requests=True (--batch-requests) makes lanes for requests at a looser level")


class Sharing:
    """The shared context, its lane slots, and the difference a lane's rows carry (diff)."""

    def __init__(self, first: Slot, context: Any, diff: float, budget: Budget, pool: Pool):
        from ..runtime.shared import SharedContext

        if getattr(first.target, "settings").flash_attn is False:  # a local Runtime (why_not_shared)
            # llama.cpp's attention without it sums over every cell up to the highest one in use, so a
            # lane reads the other lanes' cells too: measured on our CPU beside 3 lanes of 1,500 cells,
            # the 0.5B draft's step 41.6 ms against 20.0 ms alone (21.1 against 19.5 ms with it on)
            log.warning("%s: lanes with flash_attn=False read every lane's cached cells at each step (up to "
                        "2x slower with long histories); leave flash_attn to llama.cpp (None)", first.target.name)
        self.context, self.diff = context, diff
        # the draft's steps of all lanes in one pass too (what it proposes, never what is accepted,
        # depends on its rows)
        self.draft_context = (SharedContext(first.draft, context.n_lanes, any_pass=True) if first.draft is not None
                              else None)
        try:
            target, draft = self.context.lane(0), self._draft_lane(0)
            lane0 = Slot(0, target, draft, PromptCache(target, budget, owner=first.target_cache),
                         None if draft is None or first.draft_cache is None
                         else PromptCache(draft, budget, owner=first.draft_cache), lane=True)
            self.slots = Slots(lane0, context.n_lanes, budget, lane_of=self.context.lane,
                               draft_lane_of=self._draft_lane if draft is not None else None)
        except BaseException:  # the target's context is open_sharing's to close
            if self.draft_context is not None:
                self.draft_context.close()
            raise
        for shared in (self.context, self.draft_context):
            if shared is not None:
                shared.turn, shared.n_active = pool.turn, lambda: self.slots.n_busy
        if self.draft_context is not None:
            self.draft_context.join(self.context)
        pool.lanes = self.slots

    def _draft_lane(self, index: int) -> Any:
        if self.draft_context is None:
            return None
        return self.draft_context.lane(index)

    def admits(self, level: Level, seeded: bool) -> bool:
        """Whether a request at level may decode in a lane: its level allows the difference a
        lane's rows carry, and no seed asks for the text it has alone."""
        return not seeded and self.diff <= level.bound

    def as_dict(self) -> dict:
        out = {"n_lanes": self.context.n_lanes, "apart_diff": self.diff, "n_passes": self.context.n_passes,
               "n_shared_passes": self.context.n_shared_passes}
        if self.draft_context is not None:
            out.update(n_draft_passes=self.draft_context.n_passes,
                       n_draft_shared_passes=self.draft_context.n_shared_passes)
        return out

    def close(self) -> None:
        """The lane slots' draft contexts, then the shared context (before the models)."""
        self.slots.close_more()
        for context in (self.draft_context, self.context):
            if context is not None:
                context.close()
