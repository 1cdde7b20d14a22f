"""Requests whose rows share passes (load(..., batch_requests=True)): lanes of one target
context, each round's rows of every lane in one llama_decode. Real models, real llama.cpp.

On this CPU the Q4_K_M target's lane rows differ from a context of its own by about 0.4
logits (measured at load), more than the rounding level allows, so the tests that batch ask
for a bound of 1.0 logits; what the default level does with them is tested too."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

import specllama
from conftest import SETTINGS
from specllama.errors import InvalidParameterError
from specllama.measuring.fidelity import parse_level
from specllama.measuring.planner import _working_clock
from specllama.runtime.shared import PASS_WINDOW, REFRESH_EVERY, Parking, PassCosts, SharedContext, _groups, _Job
from specllama.scheduling.slots import Turns
from test_concurrency import SCHEMA, at_once

BOUND = 1.0
ASKS = ["Write a Python function that reverses a linked list.", "Explain TCP slow start in two sentences.",
        "Give a four-word title for: baking sourdough bread", "Write a Python function that reverses a linked list."]


@pytest.fixture(scope="module")
def lanes(model_paths):
    with specllama.load(model_paths["target"], model_paths["draft"], n_draft=3, n_parallel=4, batch_requests=True,
                        exact=BOUND, **SETTINGS) as llm:
        yield llm


@pytest.fixture(scope="module")
def prompts(lanes):
    return [lanes.chat_tokens([{"role": "user", "content": ask}]) for ask in ASKS]


def _equal_or_near_tie(result, solo_tokens):
    """result's tokens equal solo's, or first differ where result counted a near-tie."""
    n = min(len(result.tokens), len(solo_tokens))
    first = next((i for i in range(n) if result.tokens[i] != solo_tokens[i]), None)
    if first is None:
        assert len(result.tokens) == len(solo_tokens) or result.finish_reason == "stop"
        return True
    assert first in result.stats.near_tie_positions, (first, result.stats.near_tie_positions)
    return False


def test_rows_of_four_requests_share_passes_and_each_matches_its_solo_run(lanes, plain, prompts):
    """Four greedy requests at once (two identical): their rounds' rows ride in shared passes
    (the target's verify rows, and the draft's steps), and each output is plain decoding's
    alone, or first differs at a near-tie it counted."""
    solo = [plain.generate(p, max_tokens=32).tokens for p in prompts]
    before, drafts_before = lanes.sharing.context.n_shared_passes, lanes.sharing.draft_context.n_shared_passes
    results = at_once(lanes, prompts, max_tokens=32)
    assert lanes.sharing.context.n_shared_passes - before >= 8, lanes.sharing.as_dict()
    assert lanes.sharing.draft_context.n_shared_passes > drafts_before, lanes.sharing.as_dict()  # draft steps too
    assert sorted(r.stats.slot for r in results) == [0, 1, 2, 3]
    same = [_equal_or_near_tie(r, s) for r, s in zip(results, solo)]
    assert sum(same) >= 2  # near-ties are rare: most requests are plain decoding's token for token
    assert results[0].tokens == results[3].tokens or results[0].stats.near_tie_positions


def test_default_level_keeps_q4_requests_in_contexts_of_their_own(lanes):
    """The Q4_K_M lane difference (measured at load) is over the rounding bound: requests at
    the default level, bitwise ones and seeded ones decode in slots of their own."""
    assert lanes.sharing.diff > 0
    assert not lanes.sharing.admits(parse_level("bitwise"), seeded=False)
    assert lanes.sharing.admits(parse_level(BOUND), seeded=False) == (lanes.sharing.diff <= BOUND)
    assert not lanes.sharing.admits(parse_level(BOUND), seeded=True)
    assert lanes.sharing.admits(parse_level("rounding"), seeded=False) == (lanes.sharing.diff <= 0.25)


def test_bitwise_request_beside_lanes_is_plain_decoding(lanes, plain, prompts):
    """A bitwise request among batched ones decodes in a context of its own: token for token
    plain decoding, however the lanes' passes ran beside it."""
    solo = plain.generate(prompts[1], max_tokens=32).tokens
    options = [dict(max_tokens=32, exact="bitwise"), dict(max_tokens=32), dict(max_tokens=32)]
    results = at_once(lanes, [prompts[1], prompts[0], prompts[2]], per_prompt=options)
    assert results[0].tokens == solo
    assert results[0].stats.fidelity == "bitwise"


