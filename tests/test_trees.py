"""Tree verification end to end: multi-sequence verify batches in real llama.cpp.

The target is the tiny attention-only model of scripts/tiny_models.py (Q8_0 weights, so any
batch gives single-token rows bit for bit and the bitwise level really speculates); the
draft is the tiny hybrid, which agrees with it on part of its tokens.
"""

from __future__ import annotations

import numpy as np
import pytest

import specllama
from specllama.controller import Acceptance, Controller, Costs, OnlineCosts
from specllama.decoding.decode import Decoding, generate_steps
from specllama.errors import InvalidParameterError
from specllama.measuring.fidelity import LEVELS, Limits
from specllama.decoding.proposers import DraftModelProposer, PromptLookupProposer, Proposer
from specllama.decoding.proposals import Proposal
from specllama.runtime import ModelSettings, Runtime
from specllama.decoding.tree import Tree
from specllama.decoding.sampling import SamplingSettings, distribution
from specllama.decoding.stats import Stats
from test_interrupts import Boom, interrupt_nth_call
from test_verify import chi2_critical, chi2_stat

SETTINGS = dict(n_ctx=1024, n_threads=2)
PROMPTS = ("def fib(n):", "Once upon a time, in a land far away", "The quick brown fox")
N_TOKENS = 48
SHAPES = [(4, 2), (4, 3), (8, 3), (3, 8)]  # (n_draft, candidates per position)


@pytest.fixture(scope="module")
def expected(tiny_paths):
    with specllama.load(tiny_paths["attention-draft"], exact="bitwise", **SETTINGS) as plain:
        return {p: plain.generate(p, max_tokens=N_TOKENS) for p in PROMPTS}


@pytest.fixture(scope="module")
def llm(tiny_paths):
    with specllama.load(tiny_paths["attention-draft"], tiny_paths["hybrid-target"], exact="bitwise",
                        **SETTINGS) as llm:
        yield llm


def _path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node != -1:
        path.append(node)
        node = parents[node]
    return path[::-1]


def test_tree_rows_and_the_kept_path_are_single_token_decoding(tiny_paths):
    """Random trees: every row equals the same token decoded alone after its own path; after
    keeping a random path (cut at a random depth), the next decode equals single-token decoding
    of what was kept, including tokens the cache kept off the tree's first branch."""
    settings = ModelSettings(n_ctx=1024, n_threads=2)
    with Runtime.load(tiny_paths["attention-draft"], settings, n_branches=8) as rt, \
            Runtime.load(tiny_paths["attention-draft"], settings) as alone:
        assert rt.n_branches == 8 and alone.n_branches == 1
        rng = np.random.default_rng(0)
        prompt = rt.tokenize("The quick brown fox jumps over the lazy dog.")
        rt.decode(prompt)
        n_off_branch = 0
        for _ in range(40):
            while True:
                n = int(rng.integers(2, 12))
                parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
                if n - len(set(parents[1:])) <= rt.n_branches:
                    break
            tokens = [int(t) for t in rng.integers(100, 5000, n)]
            n_root = len(rt.cached)
            # tokens[0] is the root; the runtime takes the nodes after it, each parent one lower
            rt.decode_tree(tokens[0], tokens[1:], Tree([p - 1 for p in parents[1:]]))
            rows = [rt.logits(i).copy() for i in range(n)]
            path = _path_to(parents, int(rng.integers(0, n)))
            path = path[:int(rng.integers(1, len(path) + 1))]
            rt.truncate(n_root + len(path), [i - 1 for i in path[1:]])
            assert rt.cached[n_root:] == [tokens[i] for i in path]
            n_off_branch += rt.n_pending > 0
            alone.truncate(0)
            alone.decode(prompt)
            for token in rt.cached[len(prompt):n_root]:
                alone.decode([token])
            for i in path:
                alone.decode([tokens[i]])
                assert np.array_equal(alone.logits(0), rows[i])
            probe = int(rng.integers(100, 5000))
            rt.decode([probe])
            alone.decode([probe])
            assert np.array_equal(rt.logits(0), alone.logits(0))
            rt.truncate(len(rt.cached) - 1)
        assert n_off_branch > 5


def test_trees_are_checked(tiny_paths):
    with Runtime.load(tiny_paths["attention-draft"], ModelSettings(n_ctx=256, n_threads=2), n_branches=2) as rt:
        rt.decode(rt.tokenize("hello"))
        with pytest.raises(ValueError, match="branches"):
            rt.decode_tree(1, [2, 3, 4], Tree([-1, -1, -1]))  # three leaves
        with pytest.raises(ValueError, match="parents"):
            rt.decode_tree(1, [2], Tree([0]))
        n_root = len(rt.cached)
        rt.decode_tree(1, [2, 3], Tree([-1, -1]))
        with pytest.raises(ValueError, match="not a path"):
            rt.truncate(len(rt.cached), [1, 0])
        rt.truncate(n_root + 2, [1])  # after the error the tree is still there to keep a path of
        assert rt.cached[n_root:] == [1, 3] and rt.n_pending == 1
    with Runtime.load(tiny_paths["hybrid-target"], ModelSettings(n_ctx=256, n_threads=2), n_branches=8) as rt:
        assert rt.n_branches == 1  # recurrent memory keeps one state per sequence: chains only


