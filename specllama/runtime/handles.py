"""The C handles a model needs: its weights, a context, a batch. Each is freed once, through the
ExitStack that owns it (a context before its model), and nulls its pointer when freed: using a
freed handle raises ClosedError instead of letting llama.cpp read freed memory."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Optional

import llama_cpp

from ..errors import ClosedError, InvalidModelFileError, InvalidParameterError
from .ggml import LOG_SINK
from .rpc import rpc_model_devices
from .settings import KV_CACHE_TYPES, N_RS_SEQ, ModelSettings

_FLASH_ATTN = {
    None: llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
    True: llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    False: llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


class Handle:
    """A C pointer until freed, then None; `ptr` raises ClosedError once it is gone."""

    def __init__(self, ptr: Any, free: Optional[Callable[[Any], None]], what: str, stack: Optional[ExitStack]):
        self._ptr, self._free_fn, self.what = ptr, free, what
        if stack is not None:
            stack.callback(self.free)

    @property
    def ptr(self) -> Any:
        if self._ptr is None:
            raise ClosedError(f"{self.what} was closed and its memory freed; specllama.load() it again")
        return self._ptr

    @property
    def alive(self) -> bool:
        return self._ptr is not None

    def view(self) -> "Handle":
        """The same pointer, freeing nothing: its owner (this handle) frees it, after the view's user."""
        return Handle(self.ptr, None, self.what, None)

    def free(self) -> None:
        ptr, self._ptr = self._ptr, None
        if ptr is not None and self._free_fn is not None:
            self._free_fn(ptr)


def load_model(path: Path, settings: ModelSettings, stack: ExitStack, mtp: bool = False) -> Handle:
    """The model's weights, with llama.cpp's progress callback stopping the load on Ctrl-C."""
    params = llama_cpp.llama_model_default_params()
    params.load_mtp = mtp  # the MTP (nextn) layers are skipped unless asked for
    params.n_gpu_layers = settings.n_gpu_layers  # -1: all layers, llama.cpp's own meaning
    keep: list[Any] = []  # arrays and callbacks llama.cpp reads while it loads
    if settings.rpc:
        # llama.cpp's default choice of devices leaves registered RPC workers out here, so
        # they are named: the workers first, as llama.cpp's --rpc orders them
        chosen = rpc_model_devices(settings.rpc)
        keep.append((ctypes.c_void_p * (len(chosen) + 1))(*chosen, None))
        params.devices = ctypes.cast(keep[-1], ctypes.c_void_p)
    if settings.tensor_split is not None:
        n_max = llama_cpp.llama_max_devices()
        if len(settings.tensor_split) > n_max:
            raise InvalidParameterError("tensor_split", settings.tensor_split, f"at most {n_max} shares")
        keep.append((ctypes.c_float * n_max)(*settings.tensor_split))
        params.tensor_split = keep[-1]
    params.load_mode = llama_cpp.LLAMA_LOAD_MODE_MMAP if settings.use_mmap else llama_cpp.LLAMA_LOAD_MODE_NONE
    progress = llama_cpp.llama_progress_callback(LOG_SINK.keep_loading)
    params.progress_callback = progress
    with LOG_SINK.deferring():
        ptr = llama_cpp.llama_model_load_from_file(str(path).encode("utf-8"), params)
    LOG_SINK.raise_interrupt()
    if not ptr:
        raise InvalidModelFileError(
            f"llama.cpp could not load {path}: the file is not a model this llama.cpp supports "
            "(run with verbose=True to see llama.cpp's reason)")
    handle = Handle(ptr, llama_cpp.llama_model_free, f"the model {path.name}", stack)
    handle.keep = keep  # type: ignore[attr-defined]  # lives as long as the model
    return handle


