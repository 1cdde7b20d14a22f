"""A sequence's memory copied out of a context and back (llama_state_seq_*), and the prefill's
kept last row: what the prompt cache saves and restores."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Optional

import llama_cpp
import numpy as np

from ..errors import DecodeError
from .handles import Handle


@dataclass(frozen=True)
class PrefillRow:
    """The logits of the last prompt token of a prefill, kept so that the same prompt asked
    again needs no decode at all; canonical: the prefill started on a canonical prefix, so
    the row is bit for bit a fresh prefill's."""

    n_tokens: int
    logits: np.ndarray
    canonical: bool


@dataclass
class SavedState:
    """One sequence's memory copied out of a context (llama_state_seq_get_data), with the tokens
    it holds, how many of them are canonical (see Runtime.n_canonical) and its PrefillRow."""

    tokens: list[int]
    n_canonical: int
    data: bytearray
    prefill_row: Optional[PrefillRow] = None
    scope: str = ""  # whose prompt it holds (prompt_cache.PromptCache.scope)

    @property
    def n_bytes(self) -> int:
        return len(self.data)


def save_sequence(ctx: Handle, name: str, seq: int = 0) -> bytearray:
    size = llama_cpp.llama_state_seq_get_size(ctx.ptr, seq)
    data = bytearray(size)
    n = llama_cpp.llama_state_seq_get_data(ctx.ptr, (ctypes.c_uint8 * size).from_buffer(data), size, seq)
    if n != size:
        raise DecodeError(f"{name}: llama.cpp copied {n} of the {size} bytes of the sequence state")
    return data


def restore_sequence(ctx: Handle, saved: SavedState, name: str, seq: int = 0) -> None:
    buf = (ctypes.c_uint8 * saved.n_bytes).from_buffer(saved.data)
    if not llama_cpp.llama_state_seq_set_data(ctx.ptr, buf, saved.n_bytes, seq):
        raise DecodeError(f"{name}: llama.cpp could not restore a saved sequence state of {len(saved.tokens)} tokens")
