"""How rejected tokens leave a model's memory: the three rollbacks behind one interface.

    seq_rm      an attention KV cache: drop the positions
    n_rs_seq    a recurrent state with llama.cpp's per-token snapshots of the last batch: roll
                back 1..n_rs_seq of them right after it, never its first token; anything else
                goes back to the checkpoint taken before the batch
    checkpoint  a recurrent state copied before a batch (PARTIAL_ONLY, kept in the backend's
                buffers), restored; the caller decodes the accepted tokens again

The runtime tells its Memory when it decodes and when it may come back to a point; the memory
says how far back it can go and goes there.
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional

import llama_cpp

from ..errors import DecodeError, InvalidParameterError
from .handles import Handle

_PARTIAL = llama_cpp.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
# checkpoints stay in the backend's own buffers (one per sequence, kept by the context): on a
# GPU a host round trip of the state can cost more than speculation saves (llama.cpp #28118);
# the host gets a few bytes of bookkeeping. Same bits as a host copy (tests/test_hybrid.py).
_CHECKPOINT = _PARTIAL | llama_cpp.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE


class Memory:
    """An attention KV cache (seq_rm): any position can be dropped, for free."""

    rollback = "seq_rm"

    def __init__(self, ctx: Handle, name: str, base: int = 0, n_own: int = 0):
        self.ctx, self.name = ctx, name
        # a lane of a shared context (n_own > 0) owns its sequences base..base+n_own-1 only;
        # callers number them from 0 as in a context of their own
        self.base, self.n_own = base, n_own

    @property
    def _mem(self) -> Any:
        return llama_cpp.llama_get_memory(self.ctx.ptr)  # ClosedError once the context is freed

    def remove(self, seq: int, start: int, end: int = -1) -> bool:
        """llama_memory_seq_rm; False where the memory cannot drop that range."""
        return bool(llama_cpp.llama_memory_seq_rm(self._mem, self.base + seq, start, end))

    def copy(self, src: int, dst: int) -> None:
        """Give sequence dst every cell of sequence src (tree branches share the cached prefix)."""
        llama_cpp.llama_memory_seq_cp(self._mem, self.base + src, self.base + dst, -1, -1)

    def clear(self) -> None:
        if self.n_own:  # the other lanes' sequences stay
            for seq in range(self.n_own):
                self.remove(seq, -1)
        else:
            llama_cpp.llama_memory_clear(self._mem, True)
        self.forget()

    def before_decode(self, n_past: int, n_tokens: int) -> None:
        """A batch of n_tokens is about to be appended at n_past."""

    def after_decode(self, start: int, end: int) -> None:
        """The last llama_decode call appended positions start..end-1."""

    def revisit(self) -> None:
        """Decoding may come back to the current position (a sync, a rollback)."""

    def forget(self) -> None:
        """The sequence was replaced (a restored state): nothing taken before it holds."""

    def reachable(self, n_keep: int) -> int:
        """How many of the first n_keep positions dropping the rest keeps."""
        return n_keep

    def drop_to(self, n_keep: int) -> int:
        """Drop every position from reachable(n_keep) on; that number (0: started over)."""
        if self.remove(0, n_keep):
            return n_keep
        self.remove(0, -1)  # it could not stop there: start over
        return 0

    def max_verify(self, n_batch: int) -> int:
        """The largest batch whose tokens can all be rolled back but the first."""
        return n_batch

    @property
    def checkpoint_bytes(self) -> int:
        return 0


class Checkpoints(Memory):
    """A recurrent state copied before each batch that may be rolled back, restored on demand."""

    rollback = "checkpoint"

    def __init__(self, ctx: Handle, name: str):
        super().__init__(ctx, name)
        self._checkpoint: Optional[tuple[int, bytearray]] = None  # (position, the state there)
        # a rollback or sync since the last decode: the next decode keeps a checkpoint (as does
        # any batch of more than one token), since decoding may come back to that point
        self._revisit = True

    def before_decode(self, n_past: int, n_tokens: int) -> None:
        if self._revisit or n_tokens > 1:
            self._save(n_past)
        self._revisit = False

    def revisit(self) -> None:
        self._revisit = True

    def forget(self) -> None:
        self._checkpoint, self._revisit = None, True

    def _way_back(self, n_keep: int) -> Optional[str]:
        if self._checkpoint is not None and self._checkpoint[0] <= n_keep:
            return "checkpoint"
        return None

    def reachable(self, n_keep: int) -> int:
        way = self._way_back(n_keep)
        if way == "snapshot":
            return n_keep
        return self._checkpoint[0] if way == "checkpoint" and self._checkpoint is not None else 0

    def drop_to(self, n_keep: int) -> int:
        way = self._way_back(n_keep)
        if way == "snapshot" and self.remove(0, n_keep):
            n_to = n_keep
        elif way == "checkpoint" and self._checkpoint is not None and self._restore(*self._checkpoint):
            n_to = self._checkpoint[0]
        else:  # nothing to go back to: start over
            self.remove(0, -1)
            self._checkpoint, n_to = None, 0
        if self._checkpoint is not None and self._checkpoint[0] > n_to:
            self._checkpoint = None
        self._revisit = True
        return n_to

    def _save(self, n_at: int) -> None:
        """Copy the recurrent state at n_at, unless the checkpoint already holds it."""
        if self._checkpoint is not None and self._checkpoint[0] == n_at:
            return
        size = llama_cpp.llama_state_seq_get_size_ext(self.ctx.ptr, 0, _CHECKPOINT)
        data = self._checkpoint[1] if self._checkpoint is not None and len(self._checkpoint[1]) == size \
            else bytearray(size)
        self._checkpoint = None
        buf = (ctypes.c_uint8 * size).from_buffer(data)
        if llama_cpp.llama_state_seq_get_data_ext(self.ctx.ptr, buf, size, 0, _CHECKPOINT) != size:
            raise DecodeError(f"{self.name}: llama.cpp could not copy the recurrent state at {n_at} tokens")
        self._checkpoint = (n_at, data)

    def _restore(self, n_at: int, data: bytearray) -> bool:
        """Its recurrent state first, then the KV cache after it."""
        buf = (ctypes.c_uint8 * len(data)).from_buffer(data)
        return bool(llama_cpp.llama_state_seq_set_data_ext(self.ctx.ptr, buf, len(data), 0, _CHECKPOINT)) \
            and self.remove(0, n_at)

    @property
    def checkpoint_bytes(self) -> int:
        return int(llama_cpp.llama_state_seq_get_size_ext(self.ctx.ptr, 0, _PARTIAL))


class Snapshots(Checkpoints):
    """llama.cpp's n_rs_seq snapshots of the last batch, with a checkpoint before it for the rest."""

    rollback = "n_rs_seq"

    def __init__(self, ctx: Handle, name: str, n_rs_seq: int):
        super().__init__(ctx, name)
        self.n_rs_seq = n_rs_seq
        self._window: Optional[tuple[int, int]] = None  # the last batch's positions, until used

    def before_decode(self, n_past: int, n_tokens: int) -> None:
        super().before_decode(n_past, n_tokens)
        self._window = None

    def after_decode(self, start: int, end: int) -> None:
        self._window = (start, end)

    def forget(self) -> None:
        super().forget()
        self._window = None

    def _way_back(self, n_keep: int) -> Optional[str]:
        if self._window is not None:
            # snapshots exist for the last batch only, once, and never for the state before it
            start, end = self._window
            if start < n_keep < end and end - n_keep <= self.n_rs_seq:
                return "snapshot"
        return super()._way_back(n_keep)

    def drop_to(self, n_keep: int) -> int:
        n_to = super().drop_to(n_keep)
        self._window = None
        return n_to

    def max_verify(self, n_batch: int) -> int:
        return min(n_batch, self.n_rs_seq + 1)