def new_context(model: Handle, settings: ModelSettings, stack: ExitStack, *, mtp: bool = False,
                n_seq: int = 1, name: str = "model") -> Handle:
    params = llama_cpp.llama_context_default_params()
    if mtp:  # a context that runs the model's MTP layers on the target's hidden states
        params.ctx_type = llama_cpp.LLAMA_CONTEXT_TYPE_MTP
    recurrent = llama_cpp.llama_model_is_recurrent(model.ptr) or llama_cpp.llama_model_is_hybrid(model.ptr)
    if n_seq > 1 and not recurrent and not mtp:
        # tree verify batches: one sequence per branch, all in one KV buffer (unified), so
        # each sequence has the whole context and a shared prefix is stored once
        params.n_seq_max, params.kv_unified = n_seq, True
    params.n_ctx = settings.n_ctx
    params.n_batch = settings.n_batch
    params.n_ubatch = settings.n_batch
    # llama.cpp's own default is 4 threads whatever the machine; 4 on 2 cores halves speed
    params.n_threads, params.n_threads_batch = settings.threads
    params.flash_attn_type = _FLASH_ATTN[settings.flash_attn]
    if settings.type_k is not None:
        params.type_k = KV_CACHE_TYPES[settings.type_k]
    if settings.type_v is not None:
        params.type_v = KV_CACHE_TYPES[settings.type_v]
    params.no_perf = True
    if recurrent and settings.rollback in (None, "n_rs_seq") and not mtp:
        params.n_rs_seq = N_RS_SEQ  # llama.cpp grants 0 to architectures without snapshots
    with LOG_SINK.deferring():
        ptr = llama_cpp.llama_init_from_model(model.ptr, params)
    LOG_SINK.raise_interrupt()
    if not ptr:
        raise InvalidParameterError(
            "model settings", settings, "settings llama.cpp can create a context with "
            "(a quantized V cache needs flash_attn; run with verbose=True for the reason)")
    return Handle(ptr, llama_cpp.llama_free, f"the context of {name}", stack)


class Batch:
    """A llama_batch of up to n_tokens tokens in up to n_seq sequences each."""

    def __init__(self, n_tokens: int, stack: ExitStack, n_seq: int = 1, n_embd: int = 0):
        self.c = llama_cpp.llama_batch_init(n_tokens, n_embd, n_seq)
        self._handle = Handle(self.c, llama_cpp.llama_batch_free, "a batch", stack)
        self.base = 0  # the context's id of sequence 0 (a lane of a shared context: its first)

    @property
    def alive(self) -> bool:
        return self._handle.alive

    def fill(self, tokens: Sequence[int], pos0: int, n_logits: int) -> None:
        """A chain in sequence 0 (base) at positions pos0.., logits for its last n_logits rows."""
        self._handle.ptr  # ClosedError once freed: never write into a freed batch
        c, n = self.c, len(tokens)
        for i, token in enumerate(tokens):
            c.token[i] = token
            c.pos[i] = pos0 + i
            c.n_seq_id[i] = 1
            c.seq_id[i][0] = self.base
            c.logits[i] = i >= n - n_logits
        c.n_tokens = n

    def fill_tree(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[Sequence[int]],
                  n_no_logits: int = 0) -> None:
        """A tree batch: token i at positions[i], in sequences seqs[i], logits kept for every
        row after the first n_no_logits."""
        self._handle.ptr  # ClosedError once freed
        c = self.c
        for i, (token, pos, seq_ids) in enumerate(zip(tokens, positions, seqs)):
            c.token[i], c.pos[i], c.n_seq_id[i], c.logits[i] = token, pos, len(seq_ids), i >= n_no_logits
            for j, seq in enumerate(seq_ids):
                c.seq_id[i][j] = self.base + seq
        c.n_tokens = len(tokens)

    def items(self) -> list[tuple[int, int, tuple[int, ...], bool]]:
        """(token, position, sequences, keeps logits) of each row filled."""
        c = self.c
        return [(c.token[i], c.pos[i], tuple(c.seq_id[i][j] for j in range(c.n_seq_id[i])), bool(c.logits[i]))
                for i in range(c.n_tokens)]

    def fill_items(self, items: Sequence[tuple[int, int, tuple[int, ...], bool]], offset: int) -> None:
        """Rows offset.. of the batch: items() of other batches (n_tokens set by the caller)."""
        self._handle.ptr  # ClosedError once freed
        c = self.c
        for i, (token, pos, seq_ids, keep) in enumerate(items, offset):
            c.token[i], c.pos[i], c.n_seq_id[i], c.logits[i] = token, pos, len(seq_ids), keep
            for j, seq in enumerate(seq_ids):
                c.seq_id[i][j] = seq
