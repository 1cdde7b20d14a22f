"""The product's promise: greedy speculative output is the target's own output, token for token."""

from __future__ import annotations

import pytest

from prompts import CHAT, CODE, COPY, EDIT, JSON, LIST, PROSE, RAW
from specllama.decoding.proposers import PromptLookupProposer

PROMPTS = {"code": CODE, "prose": PROSE, "json": JSON, "list": LIST, "chat": CHAT, "raw": RAW}
COPYING = {"edit": EDIT, "copy": COPY}  # continuations that copy the prompt: lookup must match
N_TOKENS = 64


def tokens_of(llm, prompt):
    return llm.chat_tokens(prompt) if isinstance(prompt, list) else llm.tokenize(prompt)


@pytest.fixture(scope="module")
def baseline(plain):
    """Target-only greedy output for every prompt (stop at EOG disabled by a long enough run)."""
    return {name: plain.generate(tokens_of(plain, p), max_tokens=N_TOKENS)
            for name, p in {**PROMPTS, **COPYING}.items()}


# 8 with the slow tier: at the bitwise level the Q4_K_M target's verify limit is 2-3 rows on our
# CPUs, so 8 drafted what 3 did; deep drafting on the real pair is tests/test_long_context.py's
# F16 test, and on any length the tiny models' (test_trees, test_hybrid)
@pytest.mark.parametrize("n_draft", [1, 3, pytest.param(8, marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_speculative_greedy_equals_target_only(pair, baseline, name, n_draft):
    expected = baseline[name]
    got = pair.generate(tokens_of(pair, PROMPTS[name]), max_tokens=N_TOKENS, n_draft=n_draft)
    assert got.tokens == expected.tokens
    assert got.text == expected.text
    assert got.finish_reason == expected.finish_reason
    assert got.stats.n_drafted > 0, "the draft never ran, so nothing was compared"


def test_baseline_runs_are_long_enough(baseline):
    """Most prompts must produce the full 64 tokens, or the identity check proves little."""
    lengths = {name: len(r.tokens) for name, r in baseline.items()}
    assert sum(n == N_TOKENS for n in lengths.values()) >= 5, lengths


def test_rejections_happened(pair, baseline):
    """Identity must hold through rejections, not only on text the draft gets all right."""
    r = pair.generate(tokens_of(pair, PROSE), max_tokens=N_TOKENS, n_draft=8)
    assert r.stats.n_accepted < r.stats.n_drafted
    assert r.tokens == baseline["prose"].tokens


@pytest.fixture(scope="module")
def lookup_pair(model_paths):
    import specllama
    from conftest import SETTINGS

    with specllama.load(model_paths["target"], model_paths["draft"], lookup=True, **SETTINGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def ngram(model_paths):
    import specllama
    from conftest import SETTINGS

    with specllama.load(model_paths["target"], "ngram", **SETTINGS) as llm:
        yield llm


@pytest.mark.parametrize("name", ["code", "list", "chat", "edit"])
@pytest.mark.parametrize("config", ["auto", "ngram", "ngram+draft"])
def test_identity_with_auto_and_lookup(pair, ngram, lookup_pair, baseline, name, config):
    llm, n_draft = {"auto": (pair, "auto"), "ngram": (ngram, "auto"), "ngram+draft": (lookup_pair, 2)}[config]
    got = llm.generate(tokens_of(llm, {**PROMPTS, **COPYING}[name]), max_tokens=N_TOKENS, n_draft=n_draft)
    assert got.tokens == baseline[name].tokens


def lookup_hits(prompt, output):
    """Positions of output where prompt lookup, run on everything before them, proposes the
    token the target itself produced there: what lookup can get right on this machine's text.
    Position 0 comes from the prefill, never from a round, so it is not counted."""
    lookup, seq = PromptLookupProposer(), list(prompt) + list(output)
    hits = []
    for i in range(len(prompt) + 1, len(seq)):
        n, start = lookup.match(seq[:i])
        if n and seq[start] == seq[i]:
            hits.append(i - len(prompt))
    return hits


@pytest.mark.parametrize("name", sorted(COPYING))
def test_lookup_proposals_were_verified(ngram, baseline, name):
    """Identity above was tested through real lookup proposals, on any CPU.

    The premise is checked on the target's own output, not assumed from one machine's text:
    lookup would have proposed the right token at some positions. Every position is either
    the start of a round (whose lookup proposal is then accepted) or inside a round that
    accepted drafts already, so the run must accept at least one lookup token wherever a
    verify batch of 2 is allowed at all.
    """
    prompt = tokens_of(ngram, COPYING[name])
    hits = lookup_hits(prompt, baseline[name].tokens)
    assert len(hits) >= 4, f"premise: the target's output barely copies the prompt ({hits}); choose another prompt"
    got = ngram.generate(prompt, max_tokens=N_TOKENS, n_draft=2)
    assert got.tokens == baseline[name].tokens
    if max(got.stats.verify_limits.values()) < 2:
        pytest.skip(f"this backend allows no verify batch of 2 at the {got.stats.fidelity} level "
                    f"({got.stats.verify_limits}), so nothing can be drafted")
    assert got.stats.n_lookup_rounds > 0 and got.stats.n_accepted > 0, (hits, got.stats.as_dict())


def test_lookup_hits_finds_copies_and_nothing_else():
    assert lookup_hits([1, 2, 3, 4], [1, 2, 3]) == [2]  # after "1 2" comes 3, as in the prompt
    assert lookup_hits([1, 2, 3, 4], [1, 2, 7]) == []  # lookup would propose 3: a miss
    assert lookup_hits([1, 2, 3, 4], [9, 8, 7]) == []
