"""SpecLlama: the public object that owns a target and an optional draft and generates text."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np

from .calibrate import batch_diffs, costs as measured_costs, reuse_diffs
from .compat import VocabInfo, check_compatible
from .completions import Completion, chat_logprobs, check_supported, generate_options, shaping_options, tool_setup
from .constraints import Constraint, Grammar, Penalties, check_logit_bias, grammar_source
from .decode import generate_steps
from .doctor import offload_note
from .errors import BusyError, ClosedError, EmptyPromptError, InvalidParameterError, PromptTooLongError
from .controller import Acceptance, Controller, FixedDraft, OnlineCosts, draft_can_pay
from .fidelity import MAX_VERIFY, DiffTable, Level, Limits, ReuseTable, parse_level
from .prompt_cache import Budget, PromptCache
from .proposers import DraftModelProposer, PromptLookupProposer, Proposer
from .plan import check as check_plan, make_plan
from .remote import RemoteRuntime
from .draft_select import MTP
from .runtime import MtpHead, ModelSettings, Runtime, open_runtime, resident_bytes, supports_gpu_offload
from .sampling import SamplingSettings
from .stats import Stats
from .text import Detokenizer, StopMatcher
from .messages import normalize as normalize_messages

log = logging.getLogger("specllama")

Prompt = Union[str, Sequence[int]]
MAX_N_DRAFT = 32
MAX_AUTO_DRAFT = 16  # the controller's longest draft; costs are measured up to this
TREE_BRANCHES = 8  # the most branches of a tree verify batch (sequences of the target's context)
AUTO_WIDTH = 3  # candidates per position the controller may verify, in auto mode
# saved prompt-cache states in RAM, target and draft together: a few conversations of a few
# thousand tokens for models of a few billion parameters (Qwen2.5-1.5B: 28 KiB a token at f16)
PROMPT_CACHE_MB = 1024


@dataclass(frozen=True)
class Chunk:
    """Part of a streamed generation: the text that became final and the tokens behind it."""

    text: str
    tokens: list[int]
    from_draft: list[bool]
    # with logprobs asked for: per token, (its logprob, [(token, logprob), ...] top alternatives)
    logprobs: Optional[list[tuple[float, list[tuple[int, float]]]]] = None


@dataclass
class Result:
    """A finished generation. finish_reason: "stop" (EOG or stop string), "length", "cancelled"."""

    text: str
    tokens: list[int]
    finish_reason: str
    stats: Stats = field(default_factory=Stats)


class Stream:
    """Iterator of Chunks; `result` holds the text, finish_reason and stats once it has ended."""

    def __init__(self, chunks: Iterator[Chunk]):
        self._chunks = chunks
        self.result: Optional[Result] = None
        self.stats: Optional[Stats] = None  # the running generation's stats, live
        self._cancel = threading.Event()

    def cancel(self) -> None:
        """Ask the generation to stop at its next token, from any thread (close() must be
        called from the thread that iterates); it then ends with finish_reason "cancelled"."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Chunk:
        return next(self._chunks)

    def close(self) -> None:
        """Stop early; the models stay consistent and `result` says "cancelled"."""
        self._chunks.close()

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True)
class _Request:
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