@pytest.mark.parametrize("n_draft, width", SHAPES)
def test_greedy_trees_are_the_target_alone(llm, expected, n_draft, width):
    n_branch = 0
    for prompt in PROMPTS:
        r = llm.generate(prompt, max_tokens=N_TOKENS, n_draft=n_draft, tree=width)
        assert r.tokens == expected[prompt].tokens, (n_draft, width, prompt)
        assert r.stats.n_tree_rounds > 0
        n_branch += r.stats.n_branch_accepted
    assert n_branch > 10  # paths that left the draft's own chain were accepted


def test_the_controller_grows_trees_and_stays_exact(tiny_paths, expected):
    """The auto controller with a cost curve where rows are cheap (as on a memory-bound GPU
    or an F16 target): it verifies siblings where the draft is unsure, and output is the
    target's. The runtime, models and loop are real; only the costs are given."""
    costs = Costs(tuple(1.0 + 0.02 * n for n in range(17)), draft_token=0.1)
    with Runtime.load(tiny_paths["attention-draft"], ModelSettings(**SETTINGS), n_branches=8) as target, \
            Runtime.load(tiny_paths["hybrid-target"], ModelSettings(**SETTINGS, rollback="checkpoint")) as draft:
        n_tree = 0
        for prompt in PROMPTS:
            tokens = target.tokenize(prompt)
            target.truncate(0)
            target.sync(tokens)
            policy = Controller(OnlineCosts(costs, frozen=True), 8, has_draft=True, lookup=True,
                                acceptance=Acceptance(), width=3)
            stats = Stats()
            out = []
            steps = generate_steps(Decoding(target, Proposer(DraftModelProposer(draft), PromptLookupProposer()),
                                            policy, SamplingSettings(), np.random.default_rng(0),
                                            Limits(LEVELS["off"], None), stats), tokens)
            for step in steps:
                out.extend(step.tokens)
                if len(out) >= N_TOKENS:
                    break
            steps.close()
            assert out[:N_TOKENS] == expected[prompt].tokens
            n_tree += stats.n_tree_rounds
        assert n_tree > 10


def test_logprobs_come_from_each_token_s_own_row(llm, expected):
    """In a tree the rows of accepted tokens are not the first ones: logprobs must match a
    chain's, which at the bitwise level are plain decoding's."""
    def run(tree: int) -> tuple[list, list, int]:
        stream = llm.stream(PROMPTS[0], max_tokens=24, n_draft=4, tree=tree, logprobs=3)
        chunks = list(stream)
        return ([t for c in chunks for t in c.tokens], [lp for c in chunks for lp in c.logprobs or []],
                stream.result.stats.n_branch_accepted)

    chain, tree = run(1), run(3)
    assert tree[0] == chain[0] and len(tree[1]) == len(tree[0])
    assert tree[2] > 0
    assert tree[1] == chain[1]


def test_a_grammar_keeps_chains(llm):
    r = llm.generate("Answer yes or no:", max_tokens=8, n_draft=4, tree=3, grammar='root ::= "yes" | "no"')
    assert r.text in ("yes", "no")
    assert r.stats.n_tree_rounds == 0


POINTS = [("target", "decode_tree", 2, False),  # after a tree pass, before acceptance
          ("target", "decode_tree", 2, True),  # before a tree pass
          ("target", "truncate", 3, False),  # after keeping a path
          ("draft", "decode", 3, True)]  # while drafting


@pytest.mark.parametrize("which, method, n, before", POINTS)
def test_an_interrupted_tree_round_is_followed_by_an_identical_run(tiny_paths, expected, monkeypatch,
                                                                   which, method, n, before):
    with specllama.load(tiny_paths["attention-draft"], tiny_paths["hybrid-target"], n_draft=4, tree=3,
                        exact="bitwise", **SETTINGS) as llm:
        interrupt_nth_call(getattr(llm, which), method, n, monkeypatch, before)
        with pytest.raises(Boom):
            llm.generate(PROMPTS[1], max_tokens=N_TOKENS)
        monkeypatch.undo()
        for prompt in PROMPTS:
            assert llm.generate(prompt, max_tokens=N_TOKENS).tokens == expected[prompt].tokens


