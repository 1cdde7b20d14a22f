"""What the loop, the proposers and the prompt cache call on a model: declared, so every
implementation says what it provides (Runtime, RemoteRuntime, MtpHead)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional, Protocol, Union

import numpy as np

from ..tree import Tree
from .ggml import MemoryUse
from .settings import ModelSettings
from .state import PrefillRow, SavedState


class SlotUnavailable(Exception):
    """No second context can be made on this model (why, in words): sibling() raises it."""


Progress = Callable[[int], None]
"""Told, after each batch of a prefill, how many of the prompt's tokens the cache holds now."""


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
    batch_cap: int  # a lane: the most rows the pass computing its next rows may have
    n_batch_rows: int  # rows in the pass that computed the last decode's rows
    n_batch_lanes: int  # lanes whose rows were in that pass (1: a context of its own)
    t_waited: float  # of the last decode's time, what it waited for other lanes' rounds

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
    def n_lanes_active(self) -> int: ...  # lanes generating in its shared context now (1: its own)

    @property
    def n_room(self) -> int: ...  # of batch_cap, the rows its next batch may plan for (a lane: its share)

    @property
    def n_threads(self) -> int: ...  # the CPU threads llama.cpp decodes with

    @property
    def n_pending(self) -> int: ...

    def decode(self, tokens: Sequence[int], *, n_logits: int = 1, aligned: bool = False,
               progress: Optional[Progress] = None) -> None: ...

    def decode_tree(self, root: int, tokens: Sequence[int], tree: Tree) -> None: ...

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

    def close(self) -> None: ...
