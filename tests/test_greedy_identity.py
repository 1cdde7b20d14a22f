"""The product's promise: greedy speculative output is the target's own output, token for token."""

from __future__ import annotations

import pytest

from prompts import CHAT, CODE, JSON, LIST, PROSE, RAW

PROMPTS = {"code": CODE, "prose": PROSE, "json": JSON, "list": LIST, "chat": CHAT, "raw": RAW}
N_TOKENS = 64


def tokens_of(llm, prompt):
    return llm.chat_tokens(prompt) if isinstance(prompt, list) else llm.tokenize(prompt)


@pytest.fixture(scope="module")
def baseline(plain):
    """Target-only greedy output for every prompt (stop at EOG disabled by a long enough run)."""
    return {name: plain.generate(tokens_of(plain, p), max_tokens=N_TOKENS) for name, p in PROMPTS.items()}


@pytest.mark.parametrize("n_draft", [1, 3, 8])
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


@pytest.mark.parametrize("name", ["code", "list", "chat"])
@pytest.mark.parametrize("config", ["auto", "ngram", "ngram+draft"])
def test_identity_with_auto_and_lookup(pair, ngram, lookup_pair, baseline, name, config):
    llm, n_draft = {"auto": (pair, "auto"), "ngram": (ngram, "auto"), "ngram+draft": (lookup_pair, 2)}[config]
    got = llm.generate(tokens_of(llm, PROMPTS[name]), max_tokens=N_TOKENS, n_draft=n_draft)
    assert got.tokens == baseline[name].tokens


def test_lookup_proposals_were_verified(ngram, baseline):
    """The repetitive list gives prompt lookup matches, so identity above was really tested."""
    got = ngram.generate(tokens_of(ngram, PROMPTS["list"]), max_tokens=N_TOKENS, n_draft=2)
    assert got.stats.n_drafted > 5
    assert got.tokens == baseline["list"].tokens
