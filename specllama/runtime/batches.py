"""How tokens go into llama.cpp batches: prefill chunks, and a tree as one multi-sequence batch.

Pure functions (no llama.cpp), tested directly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ..decoding.tree import Tree

if TYPE_CHECKING:
    from .protocols import Beside

KV_PAD = 256  # llama.cpp pads the KV length it attends over to a multiple of 256 (get_n_kv)
# a prefill beside other requests' rounds goes in pieces of multiples of this many rows: on our
# 2-core x86 CPUs (F16 and Q4_K_M Qwen2.5-Coder, Gemma 3, SmolLM2; KV lengths up to 3,100) rows
# of 64-row batches and up are bitwise those of a whole 512-token chunk, and of 32-row ones not
# (0.04-1.9 logits); where it holds is measured per model (concurrency_probes.py)
N_PIECE = 64
# a piece takes about this long (64 rows take more on our CPUs: 0.6 s on the F16 1.5B), so a
# stream beside a long prefill waits about that and one round of its own between its tokens
PIECE_SECONDS = 0.5


class Interrupted(Exception):
    """Raised by a decode's passing_turns beside (its pass_turn) to end the decode between two of its batches
    (idle work a request wants the models from): unlike any other failure, the batches decoded
    before it stay in the cache, so the work goes on from there later."""


def kv_length(n_cells: int, n_ctx: int) -> int:
    """The padded KV length llama.cpp attends over when n_cells cells are in use."""
    return min(n_ctx, max(KV_PAD, -(-n_cells // KV_PAD) * KV_PAD))


def chunk_bounds(n_past: int, n_tokens: int, n_batch: int, aligned: bool) -> list[tuple[int, int]]:
    """(start, end) of each chunk of n_tokens tokens appended at position n_past, as offsets into
    them; aligned chunks end at multiples of n_batch counted from position 0."""
    bounds, start = [], 0
    while start < n_tokens:
        room = n_batch - (n_past + start) % n_batch if aligned else n_batch
        end = min(n_tokens, start + room)
        bounds.append((start, end))
        start = end
    return bounds


def piece_end(at: int, chunk_end: int, n_want: int, n_piece: int) -> int:
    """Where a piece of a prefill chunk that starts at `at` ends: about n_want rows, cut at a
    multiple of n_piece rows past `at`, the rest of the chunk where under n_piece would be left.
    Starting from the chunk's start, every piece but the last of a chunk holds a multiple of
    n_piece rows and the last holds at least n_piece (or the whole chunk): the shapes whose rows
    calibrate's piece probe compares with the whole chunk's. n_piece 0: the whole chunk."""
    if n_piece <= 0:
        return chunk_end
    end = at + max(1, n_want // n_piece) * n_piece
    return chunk_end if chunk_end - end < n_piece else end


def next_batch_end(beside: Optional[tuple["Beside", int]], start: int, chunk_end: int, n_logits: int,
                   t_row: float) -> int:
    """Where a decode's next batch from start (in a chunk ending at chunk_end) ends, where it
    passes the turn to beside between batches (Runtime.passing_turns: who, and n_piece). Past
    the first batch, the others go first; while others generate, a piece of multiples of
    n_piece rows taking about PIECE_SECONDS (t_row: the last batch's seconds a row), so a long
    prefill holds them up a piece at a time, not a chunk: the same rows either way."""
    if beside is None:
        return chunk_end
    others, n_piece = beside
    if start:
        others.pass_turn()
    n_piece = n_piece if n_logits <= n_piece and others.n_others() else 0
    return piece_end(start, chunk_end, int(PIECE_SECONDS / t_row) if t_row else 0, n_piece)


@dataclass(frozen=True)
class TreeBatch:
    """A tree of nodes 0..n-1 after a root (batch rows: the pending tokens, the root, then the
    nodes in `order`). Each branch (root to leaf) is a sequence of its own and a node is in every
    sequence through it, so a shared prefix is computed once and no branch sees another.

    The main branch (first children, sequence 0) comes first in the batch, so its cells precede
    every other branch's: whatever is dropped afterwards, the cells kept stay in position order,
    as a chain's are, and later tokens fill the cells right after them (attention sums over
    cells in cell order)."""

    order: list[int]  # the nodes in batch order after the root
    seqs: list[list[int]]  # per node, the sequences it is in
    n_seqs: int

    @classmethod
    def of(cls, tree: Tree) -> "TreeBatch":
        main = tree.main_branch
        on_main = set(main)
        order = main + [i for i in range(len(tree)) if i not in on_main]
        leaves = [i for i in order if i not in tree.children]  # sequence k: the k-th leaf
        seqs: list[list[int]] = [[] for _ in range(len(tree))]
        for seq, leaf in enumerate(leaves or [-1]):
            node = leaf
            while node != -1:
                seqs[node].append(seq)
                node = tree.parents[node]
        return cls(order, seqs, max(1, len(leaves)))

    def rows(self, n_pending: int) -> list[int]:
        """The batch row of the root (index 0) and of each node (index i + 1)."""
        out = [n_pending] + [0] * len(self.order)
        for index, node in enumerate(self.order):
            out[node + 1] = n_pending + 1 + index
        return out
