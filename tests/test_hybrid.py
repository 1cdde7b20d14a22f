"""Hybrid (gated delta net + attention) targets and drafts, and MTP heads as a draft.

The models are tiny random-weight GGUFs of llama.cpp's qwen35 architecture (3 recurrent layers,
1 attention layer, 1 MTP layer) and of qwen3 (attention only), written by scripts/tiny_models.py
on the Qwen2.5 vocabulary, run through real llama.cpp. Their weights are Q8_0, so verify
batches give single-token rows bit for bit and the bitwise level really speculates.
"""

from __future__ import annotations

import numpy as np
import pytest

import specllama
from specllama.errors import InvalidParameterError
from specllama.runtime import ModelSettings, Runtime
from specllama.decoding.sampling import SamplingSettings, distribution
from conftest import own_target
from test_interrupts import Boom, interrupt_nth_call
from test_sampling_e2e import second_tokens
from test_verify import chi2_critical, chi2_stat

SETTINGS = dict(n_ctx=1024, n_threads=2)
PROMPTS = ("def fib(n):", "Once upon a time, in a land far away", "The quick brown fox")
N_TOKENS = 48


@pytest.fixture(scope="module")
def expected(tiny_paths):
    """Plain greedy decoding of the hybrid target alone."""
    with specllama.load(tiny_paths["hybrid-target"], exact="bitwise", **SETTINGS) as plain:
        return {p: plain.generate(p, max_tokens=N_TOKENS).tokens for p in PROMPTS}


def test_llama_cpp_loads_and_runs_the_tiny_models(tiny_paths):
    kinds = {}
    for name, path in tiny_paths.items():
        with Runtime.load(path, ModelSettings(n_ctx=256, n_threads=2)) as rt:
            rt.decode(rt.tokenize("hello"))
            assert np.isfinite(rt.logits(0)).all()
            kinds[name] = (rt.memory, rt.rollback, rt.n_nextn)
    assert kinds == {"hybrid-target": ("hybrid", "n_rs_seq", 1), "hybrid-draft": ("hybrid", "n_rs_seq", 0),
                     "attention-draft": ("attention", "seq_rm", 0), "attention-perturbed": ("attention", "seq_rm", 0)}


@pytest.mark.parametrize("rollback", ["n_rs_seq", "checkpoint"])
def test_rollback_leaves_the_state_of_a_fresh_prefill(tiny_paths, rollback):
    """Random verify batches, each cut back to a random accepted length: the next row equals,
    bit for bit, a fresh prefill of the kept tokens; every cut is one a speculative round makes."""
    settings = ModelSettings(n_ctx=512, n_threads=2, rollback=rollback)
    with Runtime.load(tiny_paths["hybrid-target"], settings) as rt, \
            Runtime.load(tiny_paths["hybrid-target"], settings) as fresh:
        rng = np.random.default_rng(0)
        kept = rt.tokenize("hello world, this is a test")
        rt.decode(kept)
        # a checkpoint decodes again only the accepted part of the batch, snapshots nothing
        n_replay = n_replayed = 0
        for _ in range(20):
            k = int(rng.integers(1, 7))
            batch = [int(t) for t in rng.integers(0, rt.n_vocab, k)]
            rt.decode(batch, n_logits=k)
            n_keep = int(rng.integers(1, k + 1))
            n_replay += n_keep if n_keep < k else 0
            before = rt.n_replayed
            rt.truncate(len(kept) + n_keep)
            n_replayed += rt.n_replayed - before
            kept += batch[:n_keep]
            assert rt.cached == kept
            probe = [int(rng.integers(0, rt.n_vocab))]
            rt.decode(probe)
            row = rt.logits(0).copy()
            rt.truncate(len(kept))
            fresh.truncate(0)
            fresh.decode(kept + probe)
            assert np.array_equal(row, fresh.logits(0))
        assert n_replayed == (n_replay if rollback == "checkpoint" else 0)


def test_a_whole_batch_rolls_back_through_the_checkpoint(tiny_paths):
    """n_rs_seq has no snapshot of the state before a batch: dropping all of it (an interrupted
    round) goes back to the checkpoint taken before the batch instead."""
    with Runtime.load(tiny_paths["hybrid-target"], ModelSettings(n_ctx=256, n_threads=2)) as rt, \
            Runtime.load(tiny_paths["hybrid-target"], ModelSettings(n_ctx=256, n_threads=2)) as fresh:
        prompt = rt.tokenize("hello world")
        rt.decode(prompt)
        rt.decode([11, 12, 13, 14, 15], n_logits=5)
        assert rt.n_reachable(len(prompt)) == len(prompt)
        rt.discard(len(prompt))
        assert rt.cached == prompt
        rt.decode([99])
        fresh.decode(prompt + [99])
        assert np.array_equal(rt.logits(0), fresh.logits(0))


