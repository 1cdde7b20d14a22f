"""A tree of candidates decoded in one pass, and the one path of it the cache keeps afterwards."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional


from ..errors import ContextFullError
from ..decoding.tree import Tree
from .batches import TreeBatch, kv_length
from .protocols import Pass


@dataclass(frozen=True)
class TreeDecode:
    """A decoded tree, until one path of it is kept: where its root sits and its shape."""

    n_root: int
    tree: Tree
    n_seqs: int


class TreeDecoding:
    """Runtime's tree decoding: each branch a sequence of its own in one batch (one KV buffer),
    then one path kept, its tokens off the main branch pending in front of the next batch."""

    # the Runtime's own
    name: str
    n_ctx: int
    n_batch: int
    n_branches: int
    cached: list[int]
    _n_pending: int
    _tree: Optional[TreeDecode]
    _rows: Any
    _memory: Any
    _batch: Any

    _pass: Callable[[int, int, Optional[int]], Pass]
    decode: Callable[..., Pass]

    def decode_tree(self, root: int, tokens: Sequence[int], tree: Tree, cap: Optional[int] = None) -> Pass:
        """Decode root (after the cache) and a tree of tokens after it in one pass, keeping every
        row's logits: logits(0) is root's, logits(i + 1) tokens[i]'s. Until truncate() keeps one
        path, cached holds root and the tokens in tree order. What the pass held comes back (cap:
        as Runtime.decode's)."""
        self._settle()
        if len(tokens) != len(tree):
            raise ValueError(f"{len(tokens)} tokens for a tree of {len(tree)} nodes")
        layout = TreeBatch.of(tree)
        n = len(tokens) + 1
        pending = self.cached[len(self.cached) - self._n_pending:]  # kept from an earlier tree: the trunk
        n_pre, n_kv = len(pending), len(self.cached) - self._n_pending
        if layout.n_seqs > self.n_branches or n_pre + n > self.n_batch:
            raise ValueError(f"a tree of {n} tokens and {layout.n_seqs} branches exceeds this context's "
                             f"{self.n_branches} branches or batch of {self.n_batch}")
        if n_kv + n_pre + n > self.n_ctx:
            raise ContextFullError(f"{self.name}: {len(self.cached)} cached + a tree of {n} tokens exceed the "
                                   f"context of {self.n_ctx} tokens; raise n_ctx or shorten the prompt")
        self._rows.clear()
        for seq in range(1, layout.n_seqs):  # each branch sees the cached prefix
            self._memory.copy(0, seq)
        every = list(range(layout.n_seqs))
        n_root = n_kv + n_pre
        self._batch.fill_tree([*pending, root, *(tokens[i] for i in layout.order)],
                              [*range(n_kv, n_root + 1), *(n_root + tree.depth[i] for i in layout.order)],
                              [*([every] * (n_pre + 1)), *(layout.seqs[i] for i in layout.order)], n_pre)
        try:
            done = self._pass(n_kv, n_pre + n, cap)
        except BaseException:
            for seq in range(1, layout.n_seqs):
                self._memory.remove(seq, -1)
            self._memory.remove(0, n_kv)
            del self.cached[n_kv:]  # the pending tokens too: as discard() would
            self._n_pending = 0
            raise
        self.cached.extend([root, *tokens])
        self._n_pending = 0
        self._tree = TreeDecode(n_root, tree, layout.n_seqs)
        self._rows.n, self._rows.of = n, layout.rows(n_pre)
        return done

    def _settle(self, path: Optional[Sequence[int]] = None) -> None:
        """After a tree decode, keep the root and one path of nodes (None: the main branch) as
        what the cache holds. The KV cache keeps the part on the main branch; the tokens after
        it that left the branch are kept pending, decoded in front of the next batch (a few rows
        more in it, in order like any chain)."""
        if self._tree is None:
            return
        decoded = self._tree
        path = decoded.tree.main_branch if path is None else list(path)
        if not decoded.tree.is_path(path):
            raise ValueError(f"{list(path)} is not a path from the tree's root")  # the tree stays as it was
        self._tree = None
        self._rows.clear()
        for seq in range(1, decoded.n_seqs):
            self._memory.remove(seq, -1)
        main = set(decoded.tree.main_branch)
        n_on_main = next((k for k, node in enumerate(path) if node not in main), len(path))
        nodes = self.cached[decoded.n_root + 1:]
        self.cached[decoded.n_root + 1:] = [nodes[i] for i in path]
        self._memory.remove(0, decoded.n_root + 1 + n_on_main)
        self._n_pending = len(path) - n_on_main

    def pending_rows(self, n_max: int) -> int:
        """Rows the next batch gives to tokens a tree round kept off its main branch (they go in
        front of it). Where they would make the batch n_max rows or more, or start it below a KV
        padding step (its rows would attend over another KV length than their single-token
        counterparts), they are decoded one at a time first, and none are left: 0."""
        n, n_past = self._n_pending, len(self.cached) - 1
        if n and (n >= n_max or kv_length(n_past - n + 1, self.n_ctx) != kv_length(n_past + 1, self.n_ctx)):
            self.flush_pending()
            return 0
        return n

    def flush_pending(self) -> None:
        """Decode the pending tokens one at a time (rows bitwise a single token's)."""
        self._settle()
        pending = self.cached[len(self.cached) - self._n_pending:]
        del self.cached[len(self.cached) - self._n_pending:]
        self._n_pending = 0
        for token in pending:
            self.decode([token])
