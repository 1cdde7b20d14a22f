"""Constraints: what shapes each target row given the tokens before it, applied in verification.

A constraint turns a row of logits into the row a token is chosen from (a logit bias, a
grammar's mask, repetition penalties over the recent tokens) and keeps a state that follows
the accepted tokens. The verifier applies it row by row, advancing it with each drafted token
it accepts, so greedy output is plain decoding's under the same constraint and sampled output
keeps the constrained target distribution. Drafts propose under it too (their q then wastes
nothing on forbidden tokens), and tokens the grammar forces are proposals for free.

Grammars are llguidance's (the engine llama.cpp, vLLM and SGLang use): masks, forced tokens and
rollback of consumed tokens, which is what speculative verification needs.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, cast

import llguidance
import numpy as np

from ..errors import ConstraintError, InvalidParameterError

# JSON as json.dumps writes it: no free whitespace, so keys and punctuation are forced tokens
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Penalties:
    """llama.cpp's repetition penalties over the last last_n generated tokens (its defaults: off).

    For a token seen c > 0 times there: logit / repeat if logit > 0 else logit * repeat,
    then minus c * frequency + presence.
    """

    repeat: float = 1.0
    frequency: float = 0.0
    presence: float = 0.0
    last_n: int = 64

    def __post_init__(self) -> None:
        for name, value, ok, what in (
                ("repeat_penalty", self.repeat, lambda v: v > 0, "a number > 0 (1 = off)"),
                ("frequency_penalty", self.frequency, lambda v: True, "a finite number (0 = off)"),
                ("presence_penalty", self.presence, lambda v: True, "a finite number (0 = off)")):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or not ok(value):
                raise InvalidParameterError(name, value, what)
        if isinstance(self.last_n, bool) or not isinstance(self.last_n, int) or self.last_n < 0:
            raise InvalidParameterError("penalty_last_n", self.last_n, "an integer >= 0 (0 = off)")

    @property
    def off(self) -> bool:
        return self.last_n == 0 or (self.repeat == 1.0 and self.frequency == 0.0 and self.presence == 0.0)

    def apply(self, row: np.ndarray, history: Sequence[int]) -> None:
        """Penalize row (float32, modified in place) for the tokens of history's window."""
        if self.off or not history:
            return
        ids, counts = np.unique(np.asarray(history[-self.last_n:], dtype=np.int64), return_counts=True)
        x = row[ids]
        x = np.where(x <= 0, x * np.float32(self.repeat), x / np.float32(self.repeat)).astype(np.float32)
        row[ids] = x - (counts.astype(np.float32) * np.float32(self.frequency) + np.float32(self.presence))


def check_logit_bias(logit_bias: Any, n_vocab: int) -> dict[int, float]:
    """{token id: bias} from a mapping with int or numeric-string keys (OpenAI sends strings)."""
    if logit_bias is None:
        return {}
    if not isinstance(logit_bias, Mapping):
        raise InvalidParameterError("logit_bias", logit_bias, "a mapping of token id to a bias in logits")
    out: dict[int, float] = {}
    for key, value in logit_bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            token = -1
        if not 0 <= token < n_vocab or (isinstance(key, float) and not key.is_integer()):
            raise InvalidParameterError("logit_bias", key, f"token ids in 0..{n_vocab - 1} as keys")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise InvalidParameterError("logit_bias", value, "numbers as values (-inf bans a token)")
        out[token] = float(value)
    return out


@dataclass(frozen=True)
class Lark:
    """A grammar in llguidance's Lark dialect (special tokens as <[id]>), as tool calls build."""

    text: str


def grammar_source(grammar: Any = None, json_schema: Any = None) -> Optional[str]:
    """The llguidance grammar for a GBNF or Lark text (or a llama_cpp.LlamaGrammar) or a JSON
    schema (a dict or its JSON text; {"type": "object"} for any JSON object). Not yet checked
    against a vocabulary: Grammar() does that."""
    if grammar is not None and json_schema is not None:
        raise InvalidParameterError("grammar", "...", "either a grammar or a JSON schema, not both")
    if isinstance(grammar, Lark):
        return llguidance.LLMatcher.grammar_from_lark(grammar.text)
    if grammar is not None:
        text = getattr(grammar, "_grammar", grammar)  # a LlamaGrammar keeps its GBNF text
        if not isinstance(text, str) or not text.strip():
            raise InvalidParameterError("grammar", grammar, "GBNF (or Lark) grammar text, or a llama_cpp.LlamaGrammar")
        try:
            return llguidance.grammar_from("gbnf", text)
        except ValueError as e:
            raise InvalidParameterError("grammar", _short(text), f"a valid GBNF grammar ({e})") from None
    if json_schema is not None:
        if isinstance(json_schema, str):
            try:
                json_schema = json.loads(json_schema)
            except ValueError:
                raise InvalidParameterError("json_schema", _short(json_schema), "a JSON schema (JSON text or a dict)") \
                    from None
        if not isinstance(json_schema, (dict, bool)):
            raise InvalidParameterError("json_schema", json_schema, "a JSON schema object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(json_schema),
                                                                 overrides=cast(Any, JSON_STYLE))
        except ValueError as e:
            raise InvalidParameterError("json_schema", _short(json.dumps(json_schema)), f"a valid JSON schema ({e})") \
                from None
    return None


