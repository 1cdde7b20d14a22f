"""Prompt caches: the KV state of earlier requests, reused so a call decodes only what is new.

Each runtime (target, draft) has a PromptCache: the live sequence in its context, plus saved
sequence states in RAM (llama_state_seq_*) of conversations it switched away from, all under
one byte budget shared by the caches of a SpecLlama and evicted least recently used first.
A prefill picks the source with the longest reusable prefix. With a folder on disk
(disk_cache.py), states also outlive the process: ones the RAM budget evicts, the live
sequences and RAM states at close(), and the prompt of a long cold prefill go there, and a
prefill looks there too.

What is reusable depends on what the caller promises. A canonical prefill reuses only a prefix
that a fresh prefill computes bit for bit: whole chunks of n_batch tokens aligned to position 0,
prefilled on a canonical prefix (Runtime.n_canonical), never generated tokens. Otherwise every
matching token is reused, and rows computed on that state may stray from a fresh run's by what
calibrate.reuse_diffs measures.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Protocol

from .disk_cache import DISK_MIN_PREFILL, DiskCache, Entry, Shelf
from ..errors import DecodeError
from ..runtime.protocols import Model, Progress
from ..runtime.session import common_prefix
from ..runtime.state import SavedState
from ..runtime.state_key import state_key

log = logging.getLogger("specllama")

MIN_SAVE = 64  # a live sequence is saved before it would lose at least this many tokens
# decoding up to this many tokens more is worth a state that is bit for bit a fresh prefill's
# (a prompt sharing a chat template's header with an unrelated one stays canonical, for later reuse)
EXACT_SLACK = 32


@dataclass(frozen=True)
class Reuse:
    """What one prefill reused: n_reused tokens from "live" (the context), "saved" (a state
    in RAM) or "none"; exact when the state is bit for bit a fresh prefill's."""

    n_reused: int
    source: str
    exact: bool


class KeptRow(Protocol):
    """What reuse asks of a kept prefill row (a PrefillRow, or a file's header on disk)."""

    @property
    def n_tokens(self) -> int: ...

    @property
    def canonical(self) -> bool: ...


def reusable(cached: Sequence[int], n_canonical: int, prefill_row: Optional[KeptRow], tokens: Sequence[int],
             canonical: bool, chunk: int, slack: Optional[int] = None) -> tuple[int, bool]:
    """(how many leading tokens of a state holding `cached` a prefill of `tokens` may keep,
    whether the state is then bit for bit a fresh prefill's).

    The whole prompt is kept only when the state's last prefill was of exactly this prompt
    (its last row was kept); otherwise at least one token is decoded. The exact reuse keeps
    whole aligned chunks of the canonical prefix; a canonical prefill takes nothing else, and
    any prefill takes it when the rest of the match is at most `slack` tokens.
    """
    n_common = common_prefix(cached, tokens)
    row = prefill_row
    if row is not None and row.n_tokens == len(tokens) == n_common and (row.canonical or not canonical):
        return len(tokens), row.canonical
    n = max(0, min(n_common, len(tokens) - 1))
    n_exact = min(n, n_canonical) // chunk * chunk
    if canonical or n - n_exact <= (EXACT_SLACK if slack is None else slack):
        return n_exact, True
    return n, False


class Budget:
    """The byte budget the prompt caches of one SpecLlama share; LRU across all of them."""

    def __init__(self, n_bytes: int):
        self.n_bytes = n_bytes
        self.entries: list[tuple[Any, SavedState]] = []  # (owning cache, state), oldest first
        self.n_evicted = 0
        self.evicted: list[tuple[Any, SavedState]] = []  # out of RAM since the owner last took them (to disk)

    @property
    def n_used(self) -> int:
        return sum(state.n_bytes for _, state in self.entries)

    def add(self, owner: Any, state: SavedState) -> bool:
        if state.n_bytes > self.n_bytes:
            return False
        self.entries.append((owner, state))
        while self.n_used > self.n_bytes:
            self.evicted.append(self.entries.pop(0))
            self.n_evicted += 1
        return True

    def remove(self, state: SavedState) -> None:
        self.entries = [(o, s) for o, s in self.entries if s is not state]

    def of(self, owner: Any) -> list[SavedState]:
        return [s for o, s in self.entries if o is owner]


