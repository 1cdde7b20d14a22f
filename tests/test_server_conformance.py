"""What real clients send to `specllama serve`, row by row: content parts, any model name,
context overflow, stream shapes, n choices, CORS, abandoned requests, and random bodies.

Two real servers: the pair with an API key and no CORS origins (the default), and the target
alone with --strict-model and allowed origins."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import openai
import pytest

from conftest import SERVER_KEY, SERVER_MODEL
from serving import metric, post, serve

KEY = SERVER_KEY
ASK = [{"role": "user", "content": "What is\nthe best book"}]
PARTS = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book"}]}]
N = 12
ORIGIN = "http://localhost:3000"


@pytest.fixture(scope="module")
def server(served):
    return served[0]


@pytest.fixture(scope="module")
def strict(model_paths, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "strict.log"
    # one slot: requests beyond the first wait in a queue (the pair's server decodes 4 at once)
    with serve(model_paths["target"], log, "--draft", "none", "--model-id", SERVER_MODEL, "--strict-model",
               "--cors-origins", f"{ORIGIN},http://127.0.0.1:5173", "--parallel", "1") as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat(client, messages, **kw):
    return client.chat.completions.create(model=SERVER_MODEL, messages=messages, temperature=0, max_tokens=N, **kw)


def test_content_parts_are_joined_as_text(client):
    """The parts answer exactly what their text joined with a newline answers (llama.cpp's join)."""
    joined = chat(client, ASK).choices[0].message.content
    assert joined and chat(client, PARTS).choices[0].message.content == joined


BAD_MESSAGES = [
    ("content of a wrong type", [{"role": "user", "content": 123}], "messages.0.content"),
    ("an empty message", [{}], "messages.0.role"),
    ("a role that is not a string", [{"role": 123, "content": "hi"}], "messages.0.role"),
    ("an unknown role", [{"role": "wizard", "content": "hi"}], "messages.0.role"),
    ("a malformed second message", [{"role": "system", "content": "Be brief."}, {}], "messages.1.role"),
    ("an unknown content part", [{"role": "user", "content": [{"type": "hologram"}]}], "messages.0.content.0.type"),
    ("a part without text", [{"role": "user", "content": [{"type": "text"}]}], "messages.0.content.0.text"),
    ("a tool result without its call id", [{"role": "user", "content": "hi"}, {"role": "tool", "content": "17"}],
     "messages.1.tool_call_id"),
    ("a message that is not an object", ["hello"], "messages.0"),
    ("no messages", [], "messages"),
]


@pytest.mark.parametrize("name, messages, param", BAD_MESSAGES, ids=[b[0] for b in BAD_MESSAGES])
def test_a_malformed_message_is_a_400_naming_the_field(server, name, messages, param):
    r = post(server, "/v1/chat/completions", {"model": "x", "messages": messages, "max_tokens": 2}, KEY)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and param in error["message"]


def test_a_json_body_sent_as_a_form_is_a_400_that_names_the_header(server):
    """`curl URL -d '{...}'` without -H sends application/x-www-form-urlencoded."""
    body = json.dumps({"messages": ASK, "max_tokens": 2})
    for path in ("/v1/chat/completions", "/v1/messages"):
        r = httpx.post(f"{server}{path}", content=body, timeout=30, headers={
            "Authorization": f"Bearer {KEY}", "Content-Type": "application/x-www-form-urlencoded"})
        assert r.status_code == 400, r.text
        assert "Content-Type: application/json" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/chat/completions", content="[1, 2]", timeout=30, headers={
        "Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})  # JSON, the wrong shape
    assert r.status_code == 400 and "Content-Type" not in r.json()["error"]["message"]


def test_an_image_is_refused_as_not_supported(server):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [image]}]}, KEY)
    assert r.status_code == 400 and "not supported" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages.0.content.0.type"


def test_the_developer_role_is_the_system_role(client):
    system = [{"role": "system", "content": "Answer in French."}, *ASK]
    developer = [{"role": "developer", "content": "Answer in French."}, *ASK]
    assert chat(client, developer).choices[0].message.content == chat(client, system).choices[0].message.content


def test_any_model_name_is_served_under_the_served_id(client):
    r = client.chat.completions.create(model="gpt-3.5-turbo", messages=ASK, temperature=0, max_tokens=4)
    assert r.model == SERVER_MODEL and r.choices[0].message.content
    assert [m.id for m in client.models.list().data] == [SERVER_MODEL]


