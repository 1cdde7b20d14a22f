"""SpecLlama: the public object that owns a target and an optional draft and generates text."""

from __future__ import annotations

import logging
import time
from collections.abc import Generator, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Optional, Union, cast

import numpy as np

from .scheduling.batch import BatchApi
from .models.compat import check_compatible, vocab_info
from .controller import Costs
from .measuring.concurrency_probes import plan_pieces
from .decoding.decode import Decoding, generate_steps
from .errors import ClosedError, InvalidParameterError
from .measuring.fidelity import Limits, parse_level
from .generation import accepted_tokens, finish_stats, in_turns, prefill
from .measuring.idle import PROCESS, IdleWork, idle_wanted
from .surfaces.llama_api import LlamaApi
from .surfaces.messages import normalize as normalize_messages
from .options import GenerateOptions, Prompt, check_cache_mb, check_n_draft, check_n_parallel, prompt_tokens
from .measuring.planner import Planner
from .request import Defaults, Request, resolve, tree_for
from .caching.disk_cache import DISK_MB
from .caching.prompt_cache import Budget, PromptCache, cache_report, close_caches, open_disk
from .runtime.protocols import Drafter, Model
from .scheduling.sharing import Sharing, open_sharing, why_not_shared
from .scheduling.slots import Pool, Slot, Slots, why_single
from .decoding.stats import Stats
from .streams import Chunk, Outcome, Result, Stream
from .text import Detokenizer, StopMatcher

log = logging.getLogger("specllama")

# saved prompt-cache states in RAM, target and draft together: a few conversations of a few
# thousand tokens for models of a few billion parameters (Qwen2.5-1.5B: 28 KiB a token at f16)
PROMPT_CACHE_MB = 1024
# requests decoding side by side, as llama-server's 4 slots: each beyond the first gets contexts
# of its own (KV cache and compute buffers, not the weights), made when it is first needed
N_PARALLEL = 4


