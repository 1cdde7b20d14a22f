"""What the loop, the proposers and the prompt cache call on a model: declared, so every
implementation says what it provides (Runtime, RemoteRuntime, MtpHead)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Protocol, TypeVar, Union

import numpy as np

from ..decoding.tree import Tree
from .ggml import MemoryUse
from .settings import ModelSettings
from .state import PrefillRow, SavedState


class SlotUnavailable(Exception):
    """No second context can be made on this model (why, in words): sibling() raises it."""


T = TypeVar("T")

Progress = Callable[[int], None]
"""Told, after each batch of a prefill, how many of the prompt's tokens the cache holds now."""


@dataclass(frozen=True)
class Pass:
    """What a decode's last llama.cpp pass held and what the decode waited for: a lane's rows
    may ride in one pass with other lanes' (runtime/shared.py), and a round is priced from its
    pass (decode.py), not from its own rows alone."""

    n_rows: int  # rows in the pass that computed the decode's last rows, other lanes' included
    n_lanes: int = 1  # lanes whose rows were in that pass (1: a context of its own)
    t_waited: float = 0.0  # of the decode's time, seconds it waited for other lanes' rounds


class LaneLoad(Protocol):
    """A lane of a shared context as the loop plans a round on it (runtime/shared.py: Lane)."""

    def n_active(self) -> int: ...  # lanes generating in its shared context now, its own included

    def room(self, cap: int) -> int: ...  # of a pass of at most cap rows, the rows its next batch may plan for


class Beside(Protocol):
    """The other requests generating beside a long decode (slots.Pool), as it sees them."""

    def n_others(self) -> int: ...  # other generations running or waiting to

    def pass_turn(self) -> None: ...  # let those waiting for the models go first, then take them back


class Drafter(Protocol):
    """A draft: decodes one sequence, one or a few tokens at a time, and gives the last row.
    follows_target: fed by the target's own decodes (MTP heads), so nothing to prefill."""

    name: str
    identity: str
    n_ctx: int
    n_vocab: int  # token ids 0..n_vocab-1 it can read (within 128 of the target's: compat.py)
    memory_use: Optional[MemoryUse]
    follows_target: bool
    t_waited_total: float  # seconds its decodes spent on other lanes: waiting, their rows' share of shared passes

    @property
    def cached(self) -> list[int]: ...

    def sync(self, tokens: Sequence[int]) -> None: ...

    def decode(self, tokens: Sequence[int]) -> None: ...

    def logits(self, row: int) -> np.ndarray: ...

    def truncate(self, n_keep: int) -> None: ...

    @property
    def why_no_sibling(self) -> str: ...  # why sibling() cannot make a second context here ("" where it can)

    def sibling(self) -> "Drafter": ...  # another context on the same weights, for a request beside this one

    # within: its long decodes pass the turn to beside between batches, in pieces of n_piece rows
    def passing_turns(self, beside: Optional[Beside], n_piece: int = 0) -> AbstractContextManager[None]: ...

    # steps(*args), a round's draft steps, where its one-token decodes cost least: a Runtime with a
    # context of its own runs them on the decode thread (runtime/decoder.py), so no decode in them
    # hands a call to that thread and waits (25-44 us a step on our 2-core VM, the fastest of 150
    # runs of 16 steps either way). steps must not wait on another thread.
    def drafting(self, steps: Callable[..., T], *args: Any) -> T: ...

    def close(self) -> None: ...


class Vocabulary(Protocol):
    """A model's tokens and chat template."""

    name: str
    n_vocab: int

    def tokenize(self, text: Union[str, bytes], *, add_special: bool = True,
                 parse_special: bool = False) -> list[int]: ...

    def piece(self, token: int) -> bytes: ...

    def token_text(self, token: int) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...

    @property
    def vocab_type(self) -> int: ...

    @property
    def bos(self) -> int: ...

    @property
    def eos(self) -> int: ...

    @property
    def add_bos(self) -> bool: ...

    @property
    def add_eos(self) -> bool: ...

    def chat_template(self) -> Optional[str]: ...

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None) -> str: ...

    def grammar_tokenizer(self) -> Any: ...

    def fim_tokens(self) -> dict[str, int]: ...


class Model(Vocabulary, Protocol):
    """A target (or a draft with a prompt cache of its own): one sequence whose cached tokens
    it knows exactly, decoded in chains (and trees, where n_branches > 1), rolled back, prefilled
    on a cached prefix, saved and restored."""

    identity: str
    n_ctx: int
    n_batch: int
    memory: str  # "attention", "hybrid" or "recurrent"
    rollback: str  # memory.py's names
    n_branches: int
    memory_use: Optional[MemoryUse]
    n_replayed: int
    t_rollback: float
    n_canonical: int
    prefill_row: Optional[PrefillRow]
    mtp_head: Any
    follows_target: bool

    @property
    def cached(self) -> list[int]: ...

    @property
    def max_verify(self) -> int: ...

    @property
    def path(self) -> Optional[Path]: ...  # the GGUF file it was loaded from (None: a llama_cpp.Llama the caller built)

    @property
    def settings(self) -> Optional[ModelSettings]: ...  # what its context was made with (None: as above)

    @property
    def n_seq(self) -> int: ...  # sequences its context was made for

    @property
    def n_threads(self) -> int: ...  # the CPU threads llama.cpp decodes with

    @property
    def n_pending(self) -> int: ...

    # cap: for a lane, the most rows the pass holding these rows may have, other lanes' included
    # (None: the lane's own default, alone for a target); a context of its own ignores it
    def decode(self, tokens: Sequence[int], *, n_logits: int = 1, aligned: bool = False,
               progress: Optional[Progress] = None, cap: Optional[int] = None) -> Pass: ...

    def decode_tree(self, root: int, tokens: Sequence[int], tree: Tree, cap: Optional[int] = None) -> Pass: ...

    def logits(self, row: int) -> np.ndarray: ...

    def pin(self, row: np.ndarray) -> None: ...

    def truncate(self, n_keep: int, path: Optional[Sequence[int]] = None) -> None: ...

    def discard(self, n_keep: int) -> None: ...

    def n_reachable(self, n_keep: int) -> int: ...

    def revisit(self) -> None: ...

    def flush_pending(self) -> None: ...

    def pending_rows(self, n_max: int) -> int: ...

    def sync(self, tokens: Sequence[int]) -> None: ...

    def prefill(self, tokens: Sequence[int], n_reuse: int, progress: Optional[Progress] = None) -> int: ...

    def save_state(self) -> SavedState: ...

    def restore_state(self, saved: SavedState) -> None: ...

    @property
    def why_no_sibling(self) -> str: ...  # why sibling() cannot make a second context here ("" where it can)

    def sibling(self) -> "Model": ...  # another context on the same weights: SlotUnavailable where it cannot

    # within: its long decodes pass the turn to beside between batches, in pieces of n_piece rows
    def passing_turns(self, beside: Optional[Beside], n_piece: int = 0) -> AbstractContextManager[None]: ...

    def close(self) -> None: ...