class PromptCache:
    """The prompt cache of one model (a Runtime or RemoteRuntime)."""

    def __init__(self, runtime: Model, budget: Budget, owner: Optional["PromptCache"] = None):
        self.runtime = runtime
        self.budget = budget
        # whose saved states these are: the caches of one model's slots share theirs (a state
        # one context saved restores into another context of the same model)
        self.owner: PromptCache = owner if owner is not None else self
        self.shelf: Optional[Shelf] = None  # the owner's: this model's states on disk, if any
        self.n_hits = 0  # prefills that reused at least one token
        self.n_misses = 0
        self.n_reused = 0  # tokens reused, all prefills together
        self.n_saved = 0
        self.n_restored = 0
        self.n_from_disk = 0  # of n_restored, states read from disk
        self.n_reused_disk = 0  # of n_reused, tokens of states read from disk
        # whose prompt the live sequence holds: a prefill of another scope reuses none of it,
        # nor any saved state of another scope
        self.scope = ""

    @property
    def saved(self) -> list[SavedState]:
        return self.budget.of(self.owner)

    @property
    def disk(self) -> Optional[Shelf]:
        return self.owner.shelf

    def prefill(self, tokens: Sequence[int], canonical: bool, scope: str = "",
                progress: Optional[Progress] = None) -> Reuse:
        """Make the runtime hold tokens, with logits for the last one, reusing what it can.

        Args:
            tokens: the prompt (at least one token).
            canonical: reuse only what a fresh prefill computes bit for bit.
            scope: reuse only states prefilled in this scope (GenerateOptions.cache_scope).
            progress: told the tokens cached where the prefill starts and after each batch.
        """
        rt, chunk = self.runtime, self.runtime.n_batch
        best: Optional[SavedState] = None
        live = scope == self.scope  # the live sequence was prefilled in this scope: reusable
        n_live = min(common_prefix(rt.cached, tokens), len(tokens) - 1) if live else 0
        n_best, exact = reusable(rt.cached, rt.n_canonical, rt.prefill_row, tokens, canonical, chunk) \
            if live else (0, True)
        n_reach = rt.n_reachable(n_best)
        if n_reach < n_best:  # a recurrent memory goes back only to its checkpoint, or not at all
            n_all = n_live
            if not canonical and rt.n_reachable(n_all) == n_all:
                n_best, exact = n_all, False  # all it holds of the prompt, as computed
            else:  # exact reuse ends on a chunk boundary, so the rest is prefilled as fresh
                n_best = n_reach if not exact or n_reach % chunk == 0 else 0
        for state in self.saved:
            if state.scope == scope:
                n, state_exact = self._reusable(state.tokens, state.n_canonical, state.prefill_row, tokens, canonical)
                if n > n_best:
                    best, n_best, exact = state, n, state_exact
        on_disk = self._from_disk(tokens, canonical, scope, n_best)
        if on_disk is not None:
            best, n_best, exact = on_disk
        # what the live sequence would lose; worth keeping for a conversation that comes back
        if len(rt.cached) - n_live >= MIN_SAVE:
            self._save_live()
        source = "live" if n_best else "none"
        if best is not None:
            self.budget.remove(best)  # it becomes the live sequence; saved again when left
            try:
                rt.restore_state(best)
                self.n_restored += 1
                source = "saved"
                if on_disk is not None:
                    source, self.n_from_disk, self.n_reused_disk = "disk", self.n_from_disk + 1, \
                        self.n_reused_disk + n_best
            except DecodeError as e:  # the context is empty now: prefill from scratch
                log.warning("%s; prefilling the prompt instead", e)
                n_best, exact, source = 0, True, "none"
        self.scope = scope  # before the prefill: a failed one leaves no other scope's prompt reusable
        n_best = rt.prefill(tokens, n_best, progress)
        self.n_hits += n_best > 0
        self.n_misses += n_best == 0
        self.n_reused += n_best
        if self.disk is not None and len(tokens) - n_best >= max(DISK_MIN_PREFILL, n_best):
            self._snapshot(scope)
        return Reuse(n_best, source, exact)

    def _snapshot(self, scope: str) -> None:
        """A copy for the disk of a long prompt mostly seen for the first time (a chat's or an
        agent's system prompt), written in the background."""
        try:
            state = self.runtime.save_state()
            state.scope = scope
            self._spill(state)
        except DecodeError as e:  # an optimization: the request goes on without it
            log.warning("prompt cache: the prompt not kept on disk (%s)", e)

    def _reusable(self, cached: Sequence[int], n_canonical: int, row: Optional[KeptRow], tokens: Sequence[int],
                  canonical: bool) -> tuple[int, bool]:
        n, exact = reusable(cached, n_canonical, row, tokens, canonical, self.runtime.n_batch)
        if self.runtime.memory != "attention" and n < len(cached):
            n = 0  # a saved recurrent state holds its last position only
        return n, exact

    def _from_disk(self, tokens: Sequence[int], canonical: bool, scope: str,
                   n_better: int) -> Optional[tuple[SavedState, int, bool]]:
        """The state on disk that reuses more than n_better tokens of the prompt, read; the most first."""
        if self.disk is None:
            return None
        found: list[tuple[int, bool, Entry]] = []
        for entry in self.disk.entries():
            if entry.scope == scope and entry.n_tokens <= self.runtime.n_ctx:
                n, exact = self._reusable(entry.tokens, entry.n_canonical, entry.prefill_row, tokens, canonical)
                if n > n_better:
                    found.append((n, exact, entry))
        for n, exact, entry in sorted(found, key=lambda f: -f[0]):
            state = self.disk.disk.read(entry)
            if state is not None:
                return state, n, exact
        return None

    def stash(self) -> None:
        """Save the live sequence before something else takes the context (a measurement)."""
        if len(self.runtime.cached) >= MIN_SAVE:
            self._save_live()

    def persist(self) -> None:
        """At close: the live sequence and this model's saved states to disk (if it has a folder)."""
        if self.disk is None:
            return
        if len(self.runtime.cached) >= MIN_SAVE:
            state = self.runtime.save_state()
            state.scope = self.scope
            self._spill(state)
        if self.owner is self:
            for state in self.saved:
                self._spill(state)

    def _save_live(self) -> None:
        rt = self.runtime
        # states this one extends hold nothing it does not
        for state in self.saved:
            if state.scope == self.scope and rt.cached[:len(state.tokens)] == state.tokens \
                    and state.n_canonical <= rt.n_canonical:
                self.budget.remove(state)
        if self.budget.n_bytes <= 0 and self.disk is None:
            return
        state = rt.save_state()
        state.scope = self.scope
        if self.budget.add(self.owner, state):
            self.n_saved += 1
        elif self.disk is not None:
            self._spill(state)  # too big for RAM: only on disk
        else:
            log.info("%s: a sequence state of %.0f MiB is over the prompt cache's budget of %.0f MiB; not kept",
                     rt.name, state.n_bytes / 2**20, self.budget.n_bytes / 2**20)
        evicted, self.budget.evicted = self.budget.evicted, []
        for owner, old in evicted:  # out of RAM: kept on disk, where the model has a folder
            if isinstance(owner, PromptCache):
                owner._spill(old)

    def _spill(self, state: SavedState) -> None:
        if self.disk is not None:
            self.disk.put(state)

    def as_dict(self, *slots: "PromptCache") -> dict:
        """The counters, with those of the given caches of other slots of this model added (the
        saved states are one model's, shared by its slots)."""
        caches = (self, *slots)
        return {"hits": sum(c.n_hits for c in caches), "misses": sum(c.n_misses for c in caches),
                "tokens_reused": sum(c.n_reused for c in caches), "saved": sum(c.n_saved for c in caches),
                "restored": sum(c.n_restored for c in caches), "states": len(self.saved),
                "bytes": sum(s.n_bytes for s in self.saved),
                "restored_from_disk": sum(c.n_from_disk for c in caches),
                "tokens_reused_from_disk": sum(c.n_reused_disk for c in caches)}