def test_seeded_sampling_gives_the_same_text_alone_and_beside_lanes(lanes, prompts):
    alone = lanes.generate(prompts[2], max_tokens=24, temperature=0.8, seed=11)
    options = [dict(max_tokens=24, temperature=0.8, seed=11), dict(max_tokens=24), dict(max_tokens=24)]
    results = at_once(lanes, [prompts[2], prompts[0], prompts[1]], per_prompt=options)
    assert results[0].text == alone.text


def test_constrained_request_in_a_lane_keeps_its_schema(lanes, prompts):
    import json

    ask = lanes.chat_tokens([{"role": "user", "content": "Give a JSON object with a name and an age."}])
    options = [dict(max_tokens=48, json_schema=SCHEMA), dict(max_tokens=32), dict(max_tokens=32)]
    results = at_once(lanes, [ask, prompts[0], prompts[1]], per_prompt=options)
    value = json.loads(results[0].text)
    assert isinstance(value["name"], str) and isinstance(value["age"], int)


def test_a_closed_stream_frees_its_lane_and_leaves_the_others_unchanged(lanes, plain, prompts):
    solo = plain.generate(prompts[0], max_tokens=32).tokens
    stream = lanes.stream(prompts[2], max_tokens=64)
    started = threading.Event()
    results: list = [None]

    def other():
        started.wait(60)
        results[0] = lanes.generate(prompts[0], max_tokens=32)

    thread = threading.Thread(target=other)
    thread.start()
    for i, _ in enumerate(stream):
        if i == 0:
            started.set()
        if i == 4:
            stream.close()
            break
    thread.join(300)
    _equal_or_near_tie(results[0], solo)
    again = lanes.generate(prompts[0], max_tokens=8)  # the lane is free, and its cache serves
    assert again.stats.n_prompt_cached > 0
    assert lanes.pool.lanes.n_busy == 0


def test_a_short_conversation_keeps_its_lane_when_another_prompt_arrives(model_paths):
    """A chat UI's title (prompt and answer under the 64 tokens the prompt cache saves) stays
    live in its lane: a request with another prompt gets a lane of its own rather than drop it,
    so the title asked again reuses its whole prompt (before, the next request took the
    title's lane and the title was prefilled again, 0.7 s of an F16 title's 1 s here)."""
    with specllama.load(model_paths["target"], model_paths["draft"], n_parallel=2, batch_requests=True,
                        exact=BOUND, **SETTINGS) as llm:
        # no chat template: a long shared header keeps more than a short conversation drops
        title, answer = (llm.tokenize(text) for text in ("A four-word title for baking sourdough bread:",
                                                          "TCP slow start, explained in two sentences:"))
        first = llm.generate(title, max_tokens=4)
        assert len(title) + 4 < 64  # under what the prompt cache saves
        same = llm.generate(title, max_tokens=4)  # the same prompt again keeps its lane
        other = llm.generate(answer, max_tokens=4)
        again = llm.generate(title, max_tokens=4)
        assert other.stats.slot != first.stats.slot == same.stats.slot == again.stats.slot
        assert same.stats.n_prompt_cached == again.stats.n_prompt_cached == again.stats.n_prompt
        assert again.tokens == first.tokens