def memory_of(ctx: Handle, model: Handle, name: str, requested: Optional[str],
              lane: tuple[int, int] = (0, 0)) -> tuple[str, Memory]:
    """(memory type: "attention", "hybrid" or "recurrent", its Memory) for a new context, or
    for a lane (base, n_own) of a shared one (attention memory only: shared.py)."""
    if llama_cpp.llama_model_is_hybrid(model.ptr):
        kind = "hybrid"
    elif llama_cpp.llama_model_is_recurrent(model.ptr):
        kind = "recurrent"
    else:
        return "attention", Memory(ctx, name, *lane)
    granted = int(llama_cpp.llama_n_rs_seq(ctx.ptr))  # recurrent-state snapshots per token granted
    if requested == "seq_rm":
        raise InvalidParameterError("rollback", requested, f"n_rs_seq, checkpoint or None for {name}: its {kind} "
                                    "memory keeps no state per position, so seq_rm cannot drop tokens from it")
    if requested == "n_rs_seq" and not granted:
        raise InvalidParameterError("rollback", requested, f"checkpoint or None for {name}: llama.cpp keeps no "
                                    "per-token snapshots for this architecture")
    if (requested or ("n_rs_seq" if granted else "checkpoint")) == "n_rs_seq":
        return kind, Snapshots(ctx, name, granted)
    return kind, Checkpoints(ctx, name)