def open_disk(folder: Optional[Any], n_mb: float, *caches: Optional[PromptCache]) -> Optional[DiskCache]:
    """The folder of states on disk for these models' caches (None: no folder asked for).

    Each model's states are keyed by what decides their bits (runtime.state_key); the first
    use of a model file reads it once to hash it."""
    if folder is None:
        return None
    disk = DiskCache(folder, n_mb)
    for cache in caches:
        if cache is None:
            continue
        t0 = time.perf_counter()
        key, why = state_key(cache.runtime, disk.folder)
        if key is None:
            log.info("%s: its prompt states stay in RAM: %s", cache.runtime.name, why)
            continue
        if time.perf_counter() - t0 > 1:
            log.info("%s: hashed for the prompt cache on disk in %.1f s (once per file)", cache.runtime.name,
                     time.perf_counter() - t0)
        cache.shelf = Shelf(disk, key, cache.runtime.name)
    return disk


def close_caches(caches: Sequence[PromptCache], budget: Budget, disk: Optional[DiskCache]) -> None:
    """At close: every live sequence and RAM state of these caches to disk (where there is a
    folder), written before it returns; then the RAM states are dropped."""
    if disk is None:
        budget.entries.clear()
        return
    t0 = time.perf_counter()
    for cache in caches:
        try:
            cache.persist()
        except Exception as e:  # a lost RPC host, a context llama.cpp cannot copy: close() still frees all
            log.warning("prompt cache: %s's conversation not kept on disk (%s)", cache.runtime.name, e)
    disk.flush()
    disk.close()
    budget.entries.clear()
    if disk.counters.n_written:
        n = disk.counters.n_written
        log.info("prompt cache: %d state%s written to %s (%.0f MiB; the last at close took %.1f s)", n,
                 "s" * (n != 1), disk.folder, disk.counters.n_bytes_written / 2**20, time.perf_counter() - t0)


def cache_report(budget: Budget, target: Sequence[PromptCache], draft: Sequence[PromptCache],
                 disk: Optional[DiskCache]) -> dict:
    """SpecLlama.prompt_cache_info: the caches of every slot (the first's first), by model."""
    out = {"budget_bytes": budget.n_bytes, "evicted": budget.n_evicted, "slots": len(target),
           "target": target[0].as_dict(*target[1:])}
    if draft:
        out["draft"] = draft[0].as_dict(*draft[1:])
    if disk is not None:
        out["disk"] = disk.as_dict()
    return out