def test_strict_model_answers_404_for_another_name(strict):
    r = post(strict, "/v1/chat/completions", {"model": "gpt-3.5-turbo", "messages": ASK, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert post(strict, "/v1/chat/completions", {"model": SERVER_MODEL, "messages": ASK, "max_tokens": 2}) \
        .status_code == 200


def test_a_prompt_longer_than_the_context_is_a_400_clients_catch(server, client):
    r = post(server, "/v1/completions", {"prompt": "word " * 5000}, KEY)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["n_ctx"] == 2048
    assert error["n_prompt_tokens"] > 2048
    with pytest.raises(openai.BadRequestError):  # what clients catch to trim the history
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "word " * 5000}])


def test_stream_chunks_have_openai_shapes(client):
    chunks = list(client.chat.completions.create(model="any", messages=ASK, temperature=0, max_tokens=N, stream=True,
                                                 stream_options={"include_usage": True}))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content == ""  # a client reading delta["content"] raw works
    assert all(c.system_fingerprint for c in chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == N
    assert usage_chunk.model_extra["timings"]["predicted_n"] == N
    whole = chat(client, ASK)
    assert whole.system_fingerprint and "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) \
        == whole.choices[0].message.content


def test_n_greedy_choices_are_identical_and_all_counted(client):
    r = client.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=N, n=3)
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 1 and texts[0]
    assert r.usage.completion_tokens == 3 * N and r.usage.prompt_tokens == chat(client, ASK).usage.prompt_tokens


