"""What a sequence's session does over any model's decode/discard: prefill a prompt reusing a
cached prefix, and sync to a token sequence. Runtime and RemoteRuntime both call these."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import numpy as np

from .protocols import Progress
from .state import PrefillRow


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0])


def prefill(model: Any, tokens: Sequence[int], n_reuse: int, progress: Optional[Progress] = None,
            fresh_bits: bool = True) -> int:
    """Make the cache hold tokens, with logits for the last one, keeping its first n_reuse
    (which must be tokens[:n_reuse]) and computing the rest in aligned chunks.

    Started from a canonical prefix that ends on a chunk boundary, the result is canonical
    up to the last whole chunk: a later prompt that extends tokens reuses that bit for bit.
    n_reuse == len(tokens) takes the last row from prefill_row, which must be this prompt's.
    Returns the tokens reused: fewer than n_reuse where a recurrent memory could only go
    back to an earlier checkpoint. progress is told the cached count after each batch.
    fresh_bits: whether a decode here computes what a context of its own does; a lane of a
    shared context does not (other lanes' cells sit between its own: its rows differ), so what
    it prefills is never canonical, and a state saved from it never restores as exact.
    """
    tokens = list(tokens)
    if not 0 <= n_reuse <= len(tokens) or model.cached[:n_reuse] != tokens[:n_reuse]:
        raise ValueError(f"cannot reuse {n_reuse} cached tokens for a prompt of {len(tokens)}")
    if n_reuse == len(tokens):
        if model.prefill_row is None or model.prefill_row.n_tokens != len(tokens):
            raise ValueError("the whole prompt can be reused only with the row its own prefill kept")
        model.truncate(n_reuse)
        model.pin(model.prefill_row.logits)
        if progress is not None:
            progress(n_reuse)
        return n_reuse
    model.discard(n_reuse)  # a recurrent memory may have to start from an earlier checkpoint
    n_reuse = len(model.cached)
    if progress is not None:
        progress(n_reuse)  # where the prefill starts: what it reuses
    canonical_start = fresh_bits and n_reuse <= model.n_canonical and n_reuse % model.n_batch == 0
    model.decode(tokens[n_reuse:], n_logits=1, aligned=True, progress=progress)
    if canonical_start:
        model.n_canonical = len(tokens) // model.n_batch * model.n_batch
    model.prefill_row = PrefillRow(len(tokens), model.logits(0).copy(), canonical_start)
    return n_reuse


def sync(model: Any, tokens: Sequence[int]) -> None:
    """Make the cache hold tokens[:-1] + tokens[-1] with logits for the last one.

    Reuses the longest cached prefix and decodes only the rest (always at least one token).
    """
    n_common = common_prefix(model.cached, tokens)
    model.discard(min(n_common, len(tokens) - 1))  # what a checkpoint restore drops is decoded here
    model.revisit()  # a draft comes back here after drafting: keep a checkpoint
    model.decode(tokens[len(model.cached):], n_logits=1)
