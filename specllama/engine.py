"""SpecLlama: the public object that owns a target and an optional draft and generates text."""

from __future__ import annotations

import dataclasses
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

from .calibrate import costs as measured_costs, invariant_batch_size
from .compat import VocabInfo, check_compatible
from .decode import generate_steps
from .errors import BusyError, EmptyPromptError, InvalidParameterError, PromptTooLongError
from .controller import AdaptiveDraft, FixedDraft
from .proposers import CombinedProposer, DraftModelProposer, PromptLookupProposer
from .plan import check as check_plan, make_plan
from .runtime import ModelSettings, Runtime, open_runtime, resident_bytes, supports_gpu_offload
from .sampling import SamplingSettings
from .stats import Stats
from .text import Detokenizer, StopMatcher

log = logging.getLogger("specllama")

Prompt = Union[str, Sequence[int]]
MAX_N_DRAFT = 32
MAX_AUTO_DRAFT = 16  # the controller's longest draft; costs are measured up to this


@dataclass(frozen=True)
class Chunk:
    """Part of a streamed generation: the text that became final and the tokens behind it."""

    text: str
    tokens: list[int]
    from_draft: list[bool]


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


class SpecLlama:
    """A target model, optionally with a draft model that speculates for it.

    Greedy output is token-for-token the target's own; sampled output has the target's
    distribution. Build it with specllama.load().
    """

    def __init__(self, target: Runtime, draft: Optional[Runtime] = None, *, n_draft: Union[int, str] = "auto",
                 exact: bool = True, lookup: bool = False):
        self.target = target
        self.draft = draft
        self.n_draft = _check_n_draft(n_draft)
        if not isinstance(exact, bool):
            raise InvalidParameterError("exact", exact, "True or False")
        if not isinstance(lookup, bool):
            raise InvalidParameterError("lookup", lookup, "True or False")
        self.exact = exact
        self.lookup = lookup
        self._lock = threading.Lock()
        self._costs = None
        # Longest draft whose verify pass is bitwise the target's own single-token decoding.
        self.max_exact_draft = MAX_N_DRAFT
        if draft is not None:
            check_compatible(_vocab_info(target), _vocab_info(draft))
        if self.speculates and exact:
            self.max_exact_draft = invariant_batch_size(target, MAX_N_DRAFT + 1) - 1
            if self.max_exact_draft < MAX_AUTO_DRAFT:
                log.info("%s computes different logits for verify batches over %d tokens on this backend; "
                         "drafting at most %d tokens a round so output stays identical (exact=False lifts this)",
                         target.name, self.max_exact_draft + 1, self.max_exact_draft)

    @property
    def speculates(self) -> bool:
        """Whether anything proposes tokens (a draft model or prompt lookup)."""
        return self.draft is not None or self.lookup

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

    def chat_tokens(self, messages: list[dict]) -> list[int]:
        """Token ids of messages rendered with the target's chat template, ready to generate."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise InvalidParameterError("messages", messages, "a list of {'role': ..., 'content': ...} dicts")
        text = self.target.apply_chat_template(messages)
        bos_text = self.target.token_text(self.target.bos).decode("utf-8", "replace")
        add_bos = not (bos_text and text.startswith(bos_text))
        return self.target.tokenize(text, add_special=add_bos, parse_special=True)

    def tokenize(self, text: str) -> list[int]:
        return self.target.tokenize(text, add_special=True, parse_special=True)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return b"".join(self.target.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def close(self) -> None:
        """Free both models (a borrowed llama_cpp.Llama stays with its owner)."""
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
                "shorten the prompt or load with a larger n_ctx"
            )
        return tokens

    def _request(self, prompt: list[int], *, max_tokens: int = 256, temperature: float = 0.0,
                 top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, seed: Optional[int] = None,
                 stop: Union[None, str, Sequence[str]] = None,
                 n_draft: Union[None, int, str] = None) -> _Request:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidParameterError("max_tokens", max_tokens, "an integer >= 1")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise InvalidParameterError("seed", seed, "an integer >= 0, or None for a random seed")
        stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
        if not all(isinstance(s, str) and s for s in stops):
            raise InvalidParameterError("stop", stop, "a non-empty string or a list of non-empty strings")
        sampling = SamplingSettings(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        n_draft = self.n_draft if n_draft is None else _check_n_draft(n_draft)
        return _Request(prompt, sampling, max_tokens, seed, stops, n_draft)

    def _policy(self, n_draft: Union[int, str], lookup_only: bool) -> Any:
        limit = self.max_exact_draft if self.exact else MAX_N_DRAFT
        if n_draft != "auto":
            return FixedDraft(min(n_draft, limit))
        if lookup_only:  # prompt lookup costs nothing to try: start optimistic, retry soon
            free = dataclasses.replace(self.costs(), draft_token=0.0)
            return AdaptiveDraft(free, min(limit, MAX_AUTO_DRAFT), prior=0.8, probe_every=2)
        return AdaptiveDraft(self.costs(), min(limit, MAX_AUTO_DRAFT))

    def _proposer_and_policy(self, n_draft: Union[int, str]) -> tuple[Any, Any]:
        if not self.speculates:
            return None, FixedDraft(0)
        if self.draft is not None:
            policy = self._policy(n_draft, lookup_only=False)
            if not policy.hopeless:
                model = DraftModelProposer(self.draft)
                return (CombinedProposer(model, PromptLookupProposer()) if self.lookup else model), policy
            if not self.lookup:  # no draft length can beat plain decoding here: skip the draft
                return None, FixedDraft(0)
        return PromptLookupProposer(), self._policy(n_draft, lookup_only=True)

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
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
            proposer, policy = self._proposer_and_policy(req.n_draft)
            t_start = time.perf_counter()
            stats = Stats(n_prompt=len(req.prompt), n_draft_max=policy.limit if proposer is not None else 0)
            steps = generate_steps(self.target, proposer, req.sampling, np.random.default_rng(req.seed),
                                   req.prompt, policy, stats)
            detokenizer, matcher = Detokenizer(), StopMatcher(req.stop)
            try:
                finish = "length"  # running out of context also ends here
                for token, from_draft in _accepted_tokens(steps):
                    if self.target.is_eog(token):
                        finish = "stop"
                        break
                    tokens.append(token)
                    text = matcher.feed(detokenizer.feed(self.target.piece(token)))
                    texts.append(text)
                    yield Chunk(text, [token], [from_draft])
                    if matcher.stopped:
                        finish = "stop"
                        break
                    if len(tokens) == req.max_tokens:
                        break
                tail = matcher.feed(detokenizer.flush()) + matcher.flush()
                if tail:
                    texts.append(tail)
                    yield Chunk(tail, [], [])
            except GeneratorExit:
                finish = "cancelled"
                raise
            finally:
                steps.close()
                stats.n_generated = len(tokens)
                stats.t_total = time.perf_counter() - t_start
                _record_memory(stats, self.target, self.draft)
                stream.result = Result("".join(texts), tokens, finish, stats)


def _record_memory(stats: Stats, target: Runtime, draft: Optional[Runtime]) -> None:
    for runtime, name in ((target, "n_bytes_target"), (draft, "n_bytes_draft")):
        if runtime is not None and runtime.memory_use is not None:
            setattr(stats, name, runtime.memory_use.total)
    stats.n_bytes_resident = resident_bytes()


def _accepted_tokens(steps: Iterator[Any]) -> Iterator[tuple[int, bool]]:
    """(token, came from the draft) for every token the rounds accept, in order."""
    for step in steps:
        for i, token in enumerate(step.tokens):
            yield token, i < step.n_from_draft


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


def load(target: Any, draft: Any = None, *, n_draft: Union[int, str] = "auto", exact: bool = True,
         lookup: bool = False, check_memory: bool = True, **model_settings: Any) -> SpecLlama:
    """Load a target model and an optional draft of the same family.

    Args:
        target: a GGUF path, a Hub repo id ("Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:q4_k_m"), a
            models.toml alias, or a llama_cpp.Llama you built (its settings are kept).
        draft: the same kinds, "auto" to find a same-family draft, "ngram" for prompt lookup
            alone (no second model), or None for plain decoding.
        n_draft: "auto" (default: each round drafts as far as the measured costs and the
            acceptance so far say pays, and not at all when nothing beats plain decoding), or
            a fixed number of tokens per round (0..32).
        lookup: also propose by prompt lookup (n-grams of prompt + output) when it has a long
            match, falling back to the draft model.
        check_memory: plan the memory both models need from their GGUF headers and raise
            MemoryPlanError (with ways out) before loading when it exceeds what is available.
        exact: keep every verify pass within the batch size measured (once, then cached) to
            give bitwise the target's single-token logits, so greedy output is identical to
            the target alone. False drafts n_draft regardless; output may then differ where
            the target's top two tokens are within its own batch-size rounding.
        **model_settings: llama.cpp settings for both models: n_ctx, n_batch, n_threads,
            n_threads_batch, n_gpu_layers, flash_attn, type_k, type_v, use_mmap, verbose.
            Prefix one with draft_ to set it for the draft alone (e.g. draft_n_gpu_layers=0).
    Returns:
        A SpecLlama; close() it or use it in a with-block.
    """
    target_kw = {k: v for k, v in model_settings.items() if not k.startswith("draft_")}
    draft_kw = {**target_kw, **{k[6:]: v for k, v in model_settings.items() if k.startswith("draft_")}}
    for key in set(target_kw) | set(draft_kw):
        if key not in _SETTING_NAMES:
            raise TypeError(f"load() got an unknown setting {key!r}; known: {', '.join(sorted(_SETTING_NAMES))}")
    _check_n_draft(n_draft)
    if draft == "ngram":
        draft, lookup = None, True
    target_settings, draft_settings = ModelSettings(**target_kw), ModelSettings(**draft_kw)
    if _is_ref(target) and (draft is None or _is_ref(draft)):
        from .draft_select import resolve_pair

        target, draft, notes = resolve_pair(str(target), None if draft is None else str(draft))
        for note in notes:
            log.info(note)
    if check_memory and _is_ref(target) and (draft is None or _is_ref(draft)):
        memory = make_plan(Path(target), Path(draft) if draft is not None else None, target_settings,
                           draft_settings, gpu_offload=supports_gpu_offload())
        check_plan(memory, target_settings.n_ctx)
    target_rt = open_runtime(target, target_settings)
    draft_rt = None
    try:
        if draft is not None:
            draft_rt = open_runtime(draft, draft_settings)
        return SpecLlama(target_rt, draft_rt, n_draft=n_draft, exact=exact, lookup=lookup)
    except BaseException:
        if draft_rt is not None:
            draft_rt.close()
        target_rt.close()
        raise


def _is_ref(model: Any) -> bool:
    return isinstance(model, (str, os.PathLike))
