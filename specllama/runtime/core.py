"""Runtime: one model, its context and a batch, and exactly which tokens its KV cache holds.

Build with Runtime.load(path, settings) or Runtime.borrow(llama) for a llama_cpp.Llama the
caller owns; close with close() or a with-block. Callers sync to any token sequence and the
runtime reuses the longest cached prefix (session.py); a tree decode keeps one path afterwards.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TypeVar, Union

import llama_cpp
import numpy as np

from ..errors import ContextFullError, DecodeError, InvalidParameterError
from . import session
from .batches import Interrupted, chunk_bounds, next_batch_end
from .decoder import DECODER, check_status, llama_decode
from .ggml import MemoryUse
from .handles import Batch, Handle
from .loading import borrow_runtime, load_runtime, sibling_runtime, why_no_sibling
from .memory import memory_of
from .protocols import Beside, Pass, Progress
from .shared import Lane
from .settings import ModelSettings
from .state import PrefillRow, SavedState, restore_sequence, save_sequence
from .trees import TreeDecode, TreeDecoding
from .vocab import Vocab

T = TypeVar("T")


def _decode_batches(runtime: "Runtime", tokens: Sequence[int], n_past: int, n_logits: int, aligned: bool,
                    progress: Optional[Progress], cap: Optional[int]) -> tuple[int, Pass]:
    """Runtime.decode's batches: tokens at n_past.. in chunks (pieces where next_batch_end cuts
    them), each appended to runtime.cached once decoded (and told to progress); the first
    logit row the last one kept, and the last pass (what every pass waited, summed)."""
    t_row, first = 0.0, 0  # seconds a row of the last piece took
    last, t_waited = Pass(0), 0.0
    for start, chunk_end in chunk_bounds(n_past, len(tokens), runtime.n_batch, aligned):
        while start < chunk_end:
            end, t0 = next_batch_end(runtime._beside, start, chunk_end, n_logits, t_row), time.perf_counter()
            # logits are only kept for the final piece; all requested rows must be in it
            runtime._batch.fill(tokens[start:end], n_past + start, max(0, n_logits - (len(tokens) - end)))
            last = runtime._pass(n_past + start, end - start, cap)
            t_waited += last.t_waited
            t_row, first = (time.perf_counter() - t0) / (end - start), end - start - n_logits
            runtime.cached.extend(tokens[start:end])
            runtime._memory.after_decode(n_past + start, n_past + end)
            if runtime.mtp_head is not None:
                runtime.mtp_head.follow(runtime.cached, n_past + start)
            start = end
            if progress is not None:
                progress(len(runtime.cached))
    return first, Pass(last.n_rows, last.n_lanes, t_waited)


@dataclass
class _Rows:
    """Which logit rows the last decode kept, and where they sit in its batch."""

    n: int = 0
    first: int = 0  # a chain decode: the batch row of logits(0)
    of: Optional[list[int]] = None  # a tree decode: the batch row of each tree index
    pinned: Optional[np.ndarray] = None  # logits(0) kept from a prefill (the whole prompt asked again)
    copied: Optional[dict[int, np.ndarray]] = None  # a lane's rows, copied out of a shared pass

    def clear(self) -> None:
        self.n, self.first, self.of, self.pinned, self.copied = 0, 0, None, None, None


class Runtime(Vocab, TreeDecoding):
    """One model, its context and a batch; knows which tokens its KV cache holds (cached)."""

    follows_target = False  # a second model: it decodes what it is given (an MtpHead follows its target)

    def __init__(self, model: Handle, ctx: Handle, name: str, stack: ExitStack, identity: str = "",
                 rollback: Optional[str] = None, n_seq: int = 1, lane: Optional[Lane] = None):
        super().__init__(model)
        self._stack, self.name = stack, name
        self.identity = identity  # what a measurement of this runtime depends on (measure.identity)
        self._model, self._ctx = model, ctx
        # a lane of a shared context (shared.py): its sequences and its share of the cells
        self._lane = lane
        self.n_ctx = int(llama_cpp.llama_n_ctx(ctx.ptr)) if lane is None else lane.n_ctx
        # llama.cpp may clamp the requested batch size (to n_ctx), so ask the context
        self.n_batch = int(llama_cpp.llama_n_batch(ctx.ptr))
        self.memory, self._memory = memory_of(ctx, model, name, rollback,
                                              (0, 0) if lane is None else (lane.base, n_seq))
        self.rollback = self._memory.rollback
        self.n_rs_seq = int(llama_cpp.llama_n_rs_seq(ctx.ptr))
        # the most branches a tree verify batch may have (1: chains only); the context was
        # made with this many sequences in a unified KV buffer
        self.n_branches = min(n_seq, int(llama_cpp.llama_n_seq_max(ctx.ptr))) if self.memory == "attention" else 1
        self._batch = Batch(self.n_batch, stack, self.n_branches)
        self._batch.base = 0 if lane is None else lane.base
        self.t_waited_total = 0.0  # what its decodes waited for other lanes, and their rows' share of passes
        self._rows = _Rows()
        self._tree: Optional[TreeDecode] = None  # a decoded tree, until one path of it is kept
        self._n_pending = 0  # the last cached tokens, not in the KV cache yet (see _settle)
        self.cached: list[int] = []  # exactly the tokens at positions 0.. of the KV cache
        # the first n_canonical cached tokens hold exactly what a fresh prefill of them computes:
        # they were prefilled in chunks of n_batch aligned to position 0, on a canonical prefix
        self.n_canonical = 0
        self.prefill_row: Optional[PrefillRow] = None
        self.memory_use: Optional[MemoryUse] = None  # measured by load(); None for a borrowed model
        self.n_replayed = 0  # tokens decoded again after a checkpoint restore
        self.t_rollback = 0.0  # seconds rolling back took
        self.mtp_head: Any = None  # the model's MTP layers (mtp.MtpHead), when loaded with mtp=True
        self.mtp_note = ""  # why they could not be loaded
        self.settings: Optional[ModelSettings] = None  # what load() made the context with (None: borrowed)
        self.path: Optional[Path] = None  # the GGUF file load() read (None: borrowed)
        self.n_seq = n_seq
        # whom its long decodes pass the turn to between batches (batches.next_batch_end), and the
        # rows of the pieces they go in while others wait (0: whole chunks), where measured
        # bitwise; set only inside passing_turns, by the thread that owns the runtime then
        self._beside: Optional[tuple[Beside, int]] = None
        self._memory.clear()

    @classmethod
    def load(cls, path: Union[str, os.PathLike], settings: ModelSettings = ModelSettings(),
             mtp: bool = False, n_branches: int = 1) -> "Runtime":
        """loading.load_runtime: a GGUF file, validated in Python before llama.cpp sees it."""
        return load_runtime(cls, path, settings, mtp, n_branches)

    @classmethod
    def borrow(cls, llama: "llama_cpp.Llama") -> "Runtime":
        """loading.borrow_runtime: drive a llama_cpp.Llama the caller owns (and frees)."""
        return borrow_runtime(cls, llama)

    def sibling(self) -> "Runtime":
        """loading.sibling_runtime: a second context on this model, for a concurrent request."""
        return sibling_runtime(self)

    @property
    def why_no_sibling(self) -> str:
        return why_no_sibling(self)

    @property
    def handles(self) -> tuple[Handle, Handle]:
        """(model, context): for what the runtime package builds on them (MTP layers, a second
        context); nothing outside the package touches them."""
        return self._model, self._ctx

    def close(self) -> None:
        """Free the context, then the model (a borrowed Llama's stay with their owner); any
        use afterwards raises ClosedError."""
        self._stack.close()
        self._model.free()  # borrowed handles forget their pointers without freeing them
        self._ctx.free()

    def __del__(self) -> None:
        if hasattr(self, "_stack"):
            self._stack.close()

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def n_threads(self) -> int:
        """The threads llama.cpp decodes with (as the context reports them)."""
        return int(llama_cpp.llama_n_threads(self._ctx.ptr))

    @property
    def max_verify(self) -> int:
        """The largest batch whose tokens can all be rolled back but the first."""
        return self._memory.max_verify(self.n_batch)

    @property
    def checkpoint_bytes(self) -> int:
        """Size of one checkpoint of this sequence's recurrent state (0 for attention memory)."""
        return self._memory.checkpoint_bytes

    @property
    def n_pending(self) -> int:
        """Cached tokens not in the KV cache yet: they go in front of the next decode's batch."""
        return self._n_pending

    # --- decoding -----------------------------------------------------------------------------

    def decode(self, tokens: Sequence[int], *, n_logits: int = 1, aligned: bool = False,
               progress: Optional[Progress] = None, cap: Optional[int] = None) -> Pass:
        """Append tokens to the KV cache at positions len(cached)..; keep logits for the last n_logits.
        What the last pass held comes back (protocols.Pass; a lane's passes hold at most cap
        rows, other lanes' included: None, its lane's default_cap).

        Tokens go to llama.cpp in chunks of at most n_batch; aligned chunks end at multiples of
        n_batch (position 0 being the first), as a prefill from an empty cache does.
        Raises ContextFullError (nothing appended) when they do not fit; on any failure or
        interruption the cache is rolled back to where it was (a recurrent memory with no
        checkpoint there: to an earlier point, as discard() does), except Interrupted (raised by
        passing_turns: idle work stopped between two batches), after which the batches decoded stay.
        """
        self._settle()
        if not tokens:
            raise ValueError("decode needs at least one token")
        pending = self.cached[len(self.cached) - self._n_pending:]  # they go first, in the same batch
        n_past, tokens = len(self.cached) - len(pending), [*pending, *tokens]
        if n_past + len(tokens) > self.n_ctx:
            raise ContextFullError(f"{self.name}: {n_past} cached + {len(tokens)} new tokens exceed the context "
                                   f"of {self.n_ctx} tokens; raise n_ctx or shorten the prompt")
        if not 0 < n_logits <= min(len(tokens), self.n_batch):
            raise ValueError(f"n_logits={n_logits} must be in 1..{min(len(tokens), self.n_batch)}")
        del self.cached[n_past:]
        self._n_pending = 0
        self._rows.clear()
        self._memory.before_decode(n_past, len(tokens))
        try:
            self._rows.first, last = _decode_batches(self, tokens, n_past, n_logits, aligned, progress, cap)
            self._rows.n = n_logits
        except BaseException as e:
            self._rows.clear()
            if not isinstance(e, Interrupted):  # stopped between two batches: those decoded stay
                self.discard(n_past)
            raise
        return last

    def _pass(self, pos: int, n_tokens: int, cap: Optional[int] = None) -> Pass:
        """llama_decode the filled batch (a lane: through its shared context, maybe beside other
        lanes' rows up to cap rows in all, which keeps copies of this batch's rows)."""
        if self._lane is None:
            check_status(*llama_decode(self._ctx.ptr, self._batch.c), self.name, pos, n_tokens)
            return Pass(n_tokens)
        job = self._lane.shared.decode(self._batch, self._lane.cap(cap), self._lane.base)
        self._rows.copied = job.rows
        # the total also leaves out the other lanes' rows' share of the pass (shared._Job.for_others)
        self.t_waited_total += job.waited + job.for_others(n_tokens)
        check_status(job.status, job.why, self.name, pos, n_tokens)
        return Pass(job.n_rows, job.n_lanes, job.waited)

    @contextmanager
    def passing_turns(self, beside: Optional[Beside], n_piece: int = 0) -> Iterator[None]:
        """Within: its long decodes pass the turn to beside (other generations, or idle work's
        stop) between batches, in pieces of multiples of n_piece rows while others wait (0:
        whole chunks); None: no one. What was set before holds again after."""
        saved, self._beside = self._beside, None if beside is None else (beside, n_piece)
        try:
            yield
        finally:
            self._beside = saved

    def drafting(self, steps: Callable[..., T], *args: Any) -> T:
        """protocols.Drafter.drafting: on the decode thread with a context of its own; in a lane,
        here (a shared pass waits for other requests' threads, whose decodes need that thread)."""
        return steps(*args) if self._lane is not None else DECODER.run(steps, *args)

    @property
    def lane(self) -> Optional[Lane]:
        """Where it decodes in a shared context (None: a context of its own)."""
        return self._lane

    def logits(self, row: int) -> np.ndarray:
        """Zero-copy view of logit row `row` (0-based among the rows the last decode kept).

        The view is only valid until the next decode.
        """
        rows, ctx = self._rows, self._ctx.ptr  # ClosedError once the context is freed
        if not 0 <= row < rows.n:
            raise IndexError(f"logit row {row} was not requested by the last decode ({rows.n} rows)")
        if rows.pinned is not None:
            return rows.pinned
        index = rows.of[row] if rows.of is not None else rows.first + row
        if rows.copied is not None:
            return rows.copied[index]
        ptr = llama_cpp.llama_get_logits_ith(ctx, index)
        if not ptr:
            raise DecodeError(f"{self.name}: llama.cpp returned no logits for batch row {index}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def pin(self, row: np.ndarray) -> None:
        """Make row the last decode's only logit row (a prefill's kept row, the prompt asked again)."""
        self._rows.clear()
        self._rows.n, self._rows.pinned = 1, row

    # --- rolling back -------------------------------------------------------------------------

    def truncate(self, n_keep: int, path: Optional[Sequence[int]] = None) -> None:
        """Drop every cached token at position >= n_keep: the cache then holds cached[:n_keep].

        Where the memory cannot drop them (a recurrent state restored to an earlier
        checkpoint), the tokens from there to n_keep are decoded again. After decode_tree,
        path (nodes from the root's child down) is what is kept; n_keep cuts it.
        """
        self._settle(path)
        if n_keep >= len(self.cached):
            return
        kept = self.cached[:n_keep]
        t0 = time.perf_counter()
        try:
            self.discard(n_keep)
            if len(self.cached) < n_keep:
                replay = kept[len(self.cached):]
                self.decode(replay)
                self.n_replayed += len(replay)
        finally:
            self.t_rollback += time.perf_counter() - t0
        self._memory.revisit()

    def discard(self, n_keep: int) -> None:
        """Drop the cached tokens at position >= n_keep, and more where the memory cannot stop
        there without decoding again: afterwards cached is a prefix of cached[:n_keep]."""
        self._settle()
        if n_keep >= len(self.cached):
            return
        n_in_kv = len(self.cached) - self._n_pending
        if n_keep >= n_in_kv:  # only pending tokens go: the KV cache is as it was
            n_to = n_keep
            self._n_pending = n_keep - n_in_kv
        else:
            self._n_pending = 0
            n_to = self._memory.drop_to(n_keep)
        del self.cached[n_to:]
        if self.mtp_head is not None:
            self.mtp_head.truncate(n_to)
        self.n_canonical = min(self.n_canonical, n_to)
        if self.prefill_row is not None and n_to < self.prefill_row.n_tokens:
            self.prefill_row = None
        self._rows.clear()
        self._memory.revisit()

    def n_reachable(self, n_keep: int) -> int:
        """How many of the first n_keep cached tokens discard(n_keep) keeps."""
        self._settle()
        if n_keep >= len(self.cached):
            return len(self.cached)
        return self._memory.reachable(n_keep)

    # --- the session: prefill, sync, saved states ----------------------------------------------

    def prefill(self, tokens: Sequence[int], n_reuse: int, progress: Optional[Progress] = None) -> int:
        """session.prefill: the prompt in aligned chunks after n_reuse cached tokens; the reused count."""
        self._settle()
        return session.prefill(self, tokens, n_reuse, progress, fresh_bits=self._lane is None)

    def sync(self, tokens: Sequence[int]) -> None:
        """session.sync: the cache holds tokens, with logits for the last one."""
        self._settle()
        session.sync(self, tokens)

    def revisit(self) -> None:
        """Decoding may come back to this point: the next decode keeps a checkpoint."""
        self._memory.revisit()

    def save_state(self) -> SavedState:
        """A copy of this sequence's memory, to restore_state() later (llama_state_seq_get_data)."""
        self._settle()
        if self._n_pending:  # the state is the KV cache's: put the pending tokens in it first
            last = self.cached.pop()
            self._n_pending -= 1
            self.decode([last])
        return SavedState(list(self.cached), self.n_canonical, save_sequence(self._ctx, self.name, self._batch.base),
                          self.prefill_row)

    def restore_state(self, saved: SavedState) -> None:
        """Put a save_state() back: the cache then holds saved.tokens exactly as they were."""
        self._rows.clear()
        self._tree, self._n_pending = None, 0
        self._memory.forget()
        if self.mtp_head is not None:  # its entries were for the sequence replaced here
            self.mtp_head.truncate(0)
        try:
            restore_sequence(self._ctx, saved, self.name, self._batch.base)
        except BaseException:
            self._memory.remove(0, -1)
            self.cached, self.n_canonical, self.prefill_row = [], 0, None
            raise
        self.cached, self.n_canonical, self.prefill_row = list(saved.tokens), saved.n_canonical, saved.prefill_row


def open_runtime(model: Any, settings: ModelSettings, mtp: bool = False, n_branches: int = 1) -> Runtime:
    """A Runtime for a GGUF path or a borrowed llama_cpp.Llama."""
    if isinstance(model, llama_cpp.Llama):
        return Runtime.borrow(model)
    if isinstance(model, (str, os.PathLike)):
        return Runtime.load(model, settings, mtp=mtp, n_branches=n_branches)
    raise InvalidParameterError("model", model, "a .gguf path or a llama_cpp.Llama")