class SpecLlama:
    """A target model, optionally with a draft model that speculates for it.

    Greedy output is token-for-token the target's own; sampled output has the target's
    distribution. Build it with specllama.load().
    """

    def __init__(self, target: Runtime, draft: Optional[Runtime] = None, *, n_draft: Union[int, str] = "auto",
                 exact: Union[str, float, bool] = "rounding", lookup: Optional[bool] = None,
                 prompt_cache_mb: float = PROMPT_CACHE_MB, tree: Union[int, str, bool] = "auto"):
        self.target = target
        self.draft = draft
        self.n_draft = _check_n_draft(n_draft)
        self.tree = self._check_tree(tree)
        self.level = parse_level(exact)
        if lookup is not None and not isinstance(lookup, bool):
            raise InvalidParameterError("lookup", lookup, "True, False or None (beside a draft model in auto mode)")
        self.lookup = lookup
        self._lock = threading.Lock()
        self._closed = False
        self._costs = None
        self._online_costs: Optional[OnlineCosts] = None
        # the draft's confidence calibration, learned across calls; greedy and sampled drafts
        # mean different things by confidence (top probability; q of a sampled token)
        self._acceptance = {True: Acceptance(), False: Acceptance()}
        self._explained: set[Level] = set()
        # the draft: a second model, or the target's own MTP layers (the same vocabulary)
        self.mtp = isinstance(draft, MtpHead)
        if draft is not None and not self.mtp:
            check_compatible(_vocab_info(target), _vocab_info(draft))
        # how far verify batches stray from single-token rows, per KV length, measured on demand
        self.batch_diffs = DiffTable(lambda n_past, bound: batch_diffs(target, n_past, bound), target.n_ctx)
        # how far rows on a reused prompt cache stray from a fresh prefill's, likewise
        self.reuse_diffs = ReuseTable(lambda n_past: reuse_diffs(target, n_past), target.n_ctx)
        self.prompt_cache_budget = Budget(_check_cache_mb(prompt_cache_mb))
        self.target_cache = PromptCache(target, self.prompt_cache_budget)
        self.draft_cache = PromptCache(draft, self.prompt_cache_budget) if draft is not None and not self.mtp \
            else None
        if self.speculates and self.level.limited:
            self._explain_short_limit(self.level)

    def _explain_short_limit(self, level: Level) -> int:
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

    @property
    def speculates(self) -> bool:
        """Whether anything proposes tokens (a draft model or prompt lookup)."""
        return self.draft is not None or self.lookup is True

    def costs(self):
        """Measured target verify costs and draft cost per token (cached per machine)."""
        if self._costs is None:
            self._costs = measured_costs(self.target, self.draft, MAX_AUTO_DRAFT + 1)
        return self._costs

    # --- public API --------------------------------------------------------------------------

    def generate(self, prompt: Prompt, **options: Any) -> Result:
        """Generate a completion of prompt (text or token ids).

        Args:
            prompt: text (special tokens like <|im_start|> are parsed) or a list of token ids.
            max_tokens: most tokens to generate (default 256).
            temperature, top_k, top_p, min_p: sampling settings; temperature 0 is greedy.
            seed: seed of the numpy Generator used for sampling (same seed, same output).
            stop: a string or strings that end generation; they are not included in the text.
            n_draft: tokens drafted per round, or "auto" (default: the value given to load).
            exact: fidelity level for this call: "bitwise", "rounding", "off" or a bound in
                logits (default: the value given to load).
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

        Parameters are checked now, so bad input raises here rather than mid-iteration.
        """
        request = self._request(self._prompt_tokens(prompt), **options)
        stream = Stream(iter(()))
        stream._chunks = self._run(request, stream)
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

    def create_completion(self, prompt: Prompt, max_tokens: Optional[int] = 16, temperature: float = 0.8,
                          top_p: float = 0.95, min_p: float = 0.05, stop: Union[None, str, list[str]] = None,
                          top_k: int = 40, stream: bool = False, seed: Optional[int] = None,
                          logprobs: Optional[int] = None, frequency_penalty: float = 0.0,
                          presence_penalty: float = 0.0, repeat_penalty: float = 1.0, grammar: Any = None,
                          logit_bias: Optional[dict] = None, n_draft: Union[None, int, str] = None,
                          **unsupported: Any) -> Any:
        """llama_cpp.Llama.create_completion: a text_completion dict, or its chunks if stream.

        Same defaults and shapes as llama-cpp-python 0.3.36; n_draft is specllama's own. The
        grammar (GBNF text or a LlamaGrammar), logit_bias, penalties and logprobs are applied
        in verification; suffix, echo, typical_p, mirostat and logits processors raise
        InvalidParameterError.
        """
        check_supported(unsupported)
        tokens = self._prompt_tokens(prompt)
        shaping = shaping_options(grammar=grammar, logit_bias=logit_bias, repeat_penalty=repeat_penalty,
                                  frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                                  logprobs=logprobs)
        return self._complete(tokens, False, max_tokens, stream, None, temperature=temperature, top_p=top_p,
                              min_p=min_p, top_k=top_k, stop=stop, seed=seed, n_draft=n_draft, **shaping)

    __call__ = create_completion

    def create_chat_completion(self, messages: list[dict], max_tokens: Optional[int] = None,
                               temperature: float = 0.2, top_p: float = 0.95, min_p: float = 0.05,
                               stop: Union[None, str, list[str]] = None, top_k: int = 40, stream: bool = False,
                               seed: Optional[int] = None, tools: Optional[list[dict]] = None,
                               tool_choice: Any = None, parallel_tool_calls: Optional[bool] = None,
                               response_format: Optional[dict] = None, logprobs: Optional[bool] = None,
                               top_logprobs: Optional[int] = None, frequency_penalty: float = 0.0,
                               presence_penalty: float = 0.0, repeat_penalty: float = 1.0, grammar: Any = None,
                               logit_bias: Optional[dict] = None, n_draft: Union[None, int, str] = None,
                               **unsupported: Any) -> Any:
        """llama_cpp.Llama.create_chat_completion with the GGUF's chat template: a
        chat.completion dict, or chat.completion.chunk dicts if stream.

        tools are rendered by the template and calls parsed into tool_calls (finish_reason
        "tool_calls"); tool_choice "required" or a named function constrains the output to a
        valid call. response_format, grammar, logit_bias, penalties and logprobs apply in
        verification, so greedy output is plain decoding's under the same constraint.
        """
        check_supported(unsupported)
        tokens, tool_format, grammar = tool_setup(self, messages, tools, tool_choice, parallel_tool_calls, grammar)
        shaping = shaping_options(grammar=grammar, response_format=response_format, logit_bias=logit_bias,
                                  repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                                  presence_penalty=presence_penalty, logprobs=chat_logprobs(logprobs, top_logprobs))
        return self._complete(tokens, True, max_tokens, stream, tool_format, temperature=temperature,
                              top_p=top_p, min_p=min_p, top_k=top_k, stop=stop, seed=seed, n_draft=n_draft, **shaping)

    def _complete(self, tokens: list[int], chat: bool, max_tokens: Optional[int], stream: bool,
                  tool_format: Any, **options: Any) -> Any:
        completion = Completion(self, tokens, chat=chat, model=self.target.name, tool_format=tool_format,
                                **generate_options(max_tokens, len(tokens), self.target.n_ctx, **options))
        return completion.chunks() if stream else completion.response()

    def tokenize(self, text: str) -> list[int]:
        self._check_open()
        return self.target.tokenize(text, add_special=True, parse_special=True)

    def detokenize(self, tokens: Sequence[int]) -> str:
        self._check_open()
        return b"".join(self.target.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def _check_open(self) -> None:
        if self._closed:  # llama.cpp would read freed memory
            raise ClosedError("this SpecLlama was closed and its models freed; specllama.load() them again")

    def close(self) -> None:
        """Free both models (a borrowed llama_cpp.Llama stays with its owner) and the saved
        prompt-cache states."""
        self._closed = True
        self.prompt_cache_budget.entries.clear()
        for runtime in (self.draft, self.target):
            if runtime is not None:
                runtime.close()

    def __enter__(self) -> "SpecLlama":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ---------------------------------------------------------------------------

    def _prompt_tokens(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InvalidParameterError("prompt", prompt[max(0, e.start - 10):e.end + 10],
                                            "valid Unicode text (it holds an unpaired surrogate, "
                                            "e.g. from undecodable bytes)") from None
            tokens = self.tokenize(prompt) if prompt else []
        elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            tokens = list(prompt)
            bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, (int, np.integer))
                   or not 0 <= t < self.target.n_vocab]
            if bad:
                raise InvalidParameterError("prompt", bad[0], f"text, or token ids in 0..{self.target.n_vocab - 1}")
            tokens = [int(t) for t in tokens]
        else:
            raise InvalidParameterError("prompt", prompt, "a string or a list of token ids")
        if not tokens:
            raise EmptyPromptError("the prompt is empty: give some text or at least one token id")
        if len(tokens) > self.target.n_ctx:
            raise PromptTooLongError(
                f"the prompt has {len(tokens)} tokens but the context holds {self.target.n_ctx}; "
                "shorten the prompt or load with a larger n_ctx", len(tokens), self.target.n_ctx)
        return tokens

    def _request(self, prompt: list[int], *, max_tokens: int = 256, temperature: float = 0.0,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, seed: Optional[int] = None,
                 stop: Union[None, str, Sequence[str]] = None,
                 n_draft: Union[None, int, str] = None, exact: Union[None, str, float, bool] = None,
                 grammar: Any = None, json_schema: Any = None, logit_bias: Optional[dict] = None,
                 repeat_penalty: float = 1.0, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 penalty_last_n: int = 64, logprobs: Optional[int] = None,
                 tree: Union[None, int, str, bool] = None) -> _Request:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidParameterError("max_tokens", max_tokens, "an integer >= 1")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise InvalidParameterError("seed", seed, "an integer >= 0, or None for a random seed")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if not all(isinstance(s, str) and s for s in stops):
            raise InvalidParameterError("stop", stop, "a non-empty string or a list of non-empty strings")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= 20):
            raise InvalidParameterError("logprobs", logprobs, "None, or 0..20 alternatives per token")
        sampling = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        n_draft = self.n_draft if n_draft is None else _check_n_draft(n_draft)
        level = self.level if exact is None else parse_level(exact)
        constraint = self._constraint(grammar, json_schema, logit_bias,
                                      Penalties(repeat_penalty, frequency_penalty, presence_penalty, penalty_last_n))
        tree = self.tree if tree is None else self._check_tree(tree)
        return _Request(prompt, sampling, max_tokens, seed, stops, n_draft, level, constraint, logprobs, tree)

    def _check_tree(self, tree: Any) -> Union[int, str]:
        """"auto", or the candidates per position (1: chains); True/False mean "auto"/1."""
        if tree is True or tree == "auto":
            return "auto"
        if tree is False:
            return 1
        if isinstance(tree, bool) or not isinstance(tree, int) or not 1 <= tree <= TREE_BRANCHES:
            raise InvalidParameterError("tree", tree, f'"auto" (default), 1 for chains only, or the candidates '
                                        f"to verify per position, 2..{TREE_BRANCHES}")
        if tree > 1 and getattr(self.target, "n_branches", 1) <= 1:
            why = "MTP layers" if getattr(self.target, "mtp_head", None) is not None else \
                f"{getattr(self.target, 'memory', 'remote')} memory, or a model this process does not host"
            raise InvalidParameterError("tree", tree, f'1 or "auto": {self.target.name} verifies chains only ({why})')
        return tree

    def _constraint(self, grammar: Any, json_schema: Any, logit_bias: Optional[dict],
                    penalties: Penalties) -> Optional[Constraint]:
        source = grammar_source(grammar, json_schema)
        parsed = None
        if source is not None:
            param = "grammar" if grammar is not None else "json_schema"
            parsed = Grammar(self.target.grammar_tokenizer(), source, param)
        constraint = Constraint(logit_bias=check_logit_bias(logit_bias, self.target.n_vocab), penalties=penalties,
                                grammar=parsed)
        return constraint if constraint.active else None

    def _policy(self, n_draft: Union[int, str], level: Level, seeded: bool, greedy: bool,
                tree: Union[int, str] = "auto", n_tokens: int = 256) -> Any:
        # first-use measurements decode probe text from position 0: keep the conversations first
        short = self.batch_diffs.groups.get(0)
        if (level.limited and (short is None or not short.covers(level.bound))) or \
                (n_draft == "auto" and self._costs is None):
            for cache in (self.target_cache, self.draft_cache):
                if cache is not None:
                    cache.stash()
        # the short-context limit; rounds at longer KV lengths get their own (Limits)
        limit = self._explain_short_limit(level) - 1 if level.limited else MAX_N_DRAFT
        has_draft = self.draft is not None
        if n_draft != "auto":
            return FixedDraft(min(n_draft, limit), has_draft=has_draft, lookup=self.lookup is True,
                              width=tree if isinstance(tree, int) else 1)
        if seeded:  # the same seed must give the same text: decide from the calibration alone
            costs, acceptance = OnlineCosts(self.costs(), frozen=True), Acceptance()
        else:
            if self._online_costs is None:
                self._online_costs = OnlineCosts(self.costs())
            costs, acceptance = self._online_costs, self._acceptance[greedy]
        lookup = self.lookup is True or (self.lookup is None and has_draft)
        limit = min(limit, MAX_AUTO_DRAFT)
        # not even an always-right draft beats plain decoding here: leave the draft model idle
        return Controller(costs, limit, has_draft=has_draft and draft_can_pay(costs, limit), lookup=lookup,
                          acceptance=acceptance, width=AUTO_WIDTH if tree == "auto" else tree, n_tokens=n_tokens)

    def _proposer_and_policy(self, req: _Request) -> tuple[Optional[Proposer], Any]:
        # a grammar's forced tokens are a source even where nothing else proposes
        forced = Proposer(None, None) if req.constraint is not None and req.constraint.grammar is not None \
            and req.n_draft != 0 else None
        if not self.speculates or req.n_draft == 0:
            return forced, FixedDraft(0)
        policy = self._policy(req.n_draft, req.level, seeded=req.seeded,
                              greedy=req.sampling.greedy, tree=req.tree, n_tokens=req.max_tokens)
        if not (policy.has_draft or policy.lookup):
            return forced, FixedDraft(0)
        draft = DraftModelProposer(self.draft, self.draft_cache, canonical=req.seeded, follows_target=self.mtp) \
            if policy.has_draft else None
        return Proposer(draft, PromptLookupProposer() if policy.lookup or draft is None else None), policy

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        self._check_open()
        if not self._lock.acquire(blocking=False):
            raise BusyError("this SpecLlama is already generating (another thread, or a stream that "
                            "is still open); finish or close() that stream first")
        try:
            yield
        finally:
            self._lock.release()

    def _run(self, req: _Request, stream: Stream) -> Iterator[Chunk]:
        tokens: list[int] = []
        texts: list[str] = []
        finish = "cancelled"
        with self._exclusive():
            # inside the lock: the first "auto" policy calibrates, which decodes on the target;
            # that one-time measurement is not part of this generation's timings
            proposer, policy = self._proposer_and_policy(req)
            t_start = time.perf_counter()
            stats = Stats(n_prompt=len(req.prompt), n_draft_max=policy.limit if proposer is not None else 0,
                          fidelity=str(req.level), rollback=self.target.rollback,
                          draft_source="mtp" if self.mtp else "model" if self.draft is not None else "")
            n_replayed = self.target.n_replayed
            stream.stats = stats
            limits = Limits(req.level, self.batch_diffs)
            steps = None
            detokenizer, matcher = Detokenizer(), StopMatcher(req.stop)
            try:
                # the prompt cache: bitwise and seeded sampling reuse only what a fresh prefill
                # computes bit for bit; otherwise all that matches, and the rows carry the
                # measured difference of reuse into the near-tie tolerance
                reuse = self.target_cache.prefill(req.prompt, canonical=req.level.bound == 0 or req.seeded)
                stats.t_prefill = time.perf_counter() - t_start
                stats.n_prompt_cached, stats.prompt_cache, stats.prompt_cache_exact = \
                    reuse.n_reused, reuse.source, reuse.exact
                if not reuse.exact:
                    limits.reuse = self.reuse_diffs
                steps = generate_steps(self.target, proposer, req.sampling, np.random.default_rng(req.seed),
                                       req.prompt, policy, limits, stats, req.constraint, req.n_logprobs)
                finish = "length"  # running out of context also ends here
                for token, from_draft, logprob in _accepted_tokens(steps):
                    if stream.cancelled:
                        finish = "cancelled"
                        break
                    if self.target.is_eog(token):
                        finish = "stop"
                        break
                    tokens.append(token)
                    text = matcher.feed(detokenizer.feed(self.target.piece(token)))
                    texts.append(text)
                    yield Chunk(text, [token], [from_draft], None if logprob is None else [logprob])
                    if matcher.stopped:
                        finish = "stop"
                        break
                    if len(tokens) == req.max_tokens:
                        break
                tail = matcher.feed(detokenizer.flush()) + matcher.flush()
                if tail and finish != "cancelled":
                    texts.append(tail)
                    yield Chunk(tail, [], [])
            except GeneratorExit:
                finish = "cancelled"
                raise
            finally:
                if steps is not None:
                    steps.close()
                stats.n_generated = len(tokens)
                stats.verify_limits = limits.used
                if req.constraint is not None:
                    stats.n_constrained_rows, stats.t_constraint = req.constraint.n_rows, req.constraint.seconds
                stats.controller = policy.as_dict()
                _keep_near_ties(stats, len(tokens) + (finish == "stop" and not matcher.stopped), req.sampling)
                stats.t_total = time.perf_counter() - t_start
                stats.n_replayed = self.target.n_replayed - n_replayed
                _record_memory(stats, self.target, self.draft)
                stream.result = Result("".join(texts), tokens, finish, stats)

    def prompt_cache_info(self) -> dict:
        """The prompt caches' counters: hits, misses, tokens reused, states saved in RAM."""
        out = {"budget_bytes": self.prompt_cache_budget.n_bytes, "evicted": self.prompt_cache_budget.n_evicted,
               "target": self.target_cache.as_dict()}
        if self.draft_cache is not None:
            out["draft"] = self.draft_cache.as_dict()
        return out