CASES = [("hybrid-draft", "n_rs_seq"), ("hybrid-draft", "checkpoint"),
         ("attention-draft", "n_rs_seq"), ("attention-draft", "checkpoint"),
         ("mtp", "n_rs_seq"), ("mtp", "checkpoint")]


@pytest.mark.parametrize("draft, rollback", CASES)
def test_greedy_speculation_is_the_target_alone(tiny_paths, expected, draft, rollback):
    draft_path = "mtp" if draft == "mtp" else tiny_paths[draft]
    with specllama.load(tiny_paths["hybrid-target"], draft_path, exact="bitwise", rollback=rollback,
                        **SETTINGS) as llm:
        accepted = rejected = 0
        for n_draft in (2, 4, 8, "auto"):
            for prompt in PROMPTS:
                r = llm.generate(prompt, max_tokens=N_TOKENS, n_draft=n_draft)
                assert r.tokens == expected[prompt], (n_draft, prompt)
                assert r.stats.rollback == rollback
                assert r.stats.draft_source == ("mtp" if draft == "mtp" else "model")
                accepted += r.stats.n_accepted
                rejected += r.stats.n_drafted - r.stats.n_accepted
        # rounds accept part of the drafts: rollbacks of every length were exercised
        assert accepted > 50 and rejected > 50, (accepted, rejected)


POINTS = [("target", "decode", 3, False),  # after a verify pass, before acceptance and rollback
          ("target", "decode", 3, True),   # before a verify pass
          ("target", "truncate", 4, False),  # after a rollback
          ("draft", "decode", 3, True)]    # while drafting


@pytest.mark.parametrize("draft", ["hybrid-draft", "mtp"])
@pytest.mark.parametrize("which, method, n, before", POINTS)
def test_an_interrupted_round_is_followed_by_an_identical_run(tiny_paths, expected, monkeypatch, draft,
                                                              which, method, n, before):
    draft_path = "mtp" if draft == "mtp" else tiny_paths[draft]
    with specllama.load(tiny_paths["hybrid-target"], draft_path, n_draft=4, exact="bitwise", **SETTINGS) as llm:
        interrupt_nth_call(getattr(llm, which), method, n, monkeypatch, before)
        with pytest.raises(Boom):
            llm.generate(PROMPTS[0], max_tokens=N_TOKENS)
        monkeypatch.undo()
        for prompt in PROMPTS:
            assert llm.generate(prompt, max_tokens=N_TOKENS).tokens == expected[prompt]


def test_a_closed_stream_mid_generation_then_identical(tiny_paths, expected):
    with specllama.load(tiny_paths["hybrid-target"], tiny_paths["hybrid-draft"], n_draft=4, exact="bitwise",
                        **SETTINGS) as llm:
        stream = llm.stream(PROMPTS[1], max_tokens=N_TOKENS)
        for i, _ in enumerate(stream):
            if i == 5:
                break
        stream.close()
        assert llm.generate(PROMPTS[1], max_tokens=N_TOKENS).tokens == expected[PROMPTS[1]]


@pytest.mark.parametrize("exact", ["bitwise", "rounding"])
def test_a_conversation_on_a_hybrid_cache_equals_a_fresh_load(tiny_paths, exact):
    """Turn 2 extends turn 1's prompt and answer. At rounding the live recurrent state is
    reused as it stands (no rollback possible or needed); at bitwise only what a fresh prefill
    computes bit for bit, which a recurrent state at its last position is not."""
    first = "def fib(n):"
    with specllama.load(tiny_paths["hybrid-target"], tiny_paths["hybrid-draft"], n_draft=4, exact=exact,
                        **SETTINGS) as llm:
        answer = llm.generate(first, max_tokens=60)  # past the slack an exact reuse may re-prefill
        n_first = len(llm.tokenize(first))
        second = llm.tokenize(first) + answer.tokens + llm.target.tokenize(" and then", add_special=False)
        llm.warm_up()  # the reuse difference, measured between turns (until then near-ties are over-counted)
        reused = llm.generate(second, max_tokens=30)
    with specllama.load(tiny_paths["hybrid-target"], exact="bitwise", **SETTINGS) as plain:
        assert reused.tokens == plain.generate(second, max_tokens=30).tokens
    assert reused.stats.near_ties == 0
    assert (reused.stats.n_prompt_cached > n_first) == (exact == "rounding")


