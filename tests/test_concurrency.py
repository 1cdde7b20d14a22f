"""Several requests at once: each decodes in a slot of its own (contexts on the shared weights)
and its rounds take turns with the others', so its output is the one it has alone. Real
models, real llama.cpp, and a real server with the openai client."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import openai
import pytest

import specllama
from conftest import SERVER_KEY, SETTINGS
from prompts import LONG_STORY
from specllama.measuring.concurrency_probes import probe_piece_diff
from specllama.runtime import batches
from specllama.runtime.batches import N_PIECE
from specllama.scheduling.slots import Turns

ASKS = ["Write a Python function that reverses a linked list.", "Give a four-word title for: baking sourdough bread",
        "Explain TCP slow start in two sentences.", "Write a Python function that reverses a linked list."]
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"  # SmolLM2 counts on for 600 tokens and more
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def at_once(llm, prompts, per_prompt=None, **options):
    """generate() on every prompt (with per_prompt[i]'s options, or the same for all), each in
    a thread of its own, all started together."""
    results: list = [None] * len(prompts)
    start = threading.Barrier(len(prompts))

    def run(i):
        start.wait()
        results[i] = llm.generate(prompts[i], **(per_prompt[i] if per_prompt else options))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return results


@pytest.fixture(scope="module")
def pair(model_paths):
    """SmolLM2 drafting four tokens a round for itself, loaded for this module (the slots its
    requests make stay here): slots and turns are the subject, the same on any pair, and the
    135M model decodes about 4x faster than the Qwen pair (test_batched_requests.py runs that)."""
    with specllama.load(model_paths["smollm2"], model_paths["smollm2"], n_draft=4, **SETTINGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def plain(model_paths):
    """The module's baseline: SmolLM2 alone at the bitwise level."""
    with specllama.load(model_paths["smollm2"], exact="bitwise", **SETTINGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def prompts(pair):
    return [pair.chat_tokens([{"role": "user", "content": ask}]) for ask in ASKS]


def test_turns_are_handed_out_in_arrival_order():
    """Turns is fair: a thread that releases and asks again at once goes behind a waiter
    (threading.Lock would let it keep the lock, starving the other request)."""
    turns, order = Turns(), []
    turns.acquire()
    waiter = threading.Thread(target=lambda: (turns.acquire(), order.append("waiter"), turns.release()))
    waiter.start()
    time.sleep(0.1)  # the waiter is queued
    turns.release()
    with turns:
        order.append("again")
    waiter.join(5)
    assert order == ["waiter", "again"]
    assert turns.acquire(blocking=False)
    assert not turns.acquire(blocking=False)
    turns.release()


def test_a_turn_released_by_a_thread_not_holding_it_raises_but_after_an_interrupted_pass():
    """A wrong release is a bug to see, not to swallow: one that went unnoticed would let two
    threads decode in the same context. The one release allowed: a thread interrupted while it
    waited to take the turn back in pass_turn() holds nothing for its with-block to give up."""
    turns = Turns()
    with pytest.raises(RuntimeError, match="does not hold"):
        turns.release()
    turns.acquire()
    waiter = threading.Thread(target=lambda: (turns.acquire(), time.sleep(0.3), turns.release()))
    waiter.start()
    while not turns.n_waiting():
        time.sleep(0.01)
    original = turns.acquire

    def acquire_interrupted(blocking: bool = True) -> bool:
        raise KeyboardInterrupt  # Ctrl-C while waiting to take the turn back

    turns.acquire = acquire_interrupted
    with pytest.raises(KeyboardInterrupt):
        turns.pass_turn()
    turns.acquire = original
    turns.release()  # the with-block's release: nothing to give up, once
    with pytest.raises(RuntimeError, match="does not hold"):
        turns.release()
    waiter.join(5)
    assert turns.acquire(blocking=False)
    turns.release()


def test_four_greedy_requests_at_once_each_equal_their_solo_run(pair, plain, prompts):
    """Different prompts and two identical ones, at the bitwise level: each equals plain
    decoding of its prompt alone, and they really ran side by side (four slots)."""
    solo = [plain.generate(p, max_tokens=40).tokens for p in prompts]
    before = pair.prompt_cache_info()["target"]
    results = at_once(pair, prompts, max_tokens=40, exact="bitwise")
    assert [r.tokens for r in results] == solo
    assert sorted(r.stats.slot for r in results) == [0, 1, 2, 3]
    info = pair.prompt_cache_info()  # every slot's prefills counted
    assert info["slots"] == 4
    assert info["target"]["hits"] + info["target"]["misses"] == before["hits"] + before["misses"] + 4


def test_at_the_default_level_requests_at_once_differ_only_at_counted_near_ties(pair, plain, prompts):
    solo = [plain.generate(p, max_tokens=40).tokens for p in prompts]
    for result, expected in zip(at_once(pair, prompts, max_tokens=40), solo):
        got = result.tokens
        first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
        if first is None:
            assert len(got) == len(expected)
        else:
            assert first in result.stats.near_tie_positions, (first, result.stats.near_tie_positions)


def test_seeded_sampling_gives_the_same_text_beside_others(pair, prompts):
    options = dict(max_tokens=32, temperature=0.9, seed=1234)
    alone = [pair.generate(p, **options).text for p in prompts[:3]]
    beside = at_once(pair, prompts[:3], **options)
    assert [r.text for r in beside] == alone


def test_a_constrained_request_beside_unconstrained_ones_keeps_its_output(pair, prompts):
    ask = pair.chat_tokens([{"role": "user", "content": "Describe a person as JSON."}])
    alone = pair.generate(ask, max_tokens=40, json_schema=SCHEMA, exact="bitwise")
    options = [dict(max_tokens=40, json_schema=SCHEMA, exact="bitwise"), dict(max_tokens=40), dict(max_tokens=40)]
    beside = at_once(pair, [ask, prompts[0], prompts[2]], options)
    assert beside[0].tokens == alone.tokens
    assert '"age"' in beside[0].text


def test_generate_batch_and_submit(pair, plain, prompts):
    solo = [plain.generate(p, max_tokens=24).tokens for p in prompts]
    results = pair.generate_batch(prompts, max_tokens=24, exact="bitwise")
    assert [r.tokens for r in results] == solo
    future = pair.submit(prompts[2], max_tokens=24, exact="bitwise")
    assert future.result(120).tokens == solo[2]
    with pytest.raises(specllama.InvalidParameterError, match="max_tokens"):
        pair.generate_batch(prompts, max_tokens=-3)  # checked before anything decodes


def test_a_prefill_in_pieces_computes_what_whole_chunks_do(model_paths):
    """The piece probe on a real model: pieces of N_PIECE rows and up give the rows whole chunks
    give, bit for bit; and it sees a difference where there is one (on our x86 CPUs, 32-row
    batches take another kernel path than a 512-token chunk's: 0.5-1.9 logits)."""
    with specllama.load(model_paths["smollm2"], idle_work=False, **SETTINGS) as llm:  # nothing else decodes
        target = llm.target
        assert probe_piece_diff(target) == 0.0
        assert probe_piece_diff(target, n_piece=32) > 0.0
        assert target.cached == []  # the probe leaves the context empty
        assert llm.generate("Say hi.", max_tokens=4, exact="bitwise").tokens  # the context works after it


def test_a_long_prompt_beside_a_stream_is_prefilled_in_pieces_between_its_rounds(model_paths, monkeypatch):
    """A request with a prompt of four prefill chunks arrives while another streams: once the
    piece probe measured pieces bitwise (warm_up runs it), the prompt goes in pieces of N_PIECE
    rows (PIECE_SECONDS 0: the smallest, on any machine) taking turns with the stream's rounds, so
    the stream moves on many times during the prefill, not once a chunk; and the prompt computes
    what a prefill alone does, logprobs bit for bit. The small model: the turns are the same
    whatever the model."""
    monkeypatch.setattr(batches, "PIECE_SECONDS", 0.0)
    settings = dict(SETTINGS, exact="bitwise")
    with specllama.load(model_paths["smollm2"], **settings) as alone, \
            specllama.load(model_paths["smollm2"], **settings) as llm:
        llm.warm_up()
        assert llm.pool.n_piece(llm.target) == N_PIECE
        long_prompt = llm.chat_tokens([{"role": "user", "content": LONG_STORY * 4 + "Continue the story."}])
        n_chunks = -(-len(long_prompt) // llm.target.n_batch)
        assert n_chunks >= 4, len(long_prompt)
        expected = list(alone.stream(long_prompt, max_tokens=4, logprobs=3))
        stamps: list[float] = []
        started, done = threading.Event(), threading.Event()

        def streaming():
            for _ in llm.stream(COUNTING, max_tokens=1500):  # goes on past the prefill
                stamps.append(time.perf_counter())
                if len(stamps) == 3:
                    started.set()
                if done.is_set():
                    break

        thread = threading.Thread(target=streaming)
        thread.start()
        assert started.wait(120)
        t0 = time.perf_counter()
        beside = llm.stream(long_prompt, max_tokens=4, logprobs=3)
        chunks = [next(beside)]
        t1 = time.perf_counter()  # its prefill is over
        chunks += list(beside)
        done.set()
        thread.join(300)
    during = [b - a for a, b in zip(stamps, stamps[1:]) if t0 <= b and a <= t1]
    n_rounds = sum(gap > 0.002 for gap in during)  # a round's tokens come together, rounds apart
    print(f"\nprefill of {len(long_prompt)} tokens ({n_chunks} chunks) beside a stream: "
          f"{beside.result.stats.t_prefill:.2f} s, the stream's rounds meanwhile {n_rounds}, its longest gap "
          f"{max(during):.2f} s")
    assert [(c.tokens, c.logprobs) for c in chunks] == [(c.tokens, c.logprobs) for c in expected]
    assert beside.result.stats.n_prompt_cached == 0
    # a round between most of its pieces (whole chunks let it move about n_chunks - 1 times: 6 here)
    assert n_rounds >= len(long_prompt) // (2 * N_PIECE)
    assert max(stamps) > t1  # the stream still ran when the prefill ended


@pytest.mark.children
def test_bench_parallel_reports_requests_at_once_against_one_at_a_time(model_paths, tmp_path):
    """`specllama bench --parallel 3`: the aggregate and the waits for a first token, at once and
    one after another. Sent together, the last request's first token comes after the others'
    first rounds, not after their whole answers."""
    prompts = tmp_path / "prompts.jsonl"
    asks = ["Count from one to one hundred in words.", "List the months of the year, one per line, with a fact "
            "about each.", "Write a long poem about the sea."]  # answers longer than -n
    prompts.write_text("".join(json.dumps({"prompt": ask}) + "\n" for ask in asks))
    out = subprocess.run([sys.executable, "-m", "specllama", "bench", str(model_paths["smollm2"]), "--draft", "none",
                          "--prompts", str(prompts), "-n", "96", "--repeats", "1", "--parallel", "3", "--json",
                          "--ctx", "1024", "-t", str(SETTINGS["n_threads"])], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    parallel = json.loads(out.stdout)["parallel"]
    assert parallel["n_requests"] == 3
    together, apart = parallel["at_once"], parallel["one_at_a_time"]
    assert together["tokens_per_s"] > 0 and apart["tokens_per_s"] > 0
    print(f"\n3 requests: the last first token after {together['longest_first_token_s']:.2f} s at once, "
          f"{apart['longest_first_token_s']:.2f} s one after another")
    assert together["longest_first_token_s"] < 0.5 * apart["longest_first_token_s"]


def test_one_request_at_a_time_where_slots_cannot_be_made(tiny_paths):
    """The target's MTP layers follow one context: requests decode one after another (the
    second thread waits for the slot), each with its own output."""
    with specllama.load(tiny_paths["hybrid-target"], "mtp", exact="bitwise", **SETTINGS) as llm:
        assert llm.pool.slots.n_max == 1 and "MTP" in llm.pool.slots.note
        prompts = [llm.tokenize("Hello there, friend"), llm.tokenize("One two three four")]
        solo = [llm.generate(p, max_tokens=16).tokens for p in prompts]
        assert [r.tokens for r in at_once(llm, prompts, max_tokens=16)] == solo


def test_hybrid_targets_decode_side_by_side(tiny_paths):
    """A hybrid (recurrent + attention) target: each slot has its own recurrent state."""
    with specllama.load(tiny_paths["hybrid-target"], tiny_paths["hybrid-draft"], exact="bitwise", **SETTINGS) as llm, \
            specllama.load(tiny_paths["hybrid-target"], exact="bitwise", **SETTINGS) as plain:
        prompts = [llm.tokenize(t) for t in ("Hello there, friend", "One two three four", "Hello there, friend")]
        solo = [plain.generate(p, max_tokens=24).tokens for p in prompts]
        results = at_once(llm, prompts, max_tokens=24)
        assert [r.tokens for r in results] == solo
        assert len({r.stats.slot for r in results}) == 3


def _stream_text(client, ask, max_tokens, stamps=None, stop_after=None):
    out, stream = [], client.chat.completions.create(model="m", messages=[{"role": "user", "content": ask}],
                                                     max_tokens=max_tokens, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            out.append(chunk.choices[0].delta.content)
            if stamps is not None:
                stamps.append(time.perf_counter())
            if stop_after is not None and len(out) >= stop_after:
                stream.close()  # the client disconnects mid-stream
                break
    return "".join(out)


def test_a_title_request_beside_a_streaming_answer_does_not_wait_for_it(served):
    """Open WebUI's pattern: a 16-token title request 0.5 s into a long streamed answer. It is
    served beside the answer, not after it, and the answer keeps its text."""
    client = openai.OpenAI(base_url=f"{served[0]}/v1", api_key=SERVER_KEY, max_retries=0, timeout=300)
    long_ask, title_ask = "Write a Python class for a binary search tree with insert and delete.", \
        "Give a four-word title for: binary search trees in Python"
    answer_alone = _stream_text(client, long_ask, 160)
    t0 = time.perf_counter()
    title_alone = client.chat.completions.create(model="m", messages=[{"role": "user", "content": title_ask}],
                                                 max_tokens=16, temperature=0).choices[0].message.content
    t_alone = time.perf_counter() - t0
    answer: dict = {}
    stamps: list[float] = []
    streaming = threading.Thread(target=lambda: answer.update(text=_stream_text(client, long_ask, 160, stamps)))
    streaming.start()
    time.sleep(0.5)
    t0 = time.perf_counter()
    title = client.chat.completions.create(model="m", messages=[{"role": "user", "content": title_ask}],
                                           max_tokens=16, temperature=0).choices[0].message.content
    t_beside, t_title_done = time.perf_counter() - t0, time.perf_counter()
    streaming.join(300)
    print(f"\ntitle alone {t_alone:.2f} s, beside a streaming answer {t_beside:.2f} s "
          f"({t_beside / t_alone:.2f}x); the answer streamed until {stamps[-1] - t0:.2f} s")
    assert title == title_alone and answer["text"] == answer_alone
    assert t_title_done < stamps[-1]  # one at a time, it would have waited for the whole answer


def test_a_client_leaving_mid_stream_leaves_the_others_unchanged(served):
    client = openai.OpenAI(base_url=f"{served[0]}/v1", api_key=SERVER_KEY, max_retries=0, timeout=300)
    asks = ["Count from one to thirty in words.", "Write a haiku about autumn rain."]
    alone = [_stream_text(client, ask, 48) for ask in asks]
    got = leave_beside(client, asks, 5)
    assert got["other"] == alone[1]
    assert alone[0].startswith(got["left"])
    assert _stream_text(client, asks[0], 48) == alone[0]  # and the server goes on as before


def leave_beside(client, asks: list[str], stop_after: int) -> dict:
    """Stream asks[0] and leave it after stop_after chunks, while asks[1] streams 48 tokens
    beside it: {"left": the first one's text so far, "other": the second's}."""
    got: dict = {}
    threads = [threading.Thread(target=lambda: got.update(left=_stream_text(client, asks[0], 400,
                                                                            stop_after=stop_after))),
               threading.Thread(target=lambda: got.update(other=_stream_text(client, asks[1], 48)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return got


def test_a_slot_made_for_one_request_is_never_taken_by_another(tiny_paths, monkeypatch):
    """Two slots, the first busy with an open stream: request A makes the second while request
    B, finding every slot busy, waits for one. B was woken once A's slot was made and took it
    before A marked it as its own, so both decoded in one slot (in a shared context, llama_decode
    failed with status -1: the same prompt decoded twice into one lane's sequence, in 3 of 6 runs
    of the concurrency benchmark; in contexts of their own, B's text silently changed). Each
    request gets a slot of its own (Pool's rule, the same for lanes)."""
    from specllama.scheduling.slots import Slots

    real_grow = Slots.grow

    def slow_grow(self, *args):  # the window between making the slot and owning it, made wide, and
        slot = real_grow(self, *args)  # in it what another thread does there (a stream ends, a slot is made)
        with llm.pool._cv:
            llm.pool._cv.notify_all()
        time.sleep(0.3)
        return slot

    with specllama.load(tiny_paths["attention-draft"], n_parallel=2, **SETTINGS) as llm:
        prompts = [llm.tokenize("Hello there, friend"), llm.tokenize("Once upon a time")]
        solo = [llm.generate(p, max_tokens=16).tokens for p in prompts]
        monkeypatch.setattr(Slots, "grow", slow_grow)
        held = llm.stream("One two three", max_tokens=8)
        next(held)  # the first slot is this stream's until it ends
        results: list = [None, None]

        def ask(i):
            results[i] = llm.generate(prompts[i], max_tokens=16)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        threads[0].start()
        time.sleep(0.1)  # A is making the second slot
        threads[1].start()
        threads[0].join(60)
        held.close()
        threads[1].join(60)
    assert [r.tokens if r is not None else None for r in results] == solo
