"""Acceptance and timing accounting for one generation."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from .tree import Tree


@dataclass
class Stats:
    """Counters and timings of one generation; times are seconds of wall clock."""

    n_prompt: int = 0
    n_draft_max: int = 0  # the most tokens a round could draft (after the exact-mode cap)
    n_plain_rounds: int = 0  # rounds that drafted nothing (the controller found no gain)
    n_lookup_rounds: int = 0  # rounds whose drafts came from prompt lookup
    n_grammar_rounds: int = 0  # rounds that began with tokens a grammar forces
    n_forced_accepted: int = 0  # of those tokens, the ones the target accepted
    n_constrained_rows: int = 0  # target and draft rows shaped by a constraint
    t_constraint: float = 0.0  # shaping them and advancing the grammar (inside t_draft and t_verify)
    n_generated: int = 0
    n_rounds: int = 0  # target verify passes after the prompt (plain decoding: one per token)
    n_drafted: int = 0  # tokens verified beside the newest one (a tree's every node)
    n_accepted: int = 0
    n_tree_rounds: int = 0  # rounds that verified a tree (candidates beside the draft's chain)
    n_branch_accepted: int = 0  # accepted tokens that were not the draft's own first choice
    accepted_at: list[int] = field(default_factory=list)  # [i]: drafts accepted at position i
    drafted_at: list[int] = field(default_factory=list)  # [i]: rounds that drafted position i
    # fidelity: the level, the verify-size limit rounds met per KV length, and near-ties:
    # generated positions whose verify row had its top two logits within twice the measured
    # batch difference (greedy only; None where nothing was measured, e.g. level "off")
    fidelity: str = ""
    verify_limits: dict[str, int] = field(default_factory=dict)
    # measurements this generation went without (decoding plainly where they matter, or not
    # judging near-ties); they run when the process is idle, or with SpecLlama.warm_up()
    measurements_pending: list[str] = field(default_factory=list)
    near_ties: Optional[int] = 0
    near_tie_positions: list[int] = field(default_factory=list)
    # the prompt cache: prompt tokens whose KV was reused rather than decoded, where from
    # ("live" context, "saved" state in RAM, "none"), and whether that state is bit for bit
    # what a fresh prefill computes (false: rows carry the measured reuse difference)
    n_prompt_cached: int = 0
    n_draft_prompt_cached: int = 0
    prompt_cache: str = "none"  # where the reused state came from: "live", "saved" (RAM), "disk" or "none"
    prompt_cache_exact: bool = True
    t_prefill: float = 0.0  # the target's prefill of what was not cached, and the first token
    t_draft_prefill: float = 0.0  # the draft's, after the first token
    t_draft: float = 0.0
    t_verify: float = 0.0
    # rolling the target back after each pass (a recurrent state restored and its accepted
    # tokens decoded again, n_replayed of them; next to nothing for a KV cache)
    t_rollback: float = 0.0
    n_replayed: int = 0
    rollback: str = ""  # how the target's memory drops rejected tokens (runtime.ROLLBACKS)
    draft_source: str = ""  # "model" (a second GGUF), "mtp" (the target's own MTP layers) or none
    slot: int = 0  # the slot (contexts of its own) the request decoded in: 0, or another beside it
    t_total: float = 0.0
    # what the draft controller decided from: its cost estimates and acceptance at the end
    controller: dict = field(default_factory=dict)
    # where those figures came from: the cache, this process's measurements, this request's
    # rounds, or assumptions (Planner.sources)
    sources: dict = field(default_factory=dict)
    # memory measured when each model loaded (RAM + GPU; 0 when not measured, e.g. borrowed),
    # and this process's resident memory when the generation ended
    n_bytes_target: int = 0
    n_bytes_draft: int = 0
    n_bytes_resident: int = 0

    def record_round(self, n_drafted: int, n_accepted: int, source: str = "draft", n_forced: int = 0) -> None:
        """A round that proposed n_drafted tokens (the first n_forced forced by a grammar)."""
        self.n_rounds += 1
        self.n_plain_rounds += n_drafted == 0
        self.n_lookup_rounds += n_drafted > n_forced and source == "lookup"
        if n_forced:
            self.n_grammar_rounds += 1
            self.n_forced_accepted += min(n_forced, n_accepted)
        self.n_drafted += n_drafted
        self.n_accepted += n_accepted
        for counts, n in ((self.drafted_at, n_drafted), (self.accepted_at, n_accepted)):
            if len(counts) < n:
                counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    def record_tree(self, tree: Tree, path: list[int]) -> None:
        """A tree round whose accepted path was path (node indices)."""
        self.n_tree_rounds += 1
        self.n_branch_accepted += sum(i not in tree.first_children for i in path)

    @property
    def acceptance_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return (self.n_accepted + self.n_rounds) / self.n_rounds if self.n_rounds else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def draft_memory_share(self) -> float:
        """The draft's part of the memory both models took when they loaded."""
        both = self.n_bytes_target + self.n_bytes_draft
        return self.n_bytes_draft / both if both else 0.0

    @property
    def t_decode(self) -> float:
        return self.t_total - self.t_prefill - self.t_draft_prefill

    @property
    def t_other(self) -> float:
        return max(0.0, self.t_decode - self.t_draft - self.t_verify - self.t_rollback)

    @property
    def decode_tokens_per_second(self) -> float:
        # the first token comes from the prefill, so the decode phase produced the rest
        n = self.n_generated - 1
        return n / self.t_decode if n > 0 and self.t_decode > 0 else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        for name in ("acceptance_rate", "tokens_per_round", "acceptance_by_position", "draft_memory_share",
                     "t_decode", "t_other", "decode_tokens_per_second"):
            out[name] = getattr(self, name)
        return out

    def summary(self) -> str:
        line = (f"{self.n_generated} tokens, {self.decode_tokens_per_second:.1f} tok/s, "
                f"prefill {self.n_prompt - self.n_prompt_cached} tokens in {self.t_prefill:.2f}s")
        if self.n_prompt_cached:
            where = " on disk" if self.prompt_cache == "disk" else ""
            line += f" ({self.n_prompt_cached} of {self.n_prompt} cached{where}, " \
                    f"{self.n_prompt_cached / self.n_prompt:.0%})"
        if self.t_draft_prefill >= 0.01:
            line += f", draft prefill {self.t_draft_prefill:.2f}s"
        if self.n_drafted:
            line += (f", acceptance {self.acceptance_rate:.0%} ({self.n_accepted}/{self.n_drafted}), "
                     f"{self.tokens_per_round:.2f} tokens/round, up to {self.n_draft_max} drafted")
        if self.n_tree_rounds:
            line += f", {self.n_tree_rounds} tree rounds ({self.n_branch_accepted} tokens from branches)"
        if self.rollback not in ("", "seq_rm"):
            line += f", rollback by {self.rollback} {self.t_rollback:.2f}s"
            if self.n_replayed:
                line += f" ({self.n_replayed} tokens decoded again)"
        if self.n_grammar_rounds:
            line += f", grammar forced {self.n_forced_accepted} tokens in {self.n_grammar_rounds} rounds"
        if self.n_constrained_rows:
            line += (f", constraint {self.t_constraint * 1e3 / self.n_constrained_rows:.2f} ms/row "
                     f"over {self.n_constrained_rows} rows")
        if self.near_ties:
            line += f", {self.near_ties} near-ties"
        if self.n_bytes_resident:
            line += f", {self.n_bytes_resident / 2**30:.2f} GiB resident"
            if self.n_bytes_draft:
                line += f" (draft {self.n_bytes_draft / 2**30:.2f} GiB, {self.draft_memory_share:.0%} of the models)"
        return line