def test_a_conversation_after_tree_rounds_reuses_the_cache_exactly(llm, tiny_paths):
    """Turn 2 extends turn 1's prompt and answer, which tree rounds left partly pending."""
    first = "def fib(n):"
    answer = llm.generate(first, max_tokens=40, n_draft=4, tree=3, exact="rounding")
    second = llm.tokenize(first) + answer.tokens + llm.target.tokenize(" and then", add_special=False)
    reused = llm.generate(second, max_tokens=30, n_draft=4, tree=3, exact="rounding")
    assert reused.stats.n_prompt_cached > len(llm.tokenize(first))
    with specllama.load(tiny_paths["attention-draft"], exact="bitwise", **SETTINGS) as plain:
        assert reused.tokens == plain.generate(second, max_tokens=30).tokens


def test_sampled_trees_have_the_target_distribution(llm):
    """The first token a tree round produces (the draft's token and two siblings drawn without
    replacement at each position), over many seeds, against the target's own distribution."""
    settings = dict(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0)
    prompt = llm.tokenize("Once upon a time")
    pairs, n_rejected, n_tree = [], 0, 0
    for seed in range(240):
        r = llm.generate(prompt, max_tokens=2, seed=seed, n_draft=2, tree=3, **settings)
        pairs.append(tuple(r.tokens))
        n_rejected += r.stats.n_drafted - r.stats.n_accepted
        n_tree += r.stats.n_tree_rounds
    first = [t[0] for t in pairs]
    mode = max(set(first), key=first.count)
    second = [t[1] for t in pairs if t[0] == mode]
    target = llm.target
    target.truncate(0)
    target.sync(prompt + [mode])
    p = distribution(target.logits(0), SamplingSettings(**settings))
    observed = np.array([second.count(int(t)) for t in p.ids])
    assert observed.sum() == len(second)
    stat, df = chi2_stat(observed, p.probs)
    assert stat < chi2_critical(df), (stat, df, observed, p.probs)
    assert len(second) > 40 and n_rejected > 20 and n_tree > 100, (len(second), n_rejected, n_tree)


def test_a_fixed_tree_on_a_model_that_verifies_chains_is_refused(tiny_paths):
    with specllama.load(tiny_paths["hybrid-target"], tiny_paths["hybrid-draft"], **SETTINGS) as llm:
        with pytest.raises(InvalidParameterError, match="verifies chains only"):
            llm.generate("hi", max_tokens=2, n_draft=4, tree=3)
        assert llm.generate("hi", max_tokens=2, tree="auto").stats.n_tree_rounds == 0
    with pytest.raises(InvalidParameterError, match="tree"):
        specllama.load(tiny_paths["attention-draft"], tree=0, **SETTINGS)


def test_sampled_proposals_are_decided_without_looking_at_the_drawn_token(tiny_paths):
    """Whether a sampled draft token, or a sibling, is proposed may depend on what came before
    it, never on its own value: the verifier judges it as drawn from q, and one kept only
    where it came out likely is not (chi-square cannot see this bias at test sizes; this can)."""
    from specllama.decoding.proposals import TreeShape
    from specllama.decoding.proposers import Generation

    sampling = SamplingSettings(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0)
    with Runtime.load(tiny_paths["hybrid-target"], ModelSettings(**SETTINGS, rollback="checkpoint")) as draft:
        proposer = DraftModelProposer(draft)
        prompt = draft.tokenize("Once upon a time")
        proposer.prefill(prompt)
        proposal: Proposal
        asked, drawn = set(), set()
        sibling_asked: dict[int, set] = {}  # the draft's token -> what the first sibling was asked with
        sibling_drawn: dict[int, set] = {}
        for seed in range(24):
            calls, sibling_calls = [], []

            def draft_more(confidences):
                calls.append(confidences[-1])
                return "stop"

            def sibling(confidence):
                sibling_calls.append(confidence)
                return True

            shape = TreeShape(3, 8, 8, sibling, lambda depth: False)
            proposal, _ = proposer.propose(prompt, 1, Generation(sampling, np.random.default_rng(seed), draft_more),
                                           shape)
            x = proposal.tokens[0]
            asked.add(round(calls[0], 12))
            drawn.add(x)
            sibling_asked.setdefault(x, set()).add(round(sibling_calls[0], 12))
            sibling_drawn.setdefault(x, set()).add(proposal.tokens[1])
            chain, _ = proposer.propose(prompt, 1, Generation(sampling, np.random.default_rng(seed), draft_more))
            asked.add(round(calls[-1], 12))
            drawn.add(chain.tokens[0])
    assert len(drawn) > 2  # the draws differ
    assert len(asked) == 1  # the question about the draft's own token does not
    # a sibling's question may depend on the token drawn before it, not on its own draw
    assert all(len(values) == 1 for values in sibling_asked.values())
    assert any(len(tokens) > 1 for tokens in sibling_drawn.values())