def _record_memory(stats: Stats, target: Runtime, draft: Optional[Runtime]) -> None:
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


def _accepted_tokens(steps: Iterator[Any]) -> Iterator[tuple[int, bool, Any]]:
    """(token, came from the draft, its logprobs or None) for every token the rounds accept."""
    for step in steps:
        for i, token in enumerate(step.tokens):
            yield token, i < step.n_from_draft, None if step.logprobs is None else step.logprobs[i]


def _check_cache_mb(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise InvalidParameterError("prompt_cache_mb", value, "a size in MiB >= 0 (0: keep no saved states in RAM)")
    return int(value * 2**20)


def _check_n_draft(n_draft: Any) -> Union[int, str]:
    if n_draft == "auto":
        return n_draft
    if isinstance(n_draft, bool) or not isinstance(n_draft, int) or not 0 <= n_draft <= MAX_N_DRAFT:
        raise InvalidParameterError("n_draft", n_draft,
                                    f'"auto" or an integer in 0..{MAX_N_DRAFT} (0 = no drafting)')
    return n_draft


def _vocab_info(runtime: Runtime) -> VocabInfo:
    return VocabInfo(runtime.name, runtime.vocab_type, runtime.n_vocab, runtime.bos, runtime.eos,
                     runtime.add_bos, runtime.add_eos, runtime.token_text)


_SETTING_NAMES = {f.name for f in fields(ModelSettings)}


def load(target: Any, draft: Any = None, *, n_draft: Union[int, str] = "auto",
         exact: Union[str, float, bool] = "rounding",
         lookup: Optional[bool] = None, check_memory: bool = True, prompt_cache_mb: float = PROMPT_CACHE_MB,
         tree: Union[int, str, bool] = "auto", **model_settings: Any) -> SpecLlama:
    """Load a target model and an optional draft of the same family.

    Args:
        target: a GGUF path, a Hub repo id ("Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:q4_k_m"), a
            models.toml alias, or a llama_cpp.Llama you built (its settings are kept).
        draft: the same kinds, "auto" to find a same-family draft (the target's own MTP
            layers first, where its GGUF has them), "mtp" for those layers, "ngram" for prompt
            lookup alone (no second model), or None for plain decoding.
        n_draft: "auto" (default: each round drafts as far as the measured costs and the
            acceptance so far say pays, and not at all when nothing beats plain decoding), or
            a fixed number of tokens per round (0..32).
        lookup: prompt lookup (n-grams of prompt + output) as a source of drafts. None
            (default): in auto mode, weighed beside the draft model every round; True: also
            with a fixed n_draft (first on long matches) or with no draft model; False: never.
        tree: "auto" (default): in auto mode a round may verify, beside each drafted token,
            up to 2 next-best draft tokens and prompt lookup's continuation, as a tree in one
            target pass, where the measured cost of verify rows says it pays. An integer w:
            that many candidates per drafted position (with a fixed n_draft: at every one).
            1: chains only. Trees need an attention-only target on this machine; others
            verify chains.
        prompt_cache_mb: RAM for saved prompt-cache states (MiB, target and draft together):
            conversations a call switched away from, restored when they come back. The live
            sequence in each context is reused whatever this is; 0 keeps nothing else.
        check_memory: plan the memory both models need from their GGUF headers and raise
            MemoryPlanError (with ways out) before loading when it exceeds what is available.
        exact: the fidelity level. "bitwise": verify batches only of sizes measured to give
            bitwise the target's single-token logits at the current KV length, so greedy
            output is the target's own at any length (plain decoding where none is).
            "rounding" (default): sizes that differ by float rounding only (at most
            fidelity.ROUNDING_BOUND logits); greedy output can differ only at near-ties, which
            stats.near_ties counts. "off": no limit. A number: sizes that differ by at most
            that many logits. True and False mean "bitwise" and "off". Measurements are
            cached per model, settings and llama.cpp build.
        **model_settings: llama.cpp settings for both models: n_ctx, n_batch, n_threads,
            n_threads_batch, n_gpu_layers, flash_attn, type_k, type_v, use_mmap, verbose.
            Prefix one with draft_ to set it for the draft alone (e.g. draft_n_gpu_layers=0).
            rpc=["host:port", ...] puts the target's offloaded layers (n_gpu_layers, all by
            default) on llama.cpp RPC workers (`specllama worker`), split by their free
            memory or by tensor_split=(share, ...), as llama.cpp's --rpc does; the draft stays
            on this machine unless draft_rpc is given. rpc_timeout (seconds, default 600)
            bounds one call on a model with workers; a lost worker raises RpcError naming it.
            rollback ("n_rs_seq", "checkpoint"; None: the fastest the model supports) says how
            a hybrid or recurrent target drops rejected tokens (see runtime.ROLLBACKS).
    Returns:
        A SpecLlama; close() it or use it in a with-block.
    """
    target_kw = {k: v for k, v in model_settings.items() if not k.startswith("draft_")}
    # the draft stays on this machine unless draft_rpc says otherwise
    draft_kw = {**{k: v for k, v in target_kw.items() if k not in _TARGET_ONLY},
                **{k[6:]: v for k, v in model_settings.items() if k.startswith("draft_")}}
    # a draft decodes one token at a time, which per-batch snapshots (n_rs_seq) cannot undo
    draft_kw.setdefault("rollback", "checkpoint")
    for key in set(target_kw) | set(draft_kw):
        if key not in _SETTING_NAMES:
            raise TypeError(f"load() got an unknown setting {key!r}; known: {', '.join(sorted(_SETTING_NAMES))}")
    _check_n_draft(n_draft)
    parse_level(exact)
    _check_cache_mb(prompt_cache_mb)
    if draft == "ngram":
        draft, lookup = None, True
    target_settings, draft_settings = ModelSettings(**target_kw), ModelSettings(**draft_kw)
    for role, model, settings in (("", target, target_settings), ("draft_", draft, draft_settings)):
        if settings.rpc and not _is_ref(model):
            raise InvalidParameterError(f"{role}rpc", settings.rpc, "used with a GGUF path or a Hub reference; a "
                                        "llama_cpp.Llama keeps the devices it was built with")
    note = offload_note(target_settings.n_gpu_layers) if not target_settings.rpc else None
    if note is not None:
        log.info(note)
    if _is_ref(target) and (draft is None or _is_ref(draft)):
        from .draft_select import resolve_pair

        target, draft, notes = resolve_pair(str(target), None if draft is None else str(draft))
        for note in notes:
            log.info(note)
    opened: list[Any] = []  # what to close if loading fails part way
    try:
        # a model on RPC workers is hosted by a process of its own, which reports their memory
        target_host = _rpc_host(target_settings, opened)
        draft_host = _rpc_host(draft_settings, opened) if draft is not None else None
        if check_memory and _is_ref(target) and (draft is None or _is_ref(draft)):
            memory = make_plan(Path(target), Path(draft) if draft not in (None, MTP) else None, target_settings,
                               draft_settings, gpu_offload=supports_gpu_offload(),
                               target_devices=target_host and target_host.devices,
                               draft_devices=draft_host and draft_host.devices,
                               prompt_cache=_check_cache_mb(prompt_cache_mb))
            check_plan(memory, target_settings.n_ctx)
        mtp = draft == MTP
        if mtp and (target_host is not None or not _is_ref(target)):
            raise InvalidParameterError("draft", draft, "used with a GGUF path or Hub reference on this machine; "
                                        "a llama_cpp.Llama or a target on RPC workers cannot load its MTP layers")
        target_rt = target_host.load(target) if target_host else \
            open_runtime(target, target_settings, mtp=mtp, n_branches=TREE_BRANCHES)
        opened.append(target_rt)
        draft_rt = None
        if mtp:
            draft_rt = target_rt.mtp_head
            if draft_rt is None:
                log.warning("%s: %s; decoding without a draft", target_rt.name, target_rt.mtp_note)
        elif draft is not None:
            draft_rt = draft_host.load(draft) if draft_host else open_runtime(draft, draft_settings)
            opened.append(draft_rt)
        return SpecLlama(target_rt, draft_rt, n_draft=n_draft, exact=exact, lookup=lookup,
                         prompt_cache_mb=prompt_cache_mb, tree=tree)
    except BaseException:
        for handle in reversed(opened):
            handle.close()
        raise


# settings that describe the target's placement or role, which the draft does not inherit
_TARGET_ONLY = ("rpc", "tensor_split", "rollback")


def _rpc_host(settings: ModelSettings, opened: list) -> Optional[RemoteRuntime]:
    if not settings.rpc:
        return None
    host = RemoteRuntime(settings)
    opened.append(host)
    return host


def _is_ref(model: Any) -> bool:
    return isinstance(model, (str, os.PathLike))