def test_groups_respect_the_batch_and_every_members_cap():
    """Pure: parked batches go in arrival order into passes of at most n_batch rows, and no pass
    holds more rows than any of its members allows; a batch over its own cap goes alone."""
    def job(n, cap):
        return _Job([(1, i, (0,), True) for i in range(n)], cap)

    jobs = [job(1, 8), job(3, 8), job(4, 8), job(2, 3), job(10, 1), job(1, 16)]
    sizes = [[len(j.items) for j in g] for g in _groups(jobs, 512)]
    assert sizes == [[1, 3, 4], [2], [10], [1]]
    assert [[len(j.items) for j in g] for g in _groups([job(300, 512), job(300, 512)], 512)] == [[300], [300]]
    assert [len(g) for g in _groups([job(1, 4)] * 6, 512)] == [4, 2]


def test_lanes_batches_go_apart_only_where_their_passes_were_timed_cheaper_apart():
    """Pure: two lanes' one-row steps go in passes of their own once one pass of both was timed
    at more than the two alone (the 0.5B Q4_K_M draft here: 48 ms against 17 ms each), and
    together where it was cheaper (the F16 target's 2 rows: 115 ms against 82 each); untimed
    shapes go together, and one group in REFRESH_EVERY goes together to stay timed."""
    draft, target = PassCosts(), PassCosts()
    assert not draft.apart([1, 1])  # nothing timed yet: together
    for _ in range(3):
        draft.observe(1, 1, 0.017)
        draft.observe(2, 2, 0.048)
        draft.observe(4, 4, 0.057)  # four lanes' steps: one pass is cheaper than four
        target.observe(1, 1, 0.082)
        target.observe(2, 2, 0.115)
    assert not draft.apart([1, 1, 1, 1]) and not target.apart([1, 1])
    assert not draft.apart([2, 2])  # two rows alone never timed
    decided = [draft.apart([1, 1]) for _ in range(2 * REFRESH_EVERY)]
    assert decided.count(False) == 2 and decided[REFRESH_EVERY - 1] is False
    draft.observe(70, 1, 0.3)
    assert draft.cost(70, 1) is None  # a prompt chunk is no step's shape


def test_lanes_timed_cheaper_apart_decode_apart_with_the_same_outputs(lanes, plain, prompts, monkeypatch):
    """Two requests whose contexts (target and draft) timed every pass of two lanes dearer
    than the lanes' passes alone: their parked batches are decoded a pass each, through real
    llama.cpp, and each output is still plain decoding's alone (or first differs at a counted
    near-tie)."""
    solo = [plain.generate(p, max_tokens=24).tokens for p in prompts[:2]]
    contexts = (lanes.sharing.context, lanes.sharing.draft_context)
    for context in contexts:
        timed = PassCosts()
        for _ in range(3):
            for n in range(1, 33):
                timed.observe(n, 1, 0.001)
        for _ in range(PASS_WINDOW):
            for n in range(2, 65):
                timed.observe(n, 2, 1.0)
        monkeypatch.setattr(context, "pass_costs", timed)
    results = at_once(lanes, prompts[:2], max_tokens=24)
    assert all(context.pass_costs._n_apart > 0 for context in contexts)
    for result, tokens in zip(results, solo):
        _equal_or_near_tie(result, tokens)


