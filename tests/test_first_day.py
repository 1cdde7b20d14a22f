"""The first day on a fresh machine, through the Python API: the first request decides from costs
timed at load and corrected by its own rounds, and a library computes nothing in the background
unless asked to."""

from __future__ import annotations

import threading

import numpy as np

import specllama
from conftest import SETTINGS
from prompts import LONG_STORY
from specllama.measuring.cost_probes import FIRST_DRAFT_BATCH
from specllama.decoding.limits import MAX_VERIFY

CODE = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def idle_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "specllama-idle"]


def test_the_first_request_decides_from_a_first_estimate_and_its_own_rounds(model_paths, home, plain):
    with specllama.load(model_paths["target"], model_paths["draft"], **SETTINGS) as llm:
        assert llm.planner.book.source == "first estimate timed at load"
        costs = llm.planner.book.get()
        assert costs is not None and len(costs.verify) == MAX_VERIFY
        assert all(b >= a > 0 for a, b in zip(costs.verify, costs.verify[1:]))  # never falling
        assert costs.draft_batch is not None and costs.draft_batch[0] == FIRST_DRAFT_BATCH
        assert 0 < costs.draft_token < costs.draft_batch[1]
        r = llm.generate(CODE, max_tokens=32)
        # the controller decided (before: a fixed plain policy until a probe ran when idle)
        assert r.stats.controller["kind"] == "auto" and r.stats.controller["n_observed"] > 0
        sources = r.stats.sources
        assert sources["decode_costs"].startswith("first estimate timed at load; ") and "in this request" in sources[
            "decode_costs"], sources
        assert any("decode-cost curve" in m for m in r.stats.measurements_pending)
        expected = plain.generate(CODE, max_tokens=32).tokens
        first = next((i for i, (a, b) in enumerate(zip(r.tokens, expected)) if a != b), None)
        assert first is None or first in r.stats.near_tie_positions  # the default level's promise
        # a seeded request's text must not hang on one load's timings: plain until a probe's curve
        seeded = llm.generate(CODE, max_tokens=8, temperature=0.7, seed=3)
        assert seeded.stats.controller == {"kind": "fixed", "n_draft": 0}
        assert "costs" in llm.warm_up(alone=True) and llm.planner.book.source.startswith("probe")
        again = llm.generate(CODE, max_tokens=8)
        assert not any("decode-cost curve" in m for m in again.stats.measurements_pending)
        assert again.stats.sources["decode_costs"].startswith("probe")


def test_a_library_load_computes_nothing_in_the_background(model_paths, home, monkeypatch):
    """A background thread decoding in a library competes with the host's own threads, which
    idle work cannot see: a llama_cpp.Llama beside an idle SpecLlama ran at 0.61 of its speed.
    SmolLM2 drafting for itself: which threads a load starts does not depend on the pair."""
    before = len(idle_threads())
    smol = model_paths["smollm2"]
    with specllama.load(smol, smol, **SETTINGS) as llm:
        llm.generate(LONG_STORY + "Continue the story.", max_tokens=2)  # queues work at its KV length
        assert llm.idle.pending() and len(idle_threads()) == before
        assert llm.idle.done == []
    monkeypatch.setenv("SPECLLAMA_IDLE_WORK", "1")  # asked for, for a whole process tree
    with specllama.load(smol, None, **SETTINGS):
        assert len(idle_threads()) == before + 1
    monkeypatch.delenv("SPECLLAMA_IDLE_WORK")
    with specllama.load(smol, None, idle_work=True, **SETTINGS):
        assert len(idle_threads()) >= before + 1


def test_warm_up_alone_measures_what_one_request_uses_and_leaves_what_requests_side_by_side_use(tiny_paths, home):
    """A one-shot command's first use (`specllama run`) measures what its request uses; how a
    prefill may go in pieces beside other requests waits for a server's or a chat's idle time."""
    with specllama.load(tiny_paths["attention-draft"], tiny_paths["attention-draft"], n_parallel=2,
                        **SETTINGS) as llm:
        pieces = [what for what in llm.idle.pending() if what.endswith("prefill in pieces")]
        assert pieces and llm.idle.pending(alone=True) == ["the decode-cost curve"], llm.idle.pending()
        assert llm.warm_up(alone=True) == ["costs"]
        assert llm.idle.pending() == pieces
        assert sorted(llm.warm_up()) == sorted(key for key in llm.idle.done if key.startswith("pieces|"))
        assert llm.idle.pending() == []


def test_a_first_estimate_fits_the_short_probe_s_passes(model_paths, home):
    """The verify curve's shape comes from the passes the load's fidelity probe timed: a robust
    line, so one pass the machine disturbed does not bend it."""
    from specllama.measuring.cost_probes import first_costs

    with specllama.load(model_paths["target"], None, idle_work=False, **SETTINGS) as llm, llm.exclusive():
        seconds = [0.02, 0.03, 0.04, 0.9, 0.06, 0.07]  # the fourth pass disturbed
        costs, v1 = first_costs(llm.target, None, seconds)
    assert len(v1) == 3 and costs.v(1) == min(v1) and costs.draft_batch is None
    line = np.array(costs.verify[1:6])
    assert np.allclose(np.maximum(line, costs.v(1)), np.maximum([0.03, 0.04, 0.05, 0.06, 0.07], costs.v(1)))


def test_past_the_short_context_a_script_drafts_on_an_assumed_limit_a_live_round_checks(model_paths, home, plain):
    """No idle time, so no probe at KV 257-512: where the level allows a difference, rounds
    there take the short context's limit, one round's first row is checked against the same
    row decoded alone, and near-ties are judged with an assumed difference; the output is
    plain decoding's but at near-ties counted."""
    prompt = LONG_STORY + "Continue the story."
    expected = plain.generate(prompt, max_tokens=40).tokens
    with specllama.load(model_paths["target"], model_paths["draft"], **SETTINGS) as llm:
        short = llm.batch_diffs.known(0)
        assert short is not None and short.largest_batch(0.25) > 1
        r = llm.generate(prompt, max_tokens=40, n_draft=2)
        assert 256 < r.stats.n_prompt < 500 and 1 in llm.batch_diffs.checked, llm.batch_diffs.checked
        assert any("KV <= 512" in m and "assumed" in m for m in r.stats.measurements_pending)
        diff, used = llm.batch_diffs.checked[1], r.stats.verify_limits["KV <= 512"]
        # within half the bound the assumption stands; past it, plain decoding there
        assert used == (short.largest_batch(0.25) if diff <= 0.125 else 1), (diff, used)
        first = next((i for i, (a, b) in enumerate(zip(r.tokens, expected)) if a != b), None)
        assert first is None or first in r.stats.near_tie_positions
