"""The prompt cache: conversations reuse their KV state, and each fidelity level keeps its promise.

Reference runs are fresh: a SpecLlama loaded for the purpose, or plain decoding at the bitwise
level (the `plain` fixture), whose reuse is only what a fresh prefill computes bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest

import specllama
from specllama.caching import prompt_cache
from specllama.caching.prompt_cache import Budget, reusable
from specllama.measuring.concurrency_probes import piece_bounds
from specllama.runtime import PrefillRow, chunk_bounds
from specllama.runtime.batches import next_batch_end, piece_end

from conftest import SETTINGS
from prompts import LONG_CODE
from test_long_context import first_difference, record_rows

N_TOKENS = 24
CHUNK = 128  # n_batch of the bitwise tests: several aligned chunks in a 550-token prompt


def conversation(n_turns):
    """The message lists of the turns of a coding chat about LONG_CODE; answers get filled in."""
    return [{"role": "system", "content": "You are a careful Python reviewer. The file under review:\n" + LONG_CODE},
            {"role": "user", "content": "What does summarize() return? One sentence."}], \
        ["And read_readings()?", "Which function would you test first, and why?"][:n_turns - 1]


def turns(llm, n_turns, n_tokens=N_TOKENS, between=None, **options):
    """Run a conversation of n_turns on llm, feeding each answer back; returns the results.
    between(): what happens while the person reads and types (a chat's idle work)."""
    messages, follow_ups = conversation(n_turns)
    results = []
    for i in range(n_turns):
        r = llm.chat(messages, max_tokens=n_tokens, **options)
        results.append(r)
        if between is not None:
            between()
        if i < len(follow_ups):
            messages = messages + [{"role": "assistant", "content": r.text}, {"role": "user", "content": follow_ups[i]}]
    return results, messages


# --- pure parts -----------------------------------------------------------------------------

def test_aligned_chunks_end_on_multiples_of_the_batch():
    assert chunk_bounds(0, 10, 4, True) == [(0, 4), (4, 8), (8, 10)]
    assert chunk_bounds(6, 7, 4, True) == [(0, 2), (2, 6), (6, 7)]  # positions 6-7, 8-11, 12
    assert chunk_bounds(6, 7, 4, False) == [(0, 4), (4, 7)]


def test_pieces_of_a_chunk():
    """A prefill beside other requests goes in pieces: multiples of n_piece rows from the chunk's
    start, the last holding at least n_piece (the shapes the piece probe measures)."""
    assert piece_end(0, 512, 64, 64) == 64
    assert piece_end(64, 512, 150, 64) == 192  # about n_want, in multiples of n_piece
    assert piece_end(192, 512, 1000, 64) == 512
    assert piece_end(0, 512, 0, 64) == 64  # at least one piece
    assert piece_end(384, 500, 64, 64) == 500 and piece_end(0, 100, 64, 64) == 100  # no piece under n_piece
    assert piece_end(0, 512, 64, 0) == 512  # 0: whole chunks
    rng = np.random.default_rng(0)
    for _ in range(500):
        chunk_end, start, n_piece = int(rng.integers(1, 600)), 0, int(rng.choice([16, 64]))
        sizes = []
        while start < chunk_end:
            end = piece_end(start, chunk_end, int(rng.integers(0, 300)), n_piece)
            sizes.append(end - start)
            start = end
        assert sum(sizes) == chunk_end and all(n % n_piece == 0 for n in sizes[:-1])
        assert sizes[-1] >= n_piece or len(sizes) == 1
    assert piece_bounds(512, 653) == [(0, 64), (64, 192), (192, 448), (448, 512), (512, 576), (576, 653)]


class _Others:
    def __init__(self, n: int):
        self.n, self.passed = n, 0

    def n_others(self) -> int:
        return self.n

    def pass_turn(self) -> None:
        self.passed += 1


def test_a_decode_passes_the_turn_between_batches_and_goes_in_pieces_only_while_others_wait():
    """Pure: a decode no one waits beside runs whole chunks; one passing turns lets the others
    go before each batch past its first, and cuts pieces only while others generate and its
    logits fit in a piece (a verify's rows stay in one pass)."""
    assert next_batch_end(None, 0, 512, 1, 0.01) == 512
    others = _Others(2)
    assert next_batch_end((others, 64), 0, 512, 1, 0.5 / 100) == 64 and others.passed == 0  # 100 rows a piece
    assert next_batch_end((others, 64), 64, 512, 1, 0.5 / 100) == 128 and others.passed == 1
    assert next_batch_end((others, 64), 64, 512, 100, 0.5 / 100) == 512  # its logits span pieces: whole
    assert next_batch_end((_Others(0), 64), 0, 512, 1, 0.01) == 512  # no one else: whole
    assert next_batch_end((others, 0), 0, 512, 1, 0.01) == 512  # pieces unmeasured: whole


def test_reusable_prefixes():
    cached, prompt = list(range(20)), list(range(15)) + [99, 98]
    assert reusable(cached, 0, None, prompt, False, 4, slack=2) == (15, False)  # all that matches
    assert reusable(cached, 12, None, prompt, True, 4, slack=2) == (12, True)  # canonical: whole chunks only
    assert reusable(cached, 10, None, prompt, True, 4, slack=2) == (8, True)
    assert reusable(cached, 12, None, prompt, False, 4, slack=3) == (12, True)  # 3 more tokens buy exactness
    assert reusable(cached, 8, None, list(range(8)) + [7], False, 4, slack=0) == (8, True)  # a chunk's end
    # the same prompt again: at least one token is decoded, unless its own prefill row was kept
    assert reusable(cached, 16, None, cached, False, 4, slack=2) == (19, False)
    row = PrefillRow(20, np.zeros(3), canonical=True)
    assert reusable(cached, 16, row, cached, True, 4) == (20, True)
    assert reusable(cached, 16, PrefillRow(20, np.zeros(3), False), cached, True, 4) == (16, True)
    assert reusable(cached, 16, PrefillRow(20, np.zeros(3), False), cached, False, 4) == (20, False)


def test_budget_evicts_least_recently_used():
    from specllama.runtime import SavedState

    budget = Budget(100)
    states = [SavedState([i], 0, bytearray(40)) for i in range(3)]
    for s in states:
        assert budget.add("cache", s)
    assert [s for _, s in budget.entries] == states[1:] and budget.n_used == 80 and budget.n_evicted == 1
    assert not budget.add("cache", SavedState([9], 0, bytearray(101)))  # never over the budget, even alone


# --- real models ----------------------------------------------------------------------------

@pytest.fixture
def reuse_all(monkeypatch):
    """Reuse every matching token: a short answer would otherwise be recomputed for an exact
    state (EXACT_SLACK), and these tests are about reusing generated tokens."""
    monkeypatch.setattr(prompt_cache, "EXACT_SLACK", 0)

@pytest.fixture(scope="module")
def bitwise_pair(model_paths):
    with specllama.load(model_paths["target"], model_paths["draft"], n_draft=3, exact="bitwise", n_batch=CHUNK,
                        **SETTINGS) as llm:
        yield llm


def test_bitwise_warm_turns_equal_a_fresh_load_row_for_row(bitwise_pair, model_paths, monkeypatch):
    warm_rows = {}
    record_rows(monkeypatch, bitwise_pair.target, warm_rows)
    warm, messages = turns(bitwise_pair, 3)
    monkeypatch.undo()
    assert warm[1].stats.n_prompt_cached > 0 and warm[2].stats.n_prompt_cached > 0
    assert all(r.stats.n_prompt_cached % CHUNK == 0 and r.stats.prompt_cache_exact for r in warm)
    # the last turn, whose reused prefix spans both earlier turns (turn 1's goes the same path over
    # one; a fresh load for it too cost 12 s of the suite), on a freshly loaded SpecLlama, as the
    # client sent it
    with specllama.load(model_paths["target"], model_paths["draft"], n_draft=3, exact="bitwise",
                        n_batch=CHUNK, **SETTINGS) as fresh:
        prompt = bitwise_pair.chat_tokens(turns_prompt(warm, 2))
        fresh_rows = {}
        record_rows(monkeypatch, fresh.target, fresh_rows)
        got = fresh.generate(prompt, max_tokens=N_TOKENS)
        monkeypatch.undo()
    assert got.tokens == warm[2].tokens
    shared = [k for k in fresh_rows if k in warm_rows]
    assert len(shared) >= N_TOKENS, len(shared)  # the prefill's last row and every generated one
    assert all(fresh_rows[k] == warm_rows[k] for k in shared), "turn 2: rows differ from a fresh load"


def turns_prompt(results, i):
    """The messages of turn i of conversation(), answers as they came."""
    messages, follow_ups = conversation(len(results))
    for j in range(i):
        messages = messages + [{"role": "assistant", "content": results[j].text},
                               {"role": "user", "content": follow_ups[j]}]
    return messages


def test_rounding_reuses_answers_and_differs_only_at_counted_near_ties(pair, plain, reuse_all):
    # between turns the reuse difference at the conversation's length is measured (idle work);
    # until it is, a turn reuses only the bit-exact part (test_measurements.py)
    # (alone: not how prefills go in pieces beside other requests, 20 s of the real pair's probes)
    warm, _ = turns(pair, 3, between=lambda: pair.warm_up(alone=True))
    for i in (1, 2):
        expected = plain.generate(pair.chat_tokens(turns_prompt(warm, i)), max_tokens=N_TOKENS)
        first = first_difference(warm[i].tokens, expected.tokens)
        assert first is None or first in warm[i].stats.near_tie_positions, (i, first, warm[i].stats.near_tie_positions)
        stats = warm[i].stats
        # the earlier answer is reused too: more than the previous turn's prompt
        assert stats.n_prompt_cached > len(pair.chat_tokens(turns_prompt(warm, i - 1))), stats.as_dict()
        assert not stats.prompt_cache_exact and stats.near_ties is not None


def test_the_same_prompt_again_reuses_everything_exactly(pair, plain):
    prompt = pair.chat_tokens(conversation(1)[0])
    first = pair.generate(prompt, max_tokens=8, exact="bitwise")  # a state bit for bit a fresh run's
    again = pair.generate(prompt, max_tokens=8)
    assert again.stats.n_prompt_cached == len(prompt) and again.stats.prompt_cache_exact
    assert again.tokens == first.tokens == plain.generate(prompt, max_tokens=8).tokens


def test_a_seed_fixes_the_sampled_text_whatever_the_cache_held(pair, model_paths):
    options = dict(max_tokens=N_TOKENS, temperature=0.9, seed=7)
    # the conversation at bitwise: its state keeps whole canonical chunks a seeded request may reuse
    warm, messages = turns(pair, 2, exact="bitwise")
    pair.generate("Unrelated: the capital of France is", max_tokens=4)
    warm_text = pair.chat(messages, **options)
    with specllama.load(model_paths["target"], model_paths["draft"], n_draft=4, **SETTINGS) as fresh:
        fresh_text = fresh.chat(messages, **options)
    assert warm_text.tokens == fresh_text.tokens
    assert warm_text.stats.n_prompt_cached > 0 and warm_text.stats.prompt_cache_exact


def test_conversations_a_b_a_reuse_a_from_ram(pair, plain, reuse_all):
    a, messages_a = turns(pair, 1)
    b_messages = [{"role": "system", "content": "You write haiku."}, {"role": "user", "content": "One about tea."}]
    b = pair.chat(b_messages, max_tokens=N_TOKENS)
    assert b.stats.prompt_cache != "saved"
    messages_a = messages_a + [{"role": "assistant", "content": a[0].text}, {"role": "user", "content": "Thanks."}]
    again = pair.chat(messages_a, max_tokens=N_TOKENS)
    assert again.stats.prompt_cache == "saved", again.stats.as_dict()
    assert again.stats.n_prompt_cached > a[0].stats.n_prompt  # A's prompt and some of its answer
    expected = plain.generate(pair.chat_tokens(messages_a), max_tokens=N_TOKENS)
    first = first_difference(again.tokens, expected.tokens)
    assert first is None or first in again.stats.near_tie_positions
    assert pair.prompt_cache_info()["target"]["restored"] >= 1


def test_an_interrupted_answer_leaves_a_cache_the_next_request_reuses(pair, plain, reuse_all):
    prompt = pair.chat_tokens(conversation(1)[0])
    stream = pair.stream(prompt, max_tokens=N_TOKENS)
    partial = [t for chunk in (next(stream), next(stream), next(stream)) for t in chunk.tokens]
    stream.close()
    assert stream.result.finish_reason == "cancelled"
    # the client continues from what it received: the cache holds it, generated tokens and all
    follow = prompt + partial
    got = pair.generate(follow, max_tokens=N_TOKENS)
    assert got.stats.n_prompt_cached >= len(follow) - 1, got.stats.as_dict()
    expected = plain.generate(follow, max_tokens=N_TOKENS)
    first = first_difference(got.tokens, expected.tokens)
    assert first is None or first in got.stats.near_tie_positions


def test_ctrl_c_mid_answer_leaves_a_usable_cache(pair, plain, reuse_all, monkeypatch):
    from test_interrupts import Boom, interrupt_nth_call

    prompt = pair.chat_tokens(conversation(1)[0])
    interrupt_nth_call(pair.target, "decode", 3, monkeypatch, before=False)
    with pytest.raises(Boom):
        pair.generate(prompt, max_tokens=N_TOKENS, n_draft=2)
    monkeypatch.undo()
    got = pair.generate(prompt, max_tokens=N_TOKENS, n_draft=2)
    assert got.stats.n_prompt_cached > 0
    first = first_difference(got.tokens, plain.generate(prompt, max_tokens=N_TOKENS).tokens)
    assert first is None or first in got.stats.near_tie_positions


def test_the_byte_budget_is_respected(tiny_paths):
    # the tiny attention model: 60 KB a conversation here, so 0.15 MiB holds two of six
    with specllama.load(tiny_paths["attention-draft"], prompt_cache_mb=0.15, **SETTINGS) as llm:
        for topic in ("tea", "rain", "stone", "ice", "salt", "moss"):
            llm.chat([{"role": "system", "content": f"You write about {topic}. " * 40},
                      {"role": "user", "content": f"A line about {topic}."}], max_tokens=4)
        budget = llm.prompt_cache_budget
        assert 0 < budget.n_used <= budget.n_bytes == int(0.15 * 2**20)
        assert budget.n_evicted > 0 and llm.prompt_cache_info()["target"]["saved"] >= 3


def test_prompt_cache_mb_is_checked(model_paths):
    with pytest.raises(specllama.InvalidParameterError, match="prompt_cache_mb"):
        specllama.load(model_paths["target"], prompt_cache_mb=-1, **SETTINGS)


def test_a_state_that_cannot_be_restored_falls_back_to_a_prefill(pair, plain):
    a = pair.chat_tokens(conversation(1)[0])
    pair.generate(a, max_tokens=4)
    pair.generate("Unrelated: a haiku about rain.", max_tokens=4)  # A goes to RAM
    states = [s for s in pair.target_cache.saved if s.tokens[:len(a)] == a]
    assert states
    for state in states:
        state.data = bytearray(state.data[:16])  # cut short: llama_state_seq_set_data refuses it
    got = pair.generate(a, max_tokens=8)
    assert got.stats.prompt_cache == "none" and got.stats.n_prompt_cached == 0
    assert got.tokens == plain.generate(a, max_tokens=8).tokens


def test_a_scope_reuses_only_its_own_prompts_and_changes_no_output(tiny_paths):
    """cache_scope: another scope's live sequence and saved states are never reused (0 cached
    tokens reported); its own come back; the text is plain decoding's either way (bitwise)."""
    prompt = "def add(a, b):\n    return a + b\n" * 12
    other = "class Stack:\n    def push(self, x):\n        pass\n" * 12
    with specllama.load(tiny_paths["attention-draft"], exact="bitwise", **SETTINGS) as llm:
        fresh = llm.generate(prompt, max_tokens=16, cache_scope="alice")
        assert fresh.stats.n_prompt_cached == 0
        bob = llm.generate(prompt, max_tokens=16, cache_scope="bob")  # alice's prompt is live: not for bob
        assert bob.stats.n_prompt_cached == 0 and bob.tokens == fresh.tokens
        llm.generate(other, max_tokens=16, cache_scope="carol")  # both saved, each under its scope
        again = llm.generate(prompt, max_tokens=16, cache_scope="alice")
        assert again.stats.n_prompt_cached > 0 and again.stats.prompt_cache == "saved"
        assert again.tokens == fresh.tokens
        shared = llm.generate(prompt, max_tokens=16)  # the default scope "" is a scope of its own
        assert shared.stats.n_prompt_cached == 0 and shared.tokens == fresh.tokens
        with pytest.raises(specllama.InvalidParameterError, match="cache_scope"):
            llm.generate(prompt, max_tokens=4, cache_scope=3)
        assert llm.generate(prompt, max_tokens=16).tokens == fresh.tokens  # and it keeps working