# the attention target (seq_rm rollback) as the real pair's is: its chi-square on the real pair
# (test_sampling_e2e) runs with the slow tier, the property being the sampler's, not the model's
@pytest.mark.parametrize("target, draft", [("hybrid-target", "hybrid-draft"), ("hybrid-target", "mtp"),
                                           ("attention-draft", "hybrid-draft")])
def test_sampled_speculation_has_the_target_distribution(tiny_paths, target, draft):
    settings = dict(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0)
    draft_path = "mtp" if draft == "mtp" else tiny_paths[draft]
    with specllama.load(tiny_paths[target], draft_path, exact="bitwise", **SETTINGS) as llm:
        prompt = llm.tokenize("Once upon a time")
        mode, second, n_rejections = second_tokens(llm, prompt, 200, settings)
        with own_target(llm) as target:
            target.truncate(0)
            target.sync(prompt + [mode])  # the target alone: prefill, then the first token
            p = distribution(target.logits(0), SamplingSettings(**settings))
    observed = np.array([second.count(int(t)) for t in p.ids])
    assert observed.sum() == len(second)
    stat, df = chi2_stat(observed, p.probs)
    assert stat < chi2_critical(df), (stat, df, observed, p.probs)
    assert len(second) > 40 and n_rejections > 20, (len(second), n_rejections)


def test_bad_memory_choices_are_refused_with_the_way_out(tiny_paths, model_paths):
    with pytest.raises(InvalidParameterError, match="seq_rm cannot drop tokens"):
        Runtime.load(tiny_paths["hybrid-target"], ModelSettings(n_ctx=256, rollback="seq_rm"))
    with pytest.raises(InvalidParameterError, match="rollback"):
        ModelSettings(rollback="snapshot")
    with pytest.raises(InvalidParameterError, match="MTP .nextn. layers"):
        specllama.load(tiny_paths["attention-draft"], "mtp", **SETTINGS)


@pytest.mark.children
def test_doctor_says_which_rollback_a_model_gets_and_whether_it_has_mtp_heads(tiny_paths, model_paths):
    import subprocess
    import sys

    def doctor(model: str) -> str:
        done = subprocess.run([sys.executable, "-m", "specllama", "doctor", model, "--draft", "none", "--ctx", "1024",
                               "--threads", "2"], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        return done.stdout

    hybrid = doctor(str(tiny_paths["hybrid-target"]))
    assert "memory: hybrid (recurrent state + KV cache); rollback: n_rs_seq (16 per-token snapshots" in hybrid
    assert "MTP heads: 1 MTP (nextn) layer(s): --draft mtp drafts with them" in hybrid
    attention = doctor(str(tiny_paths["attention-draft"]))
    assert "rollback: seq_rm" in attention and "MTP heads: none" in attention
    assert "tree verify: no, chains only (a recurrent state is one per sequence)" in hybrid
    assert "tree verify: yes, up to 8 branches in one pass" in attention
    assert "requests at once: up to 4 (n_parallel), each in contexts of its own" in attention


def test_a_build_without_the_mtp_functions_says_so_and_decodes_plainly(tiny_paths, expected, monkeypatch, caplog):
    """llama_cpp_ext binds staging symbols that a build may lack: then one line, no draft."""
    import specllama.runtime.mtp as mtp

    def missing():
        raise mtp.MtpUnavailable("this llama.cpp build lacks the MTP staging functions (test)")

    monkeypatch.setattr(mtp, "mtp_api", missing)
    with caplog.at_level("WARNING", logger="specllama"):
        with specllama.load(tiny_paths["hybrid-target"], "mtp", exact="bitwise", **SETTINGS) as llm:
            r = llm.generate(PROMPTS[0], max_tokens=N_TOKENS)
    assert r.tokens == expected[PROMPTS[0]] and r.stats.draft_source == ""
    assert [rec.getMessage() for rec in caplog.records
            if "lacks the MTP staging functions" in rec.getMessage() and "without a draft" in rec.getMessage()]