def test_n_sampled_choices_each_have_their_own_seed(client):
    kw = dict(model="m", messages=[{"role": "user", "content": "Name a colour."}], temperature=1.0, max_tokens=N)
    both = client.chat.completions.create(n=2, seed=11, **kw)
    runs = [client.chat.completions.create(seed=seed, **kw) for seed in (11, 12)]
    alone = [r.choices[0].message.content for r in runs]
    assert [c.message.content for c in both.choices] == alone
    assert both.usage.completion_tokens == sum(r.usage.completion_tokens for r in runs)
    streamed = client.chat.completions.create(n=2, seed=11, stream=True, **kw)
    texts = ["", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == alone


def test_n_out_of_range_is_a_400(server):
    r = post(server, "/v1/chat/completions", {"messages": ASK, "n": 0}, KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_completions_take_a_list_of_prompts(client):
    prompts = ["def add(a, b):", "The capital of France is"]
    r = client.completions.create(model="m", prompt=prompts, temperature=0, max_tokens=6)
    alone = [client.completions.create(model="m", prompt=p, temperature=0, max_tokens=6).choices[0].text
             for p in prompts]
    assert [c.index for c in r.choices] == [0, 1] and [c.text for c in r.choices] == alone


def test_cors_preflight_is_answered_without_a_key(strict, server):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(f"{strict}/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    answer = post(strict, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2}, headers={"Origin": ORIGIN})
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == ORIGIN
    # the other server allows no origin (the default): the preflight is refused, never a 401 or 405
    refused = httpx.options(f"{server}/v1/chat/completions", headers=preflight)
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    other = httpx.options(f"{strict}/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers


def test_an_abandoned_request_is_cancelled_and_the_queue_moves_on(server):
    short = {"model": "m", "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    post(server, "/v1/completions", short, KEY)  # warm: the prompt is cached like the one below
    t0 = time.perf_counter()
    post(server, "/v1/completions", short, KEY)
    alone = time.perf_counter() - t0
    generated = metric(server, "specllama_generated_tokens_total", KEY)
    cancelled = metric(server, 'specllama_requests_cancelled_total{endpoint="/v1/completions"}', KEY)
    long = {"model": "m", "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 1500, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up; its connection closes
        post(server, "/v1/completions", long, KEY, timeout=2.0)
    t0 = time.perf_counter()
    r = post(server, "/v1/completions", short, KEY)
    after = time.perf_counter() - t0
    assert r.status_code == 200
    print(f"\nafter an abandoned request the next one took {after:.2f} s, alone {alone:.2f} s")
    # without cancellation the short request would wait for ~1,500 tokens (a minute or more here)
    assert after < alone + 3.0, (after, alone)
    assert metric(server, 'specllama_requests_cancelled_total{endpoint="/v1/completions"}', KEY) == cancelled + 1
    assert metric(server, "specllama_generated_tokens_total", KEY) - generated < 300


def test_a_request_whose_client_left_while_queued_never_runs(strict):
    body = {"model": SERVER_MODEL, "prompt": "1, 2, 3, 4, 5, 6,", "max_tokens": 60, "temperature": 0}
    generated = metric(strict, "specllama_generated_tokens_total")
    first = threading.Thread(target=post, args=(strict, "/v1/completions", body))
    first.start()
    time.sleep(0.5)
    assert json.loads(httpx.get(f"{strict}/health").text)["requests_active"] == 1
    with pytest.raises(httpx.ReadTimeout):  # queued behind the first (one slot), then gone
        post(strict, "/v1/completions", {**body, "max_tokens": 500}, timeout=0.5)
    first.join(120)
    time.sleep(1.0)
    assert metric(strict, "specllama_generated_tokens_total") - generated <= 60
    assert metric(strict, "specllama_requests_queued") == 0


def test_unknown_paths_and_methods_get_json_errors(server):
    r = httpx.get(f"{server}/v1/nothing-here", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and r.json()["error"]["message"]


# --- fuzz: random bodies never get a 500, and the server answers as before afterwards ---------

FIELDS = {"model": "m", "max_tokens": 2, "temperature": 0, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "n": 1,
          "stop": ["\n"], "seed": 1, "stream": False, "stream_options": {"include_usage": True}, "n_draft": 2,
          "speculative": True, "response_format": {"type": "text"}, "grammar": None, "logit_bias": {"15": 1.0},
          "frequency_penalty": 0.0, "presence_penalty": 0.0, "repeat_penalty": 1.0, "logprobs": None}
CHAT_FIELDS = {**FIELDS, "messages": ASK, "tools": None, "tool_choice": None, "top_logprobs": None,
               "max_completion_tokens": 2, "parallel_tool_calls": None}
COMPLETION_FIELDS = {**FIELDS, "prompt": "Hello"}


def wrong_value(rng: random.Random, depth: int = 0):
    """A value of some type, often the wrong one: nested, huge, odd numbers, odd text."""
    choices = [None, True, -1, 0, 2**70, -2**70, 1e308, -0.5, "", "x" * rng.choice([1, 100, 200_000]),
               "\ud83d\ude00 \u0000 \ufffd", [], {}, [1, "a", None], {"type": 7}, {"role": "user"}]
    if depth < 3:
        choices += [[wrong_value(rng, depth + 1)], {"k": wrong_value(rng, depth + 1)}]
    return rng.choice(choices)


def fuzz_bodies(rng: random.Random, n: int):
    for i in range(n):
        path, base = rng.choice([("/v1/chat/completions", CHAT_FIELDS), ("/v1/completions", COMPLETION_FIELDS)])
        body = {k: v for k, v in base.items() if v is not None}
        kind = i % 10
        if kind < 7:  # one to three fields of a wrong type
            for name in rng.sample(sorted(base), rng.randint(1, 3)):
                body[name] = wrong_value(rng)
            max_tokens = body.get("max_tokens")
            if isinstance(max_tokens, int) and max_tokens > 4:
                body["max_tokens"] = 4  # a valid body must stay short to run
            body["max_completion_tokens"] = 2 if path.endswith("chat/completions") else None
            yield path, json.dumps({k: v for k, v in body.items() if v is not None})
        elif kind == 7:  # deep nesting
            yield path, "[" * 100_000 + "]" * 100_000
        elif kind == 8:  # invalid UTF-8 and truncated JSON
            yield path, rng.choice([b'{"prompt": "\xff\xfe\xfa"}', b'{"messages": [{"role": "user", "content": "\xc3',
                                    b"\x00\x01\x02", b'{"prompt": "a",'])
        else:  # a message list of random objects
            yield path, json.dumps({"messages": [wrong_value(rng) for _ in range(rng.randint(1, 4))],
                                    "max_tokens": 2, "prompt": wrong_value(rng)})


def test_random_bodies_get_json_4xx_or_200_and_the_server_answers_as_before(server, client):
    before = chat(client, ASK).choices[0].message.content
    statuses = {}
    for path, body in fuzz_bodies(random.Random(28), 200):
        r = post(server, path, body, KEY, timeout=120)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, body[:300], r.text[:500])
        payload = r.json()  # JSON either way
        if r.status_code != 200:
            assert payload["error"]["message"], r.text
    assert statuses.get(200, 0) > 0 and sum(v for k, v in statuses.items() if k >= 400) > 100, statuses
    assert httpx.get(f"{server}/health").status_code == 200
    assert chat(client, ASK).choices[0].message.content == before
