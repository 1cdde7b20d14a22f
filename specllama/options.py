"""The options of one generation, in one dataclass: generate() and stream() take them as
keywords, the llama-cpp-python methods, the server's translators and the CLI build them, so a
new option is added here once. What needs the model (token ids, grammars) is checked when a
generation starts (engine.SpecLlama._request); a prompt is checked by prompt_tokens()."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Optional, Union, cast

import numpy as np

from .errors import EmptyPromptError, InvalidParameterError, PromptTooLongError
from .decoding.limits import MAX_N_DRAFT, TREE_BRANCHES


@dataclass(frozen=True)
class GenerateOptions:
    """How to generate.

    Attributes:
        max_tokens: most tokens to generate; None: until the text ends or the context is full
            (llama-cpp-python's max_tokens=None, llama.cpp's -n -1).
        temperature, top_k, top_p, min_p: sampling (llama.cpp's order: top_k, top_p, min_p,
            then temperature); temperature 0 is greedy.
        seed: seed of the numpy Generator used for sampling (same seed, same output).
        stop: a string or strings that end generation; they are not included in the text.
        n_draft: tokens drafted per round, or "auto"; None: the value given to load().
        exact: fidelity level ("bitwise", "rounding", "off" or a bound in logits); None: load()'s.
        tree: "auto", or candidates per drafted position (1: chains); None: load()'s.
        grammar: GBNF text (or a llama_cpp.LlamaGrammar) the output must match.
        json_schema: a JSON schema the output must match (json.dumps layout).
        logit_bias: {token id: bias in logits} added to every row.
        repeat_penalty, frequency_penalty, presence_penalty, penalty_last_n: llama.cpp's
            repetition penalties over the last penalty_last_n generated tokens.
        logprobs: None, or alternatives per token (0..20) to report with each token's logprob.
        cache_scope: prompt-cache states are reused only by generations of the same scope (the
            server gives each API key its own, so no client's cached prompt speeds up, or shows
            in the cached counts of, another's); "" for the one shared scope.
        on_progress: called with a streams.PromptProgress as the prompt's prefill goes: where it
            starts (what a cache held), after each batch, and at the whole prompt (mlx-lm's
            prompt_progress_callback; the server's return_progress). It runs while the models
            are held: keep it quick.
    """

    max_tokens: Optional[int] = 256
    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: Optional[int] = None
    stop: Union[None, str, tuple[str, ...], list[str]] = None
    n_draft: Union[None, int, str] = None
    exact: Union[None, str, float, bool] = None
    tree: Union[None, int, str, bool] = None
    grammar: Any = None
    json_schema: Any = None
    logit_bias: Optional[dict] = None
    repeat_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    penalty_last_n: int = 64
    logprobs: Optional[int] = None
    cache_scope: str = ""
    on_progress: Optional[Callable[[Any], None]] = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int)
                                            or self.max_tokens < 1):
            raise InvalidParameterError("max_tokens", self.max_tokens,
                                        "an integer >= 1, or None for as many as the context holds")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise InvalidParameterError("seed", self.seed, "an integer >= 0, or None for a random seed")
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(s, str) and s for s in stops):
            raise InvalidParameterError("stop", self.stop, "a non-empty string or a list of non-empty strings")
        object.__setattr__(self, "stop", stops)
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= 20):
            raise InvalidParameterError("logprobs", self.logprobs, "None, or 0..20 alternatives per token")
        if not isinstance(self.cache_scope, str):
            raise InvalidParameterError("cache_scope", self.cache_scope, 'a string naming whose prompts may be reused '
                                        '("" for all)')
        if self.on_progress is not None and not callable(self.on_progress):
            raise InvalidParameterError("on_progress", self.on_progress, "a function taking a PromptProgress, or None")
        if self.n_draft is not None:
            check_n_draft(self.n_draft)
        if self.tree is not None:
            check_tree(self.tree)

    def as_kwargs(self) -> dict:
        """The options as generate()'s keywords."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def of(cls, options: dict) -> "GenerateOptions":
        """From keyword arguments; a TypeError naming an unknown one and the known ones."""
        unknown = sorted(set(options) - NAMES)
        if unknown:
            raise TypeError(f"unknown generation option {unknown[0]!r}; known: {', '.join(sorted(NAMES))}")
        return cls(**options)


NAMES = {f.name for f in fields(GenerateOptions)}


def check_n_draft(n_draft: Any) -> Union[int, str]:
    if n_draft == "auto":
        return "auto"
    if isinstance(n_draft, bool) or not isinstance(n_draft, int) or not 0 <= n_draft <= MAX_N_DRAFT:
        raise InvalidParameterError("n_draft", n_draft, f'"auto" or an integer in 0..{MAX_N_DRAFT} (0 = no drafting)')
    return n_draft


def check_tree(tree: Any) -> Union[int, str]:
    """"auto", or the candidates per position (1: chains); True/False mean "auto"/1."""
    if tree is True or tree == "auto":
        return "auto"
    if tree is False:
        return 1
    if isinstance(tree, bool) or not isinstance(tree, int) or not 1 <= tree <= TREE_BRANCHES:
        raise InvalidParameterError("tree", tree, f'"auto" (default), 1 for chains only, or the candidates '
                                    f"to verify per position, 2..{TREE_BRANCHES}")
    return tree


Prompt = Union[str, Sequence[int]]


def prompt_tokens(prompt: Prompt, tokenize: Any, n_vocab: int, n_ctx: int) -> list[int]:
    """A prompt's tokens, checked: text (valid Unicode) or token ids in the vocabulary, not
    empty, and fitting the context; a typed error naming what is wrong otherwise."""
    if isinstance(prompt, str):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidParameterError("prompt", prompt[max(0, e.start - 10):e.end + 10],
                                        "valid Unicode text (it holds an unpaired surrogate, "
                                        "e.g. from undecodable bytes)") from None
        tokens = tokenize(prompt) if prompt else []
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        tokens = list(cast(Sequence[int], prompt))
        bad = [t for t in tokens if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < n_vocab]
        if bad:
            raise InvalidParameterError("prompt", bad[0], f"text, or token ids in 0..{n_vocab - 1}")
        tokens = [int(t) for t in tokens]
    else:
        raise InvalidParameterError("prompt", prompt, "a string or a list of token ids")
    if not tokens:
        raise EmptyPromptError("the prompt is empty: give some text or at least one token id")
    if len(tokens) > n_ctx:
        raise PromptTooLongError(f"the prompt has {len(tokens)} tokens but the context holds {n_ctx}; shorten the "
                                 "prompt or load with a larger n_ctx", len(tokens), n_ctx)
    return tokens


MAX_PARALLEL = 64


def check_n_parallel(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PARALLEL:
        raise InvalidParameterError("n_parallel", value, f"an integer 1..{MAX_PARALLEL}: how many requests may "
                                    "decode side by side, each in contexts of its own")
    return value


def check_cache_mb(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise InvalidParameterError("prompt_cache_mb", value, "a size in MiB >= 0 (0: keep no saved states in RAM)")
    return int(value * 2**20)