def _short(text: str) -> str:
    return text if len(text) <= 80 else text[:77] + "..."


class Grammar:
    """An llguidance matcher over one vocabulary: the mask of each row, forced tokens, rollback.

    Args:
        tokenizer: the llguidance.LLTokenizer of the model (Runtime.grammar_tokenizer()).
        source: an llguidance grammar from grammar_source().
        param: the request field the grammar came from, for errors.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, source: str, param: str = "grammar"):
        # one compile: the matcher enters an error state for a grammar it cannot build (validating
        # first compiled every grammar twice, on the request's path)
        self.matcher = llguidance.LLMatcher(tokenizer, source, log_level=0)
        if self.matcher.is_error():
            raise InvalidParameterError(param, "...", f"a grammar llguidance accepts: {self.matcher.get_error()}")
        self.n_vocab = tokenizer.vocab_size
        self._bitmask = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
        self._bits = self._bitmask.view(np.uint8)
        # an end-of-generation token ends the text rather than being consumed (llguidance does not
        # count it as consumed either, so a rollback over it must not roll the matcher back)
        self._eog = frozenset(tokenizer.eos_tokens)
        self._consumed: list[bool] = []

    def allowed(self) -> np.ndarray:
        """A bool array over the vocabulary: the tokens the grammar allows next."""
        self.matcher.unsafe_compute_mask_ptr(self._bitmask.ctypes.data, self._bitmask.nbytes)
        self._check()
        return np.unpackbits(self._bits, bitorder="little")[:self.n_vocab].view(bool)

    def accept(self, token: int) -> None:
        if token in self._eog:
            if not self.matcher.is_accepting():
                raise ConstraintError(f"the text ended (token {token}) before the grammar was complete")
            self._consumed.append(False)
            return
        if not self.matcher.consume_token(token):
            raise ConstraintError(f"token {token} does not fit the grammar here: "
                                  f"{self.matcher.get_error() or 'rejected'}")
        self._consumed.append(True)

    def rollback(self, n_tokens: int) -> None:
        if n_tokens <= 0:
            return
        n_matcher = sum(self._consumed[-n_tokens:])
        del self._consumed[-n_tokens:]
        if n_matcher and not self.matcher.rollback(n_matcher):
            raise ConstraintError(f"the grammar could not roll back {n_matcher} tokens: {self.matcher.get_error()}")

    def n_valid(self, tokens: Sequence[int]) -> int:
        """How many of tokens, in order, the grammar allows from here (none consumed)."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def forced(self) -> list[int]:
        """Tokens the grammar forces from here, in its canonical tokenization."""
        return list(self.matcher.compute_ff_tokens())

    def _check(self) -> None:
        if self.matcher.is_error():
            raise ConstraintError(f"the grammar is in an error state: {self.matcher.get_error()}")


class Constraint:
    """One generation's row transform (logit bias, grammar mask, penalties) and its state.

    rows() of a verify pass and a draft's rows go through apply(); accept() advances the state
    with each token that becomes part of the text; rollback() undoes what a draft explored.
    """

    def __init__(self, *, logit_bias: Optional[dict[int, float]] = None, penalties: Penalties = Penalties(),
                 grammar: Optional[Grammar] = None):
        self.penalties, self.grammar = penalties, grammar
        self._bias_ids = np.array(sorted(logit_bias or {}), dtype=np.int64)
        self._bias = np.array([logit_bias[i] for i in self._bias_ids], dtype=np.float32) if logit_bias else None
        self.history: list[int] = []  # generated tokens the state has consumed
        self.n_rows = 0  # rows shaped (target and draft)
        self.seconds = 0.0  # spent shaping rows and advancing the grammar

    @property
    def active(self) -> bool:
        return self._bias is not None or not self.penalties.off or self.grammar is not None

    def apply(self, row: np.ndarray) -> np.ndarray:
        """The row a token is chosen from after history (a new float32 array; row is untouched)."""
        t0 = time.perf_counter()
        out = np.array(row, dtype=np.float32)
        n = out.shape[0]  # a draft's vocabulary may be a few tokens shorter or longer
        if self._bias is not None:
            keep = self._bias_ids < n
            out[self._bias_ids[keep]] += self._bias[keep]
        self.penalties.apply(out, self.history)
        if self.grammar is not None:
            allowed = self.grammar.allowed()
            out[:min(n, allowed.shape[0])][~allowed[:n]] = -np.inf
            out[allowed.shape[0]:] = -np.inf
        self.n_rows += 1
        self.seconds += time.perf_counter() - t0
        return out

    def accept(self, token: int) -> None:
        if self.grammar is not None:
            t0 = time.perf_counter()
            self.grammar.accept(token)
            self.seconds += time.perf_counter() - t0
        self.history.append(token)

    def rollback(self, n_tokens: int) -> None:
        if n_tokens <= 0:
            return
        if self.grammar is not None:
            self.grammar.rollback(n_tokens)
        del self.history[-n_tokens:]

    def n_valid(self, tokens: Sequence[int]) -> int:
        return self.grammar.n_valid(tokens) if self.grammar is not None else len(tokens)

    def forced(self, n_max: int) -> list[int]:
        return self.grammar.forced()[:n_max] if self.grammar is not None and n_max > 0 else []