def test_lanes_plan_for_their_share_of_the_pass(lanes, prompts, monkeypatch):
    """Two requests at once, through real llama.cpp: each lane's rounds are planned with the
    rows of its pass it may fill being its share (cap // the lanes generating, and the shares of
    lanes decoding plainly), not all the room the other lane's last batch left: two lanes
    planning for that room overflowed the pass. Each round is priced from what its verify pass
    held (the Pass its decode returned), other lanes' rows included."""
    import specllama.decoding.decode as decode

    shares, planned, passes = [], [], []
    room, outcome_of, record = SharedContext.room, decode.RoundOutcome, decode._record

    def spy_room(self, base, cap):
        n = room(self, base, cap)
        shares.append((cap, self.n_active(), n))
        return n

    def spy_outcome(*args, **kwargs):
        outcome = outcome_of(*args, **kwargs)
        planned.append(outcome.n_cap - outcome.n_other)
        return outcome

    def spy_record(d, r, path, new, times, done, cap):
        passes.append((r.n_pending + len(r.proposal.tokens) + 1, done, cap))
        return record(d, r, path, new, times, done, cap)

    monkeypatch.setattr(SharedContext, "room", spy_room)
    monkeypatch.setattr(decode, "RoundOutcome", spy_outcome)
    monkeypatch.setattr(decode, "_record", spy_record)
    at_once(lanes, prompts[:2], max_tokens=24)
    assert all(n_own <= done.n_rows <= max(cap, n_own) and done.n_lanes in (1, 2) for n_own, done, cap in passes)
    assert any(done.n_lanes == 2 and done.n_rows > n_own for n_own, done, _ in passes), passes  # the other's rows too
    assert any(n_active == 2 for _, n_active, _ in shares)
    for cap, n_active, n in shares:  # a lane alone: the cap; else its share and the plain lanes'
        assert n == cap if n_active == 1 else max(1, cap // n_active) <= n <= cap - (n_active - 1)
    assert planned and set(planned) <= {n for _, _, n in shares}
    assert any(n < cap for cap, _, n in shares)  # a share, not the whole pass


def test_the_target_s_pass_lets_parked_draft_steps_go_first():
    """Pure: every lane parked, one at the target's pass and one at a draft step: the draft's
    step is decoded first (the drafting lane then reaches the same verify pass instead of the
    target decoding each lane's rows alone); the draft's steps never wait for the target."""
    target, draft = object.__new__(SharedContext), object.__new__(SharedContext)
    parking = Parking()
    for context in (target, draft):
        context.parking, context._parked, context._cv = parking, [], threading.Condition()
        context.turn, context.n_active = Turns(), lambda: 2
        parking.contexts.append(context)
    at_verify, at_step = _Job([(1, 0, (0,), True)] * 4, 8), _Job([(1, 0, (4,), True)], 8)
    target._parked.append(at_verify)
    later = time.perf_counter() + 60
    assert target._now(at_verify, later) is None  # the other lane is on its way
    draft._parked.append(at_step)
    assert target._now(at_verify, later) is False and draft._now(at_step, later) is True
    draft._parked.clear()  # its step decoded, it reached the pass: both lanes' rows go in one
    target._parked.append(_Job([(1, 0, (4,), True)] * 4, 8))
    assert target._now(at_verify, later) is True


def test_a_lane_s_draft_steps_are_timed_without_its_waits():
    """Pure: the controller's clock leaves out what the draft's decodes waited for other lanes'
    passes, so a draft step under load is priced at its own pass, not at the others' too."""
    draft = SimpleNamespace(t_waited_total=0.0)
    clock = _working_clock(draft)
    t0 = clock()
    draft.t_waited_total += 0.5  # a step that waited half a second for another lane's pass
    assert clock() - t0 < 0.1
    assert _working_clock(None) is time.perf_counter


def test_a_lane_s_share_of_a_shared_pass_is_its_rows_share():
    """Pure: two draft lanes' steps in one pass of the 0.5B draft took 42-57 ms against 18 ms for
    one; each lane priced its steps at the whole pass (the controller's clock counted it all),
    so beside another lane a draft step looked 2-3x its cost and the lanes decoded plainly."""
    job = _Job([], 8)
    job.seconds, job.n_rows = 0.042, 2
    assert job.for_others(1) == pytest.approx(0.021)
    job.n_rows = 6  # its 4 verify rows beside another lane's 2
    assert job.for_others(4) == pytest.approx(0.014)
    job.n_rows = 1  # its row alone
    assert job.for_others(1) == 0.0


def test_batch_requests_is_checked(model_paths):
    with pytest.raises(InvalidParameterError, match="batch_requests"):
        specllama.load(model_paths["target"], batch_requests="yes", **SETTINGS)


def test_auto_makes_lanes_only_where_the_load_s_level_allows_them(model_paths, lanes, monkeypatch):
    """batch_requests="auto" (serve's default): lanes only where the lane rows' difference (the
    lanes fixture measured and cached it) is within the load's level. The Q4_K_M target's differ by
    about 0.4 logits on our CPUs, over the rounding bound: no lanes are made, no lane memory is
    taken, and the note says why; at a bound that allows it they are. Read from the measurement,
    so a machine where they differ less makes lanes at rounding and the test says so."""
    from specllama.measuring.concurrency_probes import cached_apart_diff
    from specllama.runtime import shared

    made = []
    init = shared.SharedContext.__init__
    monkeypatch.setattr(shared.SharedContext, "__init__", lambda self, *a, **k: made.append(1) or init(self, *a, **k))
    with specllama.load(model_paths["target"], n_parallel=4, batch_requests="auto", **SETTINGS) as llm:
        diff = cached_apart_diff(llm.target, 4)
        assert diff is not None  # measured by the lanes fixture, and read here
        if diff > parse_level("rounding").bound:
            assert llm.sharing is None and llm.pool.lanes is None and not made  # the cached difference decided
            assert "over the rounding level's bound" in llm.sharing_note
        else:
            assert llm.sharing is not None and made
        assert [len(r.tokens) for r in at_once(llm, ["Hello there", "Once upon a time"], max_tokens=6)] == [6, 6]
    with specllama.load(model_paths["target"], n_parallel=4, batch_requests="auto", exact=BOUND, **SETTINGS) as llm:
        assert llm.sharing is not None and llm.sharing_note == "" and made


def test_auto_measures_the_difference_before_it_makes_the_draft_s_lanes(model_paths, monkeypatch, tmp_path):
    """Where the difference is not cached yet, "auto" measures it on the target's shared context
    alone and, over the bound, makes nothing more: no draft shared context, no lane slots."""
    from specllama.runtime import shared

    monkeypatch.setenv("SPECLLAMA_HOME", str(tmp_path))  # nothing measured yet
    made = []
    init = shared.SharedContext.__init__
    monkeypatch.setattr(shared.SharedContext, "__init__", lambda self, *a, **k: made.append(1) or init(self, *a, **k))
    with specllama.load(model_paths["target"], model_paths["draft"], n_parallel=4, batch_requests="auto",
                        idle_work=False, **SETTINGS) as llm:
        assert llm.sharing is None and llm.pool.lanes is None and made == [1], made
        assert "over the rounding level's bound" in llm.sharing_note


def test_auto_says_when_memory_left_no_room_for_lanes(model_paths, monkeypatch):
    """Where the memory plan drops the lanes, sharing_note (and so /health) says that, not ""."""
    from specllama import loader

    monkeypatch.setattr(loader, "plan_lanes", lambda plan, n_lanes, required: (plan(0), 0))
    with specllama.load(model_paths["target"], n_parallel=4, batch_requests="auto", exact=BOUND, **SETTINGS) as llm:
        assert llm.sharing is None and "do not fit in the memory free now" in llm.sharing_note


def test_auto_lanes_give_way_where_memory_is_short():
    """Lanes that do not fit are dropped with "auto" (the plan without them), kept with True (the
    plan then fails with its ways out)."""
    from specllama.models.plan import plan_lanes

    plans = {0: SimpleNamespace(fits=True), 4: SimpleNamespace(fits=False)}
    assert plan_lanes(plans.__getitem__, 4, required=False) == (plans[0], 0)
    assert plan_lanes(plans.__getitem__, 4, required=True) == (plans[4], 4)
    plans[4].fits = True
    assert plan_lanes(plans.__getitem__, 4, required=False) == (plans[4], 4)
    assert plan_lanes(plans.__getitem__, 0, required=False) == (plans[0], 0)


def test_hybrid_and_mtp_targets_decode_apart_and_say_why(tiny_paths, caplog):
    """A hybrid target's recurrent state rolls back per context, and MTP layers follow one
    target context: with batch_requests they keep contexts of their own, and the log says why."""
    import logging

    with caplog.at_level(logging.INFO, logger="specllama"):
        with specllama.load(tiny_paths["hybrid-target"], batch_requests=True, n_parallel=2, **SETTINGS) as llm:
            assert llm.sharing is None
            results = at_once(llm, ["Hello there", "Once upon a time"], max_tokens=8)
            assert all(len(r.tokens) == 8 for r in results)
    assert "requests do not share passes" in caplog.text and "memory" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="specllama"):
        with specllama.load(tiny_paths["hybrid-target"], "mtp", batch_requests=True, n_parallel=2, **SETTINGS) as llm:
            assert llm.sharing is None and len(llm.generate("Hello", max_tokens=4).tokens) == 4
    assert "requests do not share passes: the target's MTP layers follow one target context" in caplog.text