class SpecLlama(LlamaApi, BatchApi):
    """A target model, optionally with a draft model that speculates for it.

    Greedy output is token-for-token the target's own; sampled output has the target's
    distribution. Build it with specllama.load().
    """

    def __init__(self, target: Model, draft: Optional[Drafter] = None, *, n_draft: Union[int, str] = "auto",
                 exact: Union[str, float, bool] = "rounding", lookup: Optional[bool] = None,
                 prompt_cache_mb: float = PROMPT_CACHE_MB, tree: Union[int, str, bool] = "auto",
                 idle_work: Optional[bool] = None, n_parallel: int = N_PARALLEL,
                 batch_requests: Union[bool, str] = False, prompt_cache_dir: Optional[Any] = None,
                 prompt_cache_disk_mb: float = DISK_MB):
        self.target, self.draft = target, draft
        self.n_draft = check_n_draft(n_draft)
        self.tree = tree_for(target, tree)
        self.level = parse_level(exact)
        self._defaults = Defaults(self.n_draft, self.level, self.tree)
        if lookup is not None and not isinstance(lookup, bool):
            raise InvalidParameterError("lookup", lookup, "True, False or None (beside a draft model in auto mode)")
        self.lookup = lookup
        self._closed = False
        # the draft: a second model, or the target's own MTP layers (the same vocabulary)
        self.mtp = draft is not None and draft.follows_target
        if draft is not None and not self.mtp:
            check_compatible(vocab_info(target), vocab_info(draft))
        self.prompt_cache_budget = Budget(check_cache_mb(prompt_cache_mb))
        self.target_cache = PromptCache(target, self.prompt_cache_budget)
        # a second model (not MTP layers) has a sequence of its own to cache: it is a Model
        self.draft_cache = PromptCache(cast(Model, draft), self.prompt_cache_budget) \
            if draft is not None and not self.mtp else None
        self.prompt_disk = open_disk(prompt_cache_dir, prompt_cache_disk_mb, self.target_cache, self.draft_cache)
        # measurements a request found missing, run while no generation runs (idle.py)
        if idle_work is None:  # a library computes nothing behind its host's back unless asked
            idle_work = idle_wanted(default=False)
        # requests decode side by side, each in a slot of its own; their rounds take turns
        note = why_single(target, draft)
        slots = Slots(Slot(0, target, draft, self.target_cache, self.draft_cache),
                      check_n_parallel(n_parallel) if not note else 1, self.prompt_cache_budget, note)
        if note and n_parallel > 1:
            log.info("%s: requests decode one at a time: %s", target.name, note)
        self.pool = Pool(slots, lambda: self.idle.busy())
        self._models = self.pool.turn  # whoever decodes holds it: a generation's round, or idle work
        self.idle = IdleWork(self._models, lambda: self.pool.n_generating > 0 or self._closed, start=idle_work,
                             n_threads=target.n_threads)
        self.planner = Planner(target, draft, lookup, self._stash, self.idle, self.draft_cache, self.pool.n_piece)
        self.batch_diffs, self.reuse_diffs = self.planner.batch_diffs, self.planner.reuse_diffs
        pieced = (target, draft) if slots.n_max > 1 else (draft,)  # prompts beside others; the draft's catch-up
        plan_pieces(self.pool.pieces, pieced, self.idle, self._stash, self.planner.queue_catch_up)
        if self.speculates or batch_requests:
            with self._models, PROCESS.busy():
                self.planner.measure_short((self.level,), batching=bool(batch_requests))
                if self.speculates:
                    self.planner.book.check_cached()
        self.sharing: Optional[Sharing] = None  # requests' rows in shared passes (sharing.py)
        # why requests do not share passes ("" where they do, or were not asked to)
        self.sharing_note = (slots.note or why_not_shared(target, draft, slots.n_max)) if batch_requests else ""
        if batch_requests and not self.sharing_note:
            with self._models, PROCESS.busy():
                self.sharing, self.sharing_note = open_sharing(slots.first, slots.n_max, self.prompt_cache_budget,
                                                               self.pool, self.level, batch_requests)
        if self.sharing_note:
            log.info("%s: requests do not share passes: %s", target.name, self.sharing_note)

    @property
    def speculates(self) -> bool:
        """Whether anything proposes tokens (a draft model or prompt lookup)."""
        return self.planner.speculates

    def costs(self) -> Optional[Costs]:
        """The target's verify costs and the draft's cost per token in use; measured now if they
        were not yet (cached per machine)."""
        self._check_open()
        with self._models:
            return self.planner.book.get(measure=True)

    def warm_up(self, alone: bool = False) -> list[str]:
        """Run, now, the measurements this object would otherwise make when idle (the short
        context's verify limit, decode costs, limits at KV lengths generations reached, the
        draft catching up with the last conversation): what ran. Until they have run, rounds
        where they matter decode plainly; a server or chat runs them between requests. alone:
        only what one request at a time uses (a one-shot command's), not what requests side by
        side or later idle work use (how a prefill may go in pieces)."""
        self._check_open()
        return self.idle.warm_up(alone)

    # --- public API --------------------------------------------------------------------------

    def generate(self, prompt: Prompt, **options: Any) -> Result:
        """Generate a completion of prompt (text or token ids).

        Args:
            prompt: text (special tokens like <|im_start|> are parsed) or a list of token ids.
            **options: options.GenerateOptions' fields (max_tokens, temperature, top_k, top_p,
                min_p, seed, stop, n_draft, exact, tree, grammar, json_schema, logit_bias, the
                penalties, logprobs); n_draft, exact and tree default to load()'s.
        Returns:
            Result with text, tokens, finish_reason and stats.
        """
        stream = self.stream(prompt, **options)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(self, prompt: Prompt, **options: Any) -> Stream:
        """Like generate(), but returns a Stream of Chunks as tokens are accepted.

        Options are checked now, so bad input raises here rather than mid-iteration.
        """
        return self.stream_of(prompt, GenerateOptions.of(options))

    def stream_of(self, prompt: Prompt, options: GenerateOptions) -> Stream:
        """stream() with its options as one GenerateOptions (what the server's translators and
        the CLI build)."""
        request = resolve(self.prompt_tokens(prompt), options, self.target, self._defaults)
        outcome = Outcome()
        stream = Stream(self._run(request, outcome), outcome)
        self.pool.open(stream)
        return stream

    def chat(self, messages: list[dict], **options: Any) -> Result:
        """generate() on messages rendered with the chat template stored in the target GGUF."""
        return self.generate(self.chat_tokens(messages), **options)

    def chat_stream(self, messages: list[dict], **options: Any) -> Stream:
        """stream() on messages rendered with the target's chat template."""
        return self.stream(self.chat_tokens(messages), **options)

    def chat_tokens(self, messages: list[dict], tools: Optional[list[dict]] = None) -> list[int]:
        """Token ids of messages (and tools, for templates that render them) rendered with the
        target's chat template, ready to generate."""
        self._check_open()
        text = self.target.apply_chat_template(normalize_messages(messages), tools=tools)
        bos_text = self.target.token_text(self.target.bos).decode("utf-8", "replace")
        add_bos = not (bos_text and text.startswith(bos_text))
        return self.target.tokenize(text, add_special=add_bos, parse_special=True)

    def tokenize(self, text: str) -> list[int]:
        self._check_open()
        return self.target.tokenize(text, add_special=True, parse_special=True)

    def detokenize(self, tokens: Sequence[int]) -> str:
        self._check_open()
        return b"".join(self.target.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def prompt_cache_info(self) -> dict:
        """The prompt caches' counters, all slots together: hits, misses, tokens reused, states
        saved in RAM (and on disk); and how many slots there are now."""
        slots = self.pool.slots.all
        return cache_report(self.prompt_cache_budget, [s.target_cache for s in slots],
                            [s.draft_cache for s in slots if s.draft_cache is not None], self.prompt_disk)

    def close(self) -> None:
        """Free both models (a borrowed llama_cpp.Llama stays with its owner) and the saved
        prompt-cache states. An open stream ends first, from any thread: the one generating in
        another thread stops at its next token, one waiting between tokens is closed here."""
        if self._closed:
            return
        self._closed = True  # a new generation now raises ClosedError, idle work stops
        self.idle.close()
        self._stop_workers()
        self.pool.end_all()
        with self._models, PROCESS.busy():  # whatever still generates has ended
            lanes = self.sharing.slots.all if self.sharing is not None else []
            close_caches([c for s in (*self.pool.slots.all, *lanes) for c in (s.target_cache, s.draft_cache) if c],
                         self.prompt_cache_budget, self.prompt_disk)
            if self.sharing is not None:
                self.sharing.close()
            self.pool.slots.close_more()  # their contexts before the models they share
            for runtime in (self.draft, self.target):
                if runtime is not None:
                    runtime.close()

    def __enter__(self) -> "SpecLlama":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:  # llama.cpp would read freed memory
            raise ClosedError("this SpecLlama was closed and its models freed; specllama.load() them again")

    def _stash(self) -> None:
        for cache in (self.target_cache, self.draft_cache):
            if cache is not None:
                cache.stash()

    def prompt_tokens(self, prompt: Prompt) -> list[int]:
        """A prompt's token ids, checked as generate() checks them: text (its special tokens
        parsed) or ids in the vocabulary, not empty, fitting the context; a typed error if not."""
        self._check_open()
        return prompt_tokens(prompt, self.tokenize, self.target.n_vocab, self.target.n_ctx)

    def exclusive(self) -> "AbstractContextManager[None]":
        """The models to the caller alone, for measuring them directly (calibrate, doctor): idle
        work in progress ends at its next decode, and a generation meanwhile gets BusyError."""
        self._check_open()
        return self.pool.exclusive()

    def _run(self, req: Request, outcome: Outcome) -> Generator[Chunk, None, None]:
        tokens: list[int] = []
        texts: list[str] = []
        finish = "cancelled"
        lane = self.sharing is not None and self.sharing.admits(req.level, req.seeded)
        with self.pool.generation(req.prompt, self._check_open, lane, req.cache_scope) as slot:
            with self._models:  # the planner's figures are shared by every generation's rounds
                proposer, policy = self.planner.plan(req, slot.draft_cache, slot.draft)
                learned_before = self.planner.learned_so_far(policy)
            t_start = time.perf_counter()
            stats = Stats(n_prompt=len(req.prompt), n_draft_max=policy.limit if proposer is not None else 0,
                          fidelity=str(req.level), rollback=self.target.rollback,
                          draft_source="mtp" if self.mtp else "model" if self.draft is not None else "")
            n_replayed = slot.target.n_replayed
            outcome.stats = stats
            sharing = self.sharing if slot.lane else None
            in_lane = None if sharing is None else sharing.context.load(slot.index)
            limits = Limits(req.level, self.batch_diffs, shared=None if sharing is None else sharing.diff)
            steps: Optional[Generator[Any, None, None]] = None
            detokenizer, matcher = Detokenizer(), StopMatcher(req.stop)
            try:
                if not prefill(slot.target_cache, req, self._models, stats, t_start).exact:
                    limits.reuse = self.reuse_diffs  # rows carry the difference of reuse into the tolerance
                steps = generate_steps(Decoding(slot.target, proposer, policy, req.sampling,
                                                np.random.default_rng(req.seed), limits, stats, req.constraint,
                                                req.n_logprobs, in_lane), req.prompt)
                finish = "length"  # running out of context also ends here, and an error mid-way
                finish = yield from self._emit(in_turns(steps, self._models), req, outcome, tokens, texts, detokenizer,
                                               matcher)
            except GeneratorExit:
                finish = "cancelled"
                raise
            finally:
                if steps is not None:
                    with self._models:  # the rollback of an interrupted round decodes
                        steps.close()
                finish_stats(stats, req, tokens, finish, matcher.stopped, limits, policy, t_start,
                             slot.target.n_replayed - n_replayed, self.target, self.draft)
                stats.slot = slot.index
                with self._models:  # as above
                    self.planner.account(stats, req, policy, learned_before)
                    self.planner.after(policy, req.cache_scope, on_first_slot=slot.index == 0 and not slot.lane)
                outcome.result = Result("".join(texts), tokens, finish, stats, matcher.matched)

    def _emit(self, steps: Iterator[Any], req: Request, outcome: Outcome, tokens: list[int], texts: list[str],
              detokenizer: Detokenizer, matcher: StopMatcher) -> Generator[Chunk, None, str]:
        """Chunks of the accepted tokens until a stop, max_tokens or a cancel; the finish reason."""
        finish = "length"
        for token, origin, logprob in accepted_tokens(steps):
            if outcome.cancel.is_set():
                return "cancelled"
            if self.target.is_eog(token):
                finish = "stop"
                break
            tokens.append(token)
            text = matcher.feed(detokenizer.feed(self.target.piece(token)))
            texts.append(text)
            yield Chunk(text, [token], [origin != "target"], None if logprob is None else [logprob], [origin])
            if matcher.stopped:
                finish = "stop"
                break
            if len(tokens) == req.max_tokens:
                break
        tail = matcher.feed(detokenizer.flush()) + matcher.flush()
        if tail:
            texts.append(tail)
            yield Chunk(tail, [], [])
        return finish
