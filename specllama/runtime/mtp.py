"""A model's MTP (nextn) layers as a draft: a second context on the target's own weights."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any, Optional, Protocol, TypeVar

import llama_cpp
import numpy as np

from ..errors import ContextFullError, DecodeError, InvalidParameterError
from .decoder import check_status, llama_decode
from .ggml import MemoryUse
from .handles import Handle, new_context
from .protocols import Beside, SlotUnavailable
from .settings import ModelSettings

T = TypeVar("T")


class MtpTarget(Protocol):
    """What MTP layers read of the target they follow (a core.Runtime)."""

    name: str
    identity: str
    n_ctx: int
    n_vocab: int
    n_embd: int
    n_nextn: int
    cached: list[int]

    @property
    def handles(self) -> tuple[Handle, Handle]: ...


def mtp_api() -> Any:
    """llama-cpp-python's bindings of llama.cpp's staging MTP functions (llama-ext.h)."""
    try:
        from llama_cpp import llama_cpp_ext
    except (ImportError, AttributeError) as exc:
        raise MtpUnavailable(f"this llama.cpp build lacks the MTP staging functions ({exc})") from None
    return llama_cpp_ext


class MtpUnavailable(DecodeError):
    """The llama.cpp build cannot run MTP layers (its staging functions are missing)."""


class MtpHead:
    """A model's MTP (nextn) layers as a draft: a second context on the same weights.

    Entry p of its KV cache pairs token x_p with the target's hidden state h_(p-1), which it
    gets from every decode of the target (follow); a draft step feeds the newest token with the
    last h, then each drafted token with the head's own output state. It has a draft's
    interface (protocols.Drafter), so the draft-model proposer drives it. Where the target's h
    is unknown (a restored prompt-cache state), entries get zeros: drafts there are worse, the
    output is the same.
    """

    RECENT = 256  # target hidden states kept per position, for rollbacks and restores
    follows_target = True  # fed by its target's decodes, the prompt's included
    t_waited_total = 0.0  # a context of its own: it never waits for other lanes

    def __init__(self, target: MtpTarget, settings: ModelSettings, stack: ExitStack):
        api = mtp_api()
        if target.n_nextn <= 0:
            raise InvalidParameterError("draft", "mtp", f"a target whose GGUF has MTP (nextn) layers; {target.name} "
                                        "has none")
        self.target, self.name = target, f"{target.name} (MTP)"
        self.identity = target.identity + "|mtp"
        self._api = api
        # the target's own weights and context: the head lives and dies with them
        target_model, self._target_ctx = target.handles
        self._ctx: Handle = new_context(target_model, settings, stack, mtp=True, name=self.name)
        api.llama_set_embeddings_nextn(self._target_ctx.ptr, True, False)  # h for every token the target decodes
        api.llama_set_embeddings_nextn(self._ctx.ptr, True, True)  # and for the head's output rows
        self.n_ctx, self.n_vocab, self.n_embd = target.n_ctx, target.n_vocab, target.n_embd
        self.n_batch = int(llama_cpp.llama_n_batch(self._ctx.ptr))
        self._batch = llama_cpp.llama_batch_init(self.n_batch, self.n_embd, 1)
        self._tokens = (llama_cpp.llama_token * self.n_batch)()  # an embd batch has no token array of its own
        self._batch.token = self._tokens
        stack.callback(self._free_batch)
        self._embd = np.ctypeslib.as_array(self._batch.embd, shape=(self.n_batch, self.n_embd))
        self.n_cached = 0  # entries at positions 0..n_cached-1
        self._h: dict[int, np.ndarray] = {}  # position -> the target's h there (recent ones)
        self._h_out: Optional[np.ndarray] = None  # the head's output state of its last row
        self._n_rows = 0
        self.memory_use: Optional[MemoryUse] = None  # part of the target's
        llama_cpp.llama_memory_clear(self._mem, True)

    @property
    def _mem(self) -> Any:
        return llama_cpp.llama_get_memory(self._ctx.ptr)  # ClosedError once the context is freed

    def _free_batch(self) -> None:
        self._batch.token = ctypes.POINTER(llama_cpp.llama_token)()  # ours, not llama.cpp's to free
        llama_cpp.llama_batch_free(self._batch)

    @property
    def cached(self) -> list[int]:
        """What it holds, as the target's first n_cached tokens."""
        return self.target.cached[:self.n_cached]

    def follow(self, target_tokens: Sequence[int], pos0: int) -> None:
        """The target just decoded target_tokens[pos0:]: enter them, each with the h before it."""
        h = self._target_hidden_states(len(target_tokens) - pos0)
        self.truncate(pos0)
        for i in range(len(h)):
            self._h[pos0 + i] = h[i].copy()
        for p in [p for p in self._h if p < len(target_tokens) - self.RECENT]:
            del self._h[p]
        self._enter(target_tokens[self.n_cached:], logits=False)

    def _target_hidden_states(self, n_rows: int) -> np.ndarray:
        """The target's hidden state of each token of its last decode, (n_rows, n_embd): what
        the layers predict from. Valid until the target's next decode."""
        ptr = self._api.llama_get_embeddings_nextn(self._target_ctx.ptr)
        if not ptr:
            raise DecodeError(f"{self.target.name}: llama.cpp returned no hidden states for the MTP layers")
        return np.ctypeslib.as_array(ptr, shape=(n_rows, self.n_embd))

    def _enter(self, tokens: Sequence[int], logits: bool, h_first: Optional[np.ndarray] = None) -> None:
        """Decode entries for tokens at n_cached.., each paired with the target's h before it."""
        self._ctx.ptr  # ClosedError once freed (its batch went with it)
        if self.n_cached + len(tokens) > self.n_ctx:
            raise ContextFullError(f"{self.name}: {self.n_cached} cached + {len(tokens)} new tokens exceed the "
                                   f"context of {self.n_ctx} tokens")
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            c = self._batch
            for i, token in enumerate(chunk):
                pos = self.n_cached + i
                h = h_first if h_first is not None and start + i == 0 else self._h.get(pos - 1)
                c.token[i], c.pos[i], c.n_seq_id[i], c.seq_id[i][0] = token, pos, 1, 0
                c.logits[i] = logits and start + i == len(tokens) - 1
                self._embd[i] = 0.0 if h is None else h
            c.n_tokens = len(chunk)
            status, why = llama_decode(self._ctx.ptr, c)
            if status != 0:
                llama_cpp.llama_memory_seq_rm(self._mem, 0, self.n_cached, -1)
                check_status(status, why, self.name, self.n_cached, len(chunk))
            self.n_cached += len(chunk)
        self._n_rows = 1 if logits else 0
        if logits:
            self._h_out = np.ctypeslib.as_array(self._api.llama_get_embeddings_nextn_ith(self._ctx.ptr, -1),
                                                shape=(self.n_embd,)).copy()

    # --- a draft's interface (protocols.Drafter) ----------------------------------------------

    def truncate(self, n_keep: int) -> None:
        if n_keep < self.n_cached:
            llama_cpp.llama_memory_seq_rm(self._mem, 0, n_keep, -1)
            self.n_cached = n_keep
        self._n_rows = 0

    def sync(self, tokens: Sequence[int]) -> None:
        """Enter tokens[-1] after the target's entries for tokens[:-1], logits for it."""
        self.truncate(len(tokens) - 1)  # the last round's drafts
        self._enter(tokens[self.n_cached:], logits=True)

    def decode(self, tokens: Sequence[int]) -> None:
        """Drafted tokens, logits for the last: the first pairs with the head's own last output state."""
        self._enter(tokens, logits=True, h_first=self._h_out)

    def logits(self, row: int) -> np.ndarray:
        if row != 0 or not self._n_rows:
            raise IndexError(f"{self.name}: logit row {row} was not requested by the last decode")
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._ctx.ptr, -1), shape=(self.n_vocab,))

    @property
    def why_no_sibling(self) -> str:
        return "the target's MTP layers follow one target context"

    def passing_turns(self, beside: Optional[Beside], n_piece: int = 0) -> AbstractContextManager[None]:
        return nullcontext()  # a draft step decodes a few tokens: nothing to pass the turn between

    def drafting(self, steps: Callable[..., T], *args: Any) -> T:
        return steps(*args)  # its steps decode in its target's context, which may be a lane's

    def sibling(self) -> "MtpHead":
        raise SlotUnavailable(self.why_no_sibling)

    def close(self) -> None:
        """Freed with its target."""