def test_lanes_without_flash_attention_say_what_they_cost(tiny_paths, caplog):
    """Without flash attention llama.cpp's attention reads every cell up to the highest in use,
    other lanes' too (the draft's step twice as slow beside three long histories): loading lanes
    so says, once, and names the setting."""
    import logging

    for flash_attn, n_warned in ((False, 1), (None, 0)):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="specllama"):
            with specllama.load(tiny_paths["attention-draft"], batch_requests=True, n_parallel=2,
                                flash_attn=flash_attn, **SETTINGS) as llm:
                assert llm.sharing is not None
        assert caplog.text.count("lanes with flash_attn=False") == n_warned


@pytest.mark.children
def test_served_by_default_with_lanes_a_leaving_client_leaves_the_other_unchanged(model_paths, tmp_path):
    """`serve` at a level that allows a lane's difference makes lanes by default: two streamed
    chats at once share passes (/health counts them); one client leaving mid-stream leaves the
    other's text as it is alone; the server goes on."""
    import httpx
    import openai

    from serving import serve
    from test_concurrency import _stream_text, leave_beside

    with serve(model_paths["target"], tmp_path / "serve.log", "--draft", str(model_paths["draft"]),
               "--exact", str(BOUND), "--api-key", "k") as (base, _):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0, timeout=300)
        asks = ["Count from one to thirty in words.", "Write a haiku about autumn rain."]
        alone = _stream_text(client, asks[1], 48)
        got = leave_beside(client, asks, 8)
        health = httpx.get(f"{base}/health", timeout=10).json()
        assert health["batch_requests"]["n_shared_passes"] > 0, health
        if got["other"] != alone:  # only where a near-tie was counted (a lane's rows carry their difference)
            metrics = httpx.get(f"{base}/metrics", timeout=10, headers={"Authorization": "Bearer k"}).text
            counted = [line for line in metrics.splitlines() if line.startswith("specllama_near_ties_total")]
            assert counted and float(counted[0].split()[-1]) > 0, (got["other"], alone)
        assert _stream_text(client, asks[1], 48) == alone
        assert httpx.get(f"{base}/health", timeout=10).json()["requests_active"] == 0


def test_a_lane_s_prefill_never_passes_for_a_fresh_one(lanes):
    """A lane's rows differ from a context of its own (other lanes' cells sit between its own),
    so nothing it prefills is marked canonical: a state saved from a lane (the lanes' and the
    slots' caches share their saved states) never restores as exact for a bitwise or seeded
    request, whose output must be a fresh prefill's."""
    fresh = [[1000 + 37 * i + j for j in range(80)] for i in range(4)]  # nothing in common with any lane's
    before = lanes.sharing.context.n_shared_passes
    at_once(lanes, fresh, max_tokens=4)
    assert lanes.sharing.context.n_shared_passes > before  # they decoded in lanes
    rows = [runtime.prefill_row for runtime in lanes.sharing.context.lanes]
    assert len(rows) == 4 and all(row is not None and not row.canonical for row in rows), rows
    assert all(runtime.n_canonical == 0 for runtime in lanes.sharing.context.lanes)
