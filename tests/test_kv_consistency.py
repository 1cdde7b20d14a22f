"""After many rejections, both KV caches hold exactly the accepted tokens."""

from __future__ import annotations

import numpy as np

import specllama
from specllama.runtime import ModelSettings, Runtime

from conftest import SETTINGS, own_target
from prompts import PROSE


def fresh_logits(path, tokens):
    with Runtime.load(path, ModelSettings(**SETTINGS)) as rt:
        rt.sync(tokens)
        return rt.logits(0).copy()


def test_caches_match_a_fresh_context(model_paths):
    with specllama.load(model_paths["target"], model_paths["draft"], n_draft=6, exact="off", **SETTINGS) as llm:
        prompt = llm.tokenize(PROSE)
        r = llm.generate(prompt, max_tokens=96, temperature=1.0, seed=3)  # about 80 rejected drafts
        assert r.stats.n_drafted - r.stats.n_accepted > 40, "too few rejections to test rollback"
        seq = prompt + r.tokens
        with own_target(llm):
            # each cache holds a prefix of the accepted stream, which may run past max_tokens by
            # the rest of the last round
            for runtime in (llm.target, llm.draft):
                n = min(len(runtime.cached), len(seq))
                assert runtime.cached[:n] == seq[:n], runtime.name
            assert len(llm.target.cached) >= len(seq) - 1
            for runtime, path in ((llm.target, model_paths["target"]), (llm.draft, model_paths["draft"])):
                runtime.sync(seq)  # decodes only what the cache lacks
                ours = runtime.logits(0).copy()
                ref = fresh_logits(path, seq)
                # batch shapes differ from the fresh context, so compare within rounding, not bitwise;
                # a stale or misplaced KV row shifts logits by whole units
                assert np.abs(ours - ref).max() < 1.5, runtime.name
                assert np.corrcoef(ours, ref)[0, 1] > 0.999
                assert int(np.argmax(ours)) == int(np.argmax(ref))


def test_stale_cache_would_be_detected(model_paths):
    """The comparison above can fail: a cache holding one wrong token gives different logits."""
    with Runtime.load(model_paths["draft"], ModelSettings(**SETTINGS)) as rt:
        seq = rt.tokenize(PROSE + " the keepers lit the lamp every night and")
        wrong = list(seq)
        wrong[len(seq) // 2] = rt.tokenize(" banana", add_special=False)[0]
        rt.sync(wrong)
        stale = rt.logits(0).copy()
    ref = fresh_logits(model_paths["draft"], seq)
    assert not (np.abs(stale - ref).max() < 1.5 and np.corrcoef(stale, ref)[0, 1] > 0.999)
