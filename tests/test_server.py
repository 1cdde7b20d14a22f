"""A real `specllama serve` on a free 127.0.0.1 port, driven by the real openai client."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from prompts import CODE
from specllama.measuring.fidelity import parse_level
from conftest import SERVER_KEY
from serving import post as post_to

KEY = SERVER_KEY
MESSAGES = [{"role": "user", "content": "Write a Python function that reverses a string."}]
N_TOKENS = 24


@pytest.fixture(scope="module")
def server(served):
    """The session's server; (base url, /health statuses seen while it started)."""
    return served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def expected_chat(pair):
    return pair.chat(MESSAGES, max_tokens=N_TOKENS)


def test_health_says_loading_then_ok(server):
    base, seen = server
    assert 503 in seen, seen  # asked while the model was still loading
    health = httpx.get(f"{base}/health").json()  # no key needed
    assert health["status"] == "ok" and health["slots"] == 4
    assert set(health) == {"status", "slots", "requests_active", "requests_queued", "batch_requests"}
    # serve batches requests by default where the level allows what a lane's rows carry: the Q4_K_M
    # target's lanes differ by about 0.4 logits on our CPUs, over the rounding bound, so its requests
    # take turns; a machine where they differ less serves lanes, within the bound
    shared = health["batch_requests"]
    if shared["n_lanes"] == 0:
        assert "over the rounding level's bound" in shared["why"], health
    else:
        assert shared["apart_diff"] <= parse_level("rounding").bound, health


def test_models_lists_the_target(client):
    (model,) = client.models.list().data
    assert model.id == "qwen-test" and model.object == "model" and model.owned_by and model.created > 0


def test_chat_equals_spec_llama_chat_with_usage_and_draft_timings(client, pair, expected_chat):
    r = client.chat.completions.create(model="qwen-test", messages=MESSAGES, temperature=0, max_tokens=N_TOKENS,
                                       extra_body={"n_draft": 2})
    assert r.choices[0].message.content == expected_chat.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(pair.chat_tokens(MESSAGES))
    assert r.usage.completion_tokens == len(expected_chat.tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    timings = r.model_extra["timings"]
    assert timings["draft_n"] > 0 and timings["draft_n_accepted"] > 0
    assert timings["predicted_n"] == N_TOKENS and timings["predicted_per_second"] > 0


def test_speculative_false_turns_drafting_off_for_one_request(client, expected_chat):
    r = client.chat.completions.create(model="qwen-test", messages=MESSAGES, temperature=0, max_tokens=N_TOKENS,
                                       extra_body={"speculative": False})
    assert r.choices[0].message.content == expected_chat.text
    assert r.model_extra["timings"]["draft_n"] == 0


def test_streamed_chat_with_usage(client, expected_chat):
    chunks = list(client.chat.completions.create(
        model="qwen-test", messages=MESSAGES, temperature=0, max_tokens=N_TOKENS, stream=True,
        stream_options={"include_usage": True}, extra_body={"n_draft": 3}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_chat.text
    last_choice = [c for c in chunks if c.choices][-1]
    assert last_choice.choices[0].finish_reason == "length"
    assert last_choice.model_extra["timings"]["draft_n"] > 0
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N_TOKENS


def test_completions_plain_and_streamed(client, pair):
    expected = pair.generate(CODE, max_tokens=N_TOKENS)
    r = client.completions.create(model="qwen-test", prompt=CODE, temperature=0, max_tokens=N_TOKENS)
    assert r.choices[0].text == expected.text and r.object == "text_completion"
    assert r.usage.completion_tokens == len(expected.tokens)
    streamed = list(client.completions.create(model="qwen-test", prompt=CODE, temperature=0,
                                              max_tokens=N_TOKENS, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected.text
    assert streamed[-1].choices[0].finish_reason == "length"


def test_two_concurrent_requests_each_get_the_answer_they_get_alone(client, expected_chat):
    done: dict[str, tuple[float, str]] = {}

    def ask(name: str) -> None:
        r = client.chat.completions.create(model="qwen-test", messages=MESSAGES, temperature=0,
                                           max_tokens=N_TOKENS, extra_body={"n_draft": 2})
        done[name] = (time.monotonic(), r.choices[0].message.content)

    first = threading.Thread(target=ask, args=("first",))
    second = threading.Thread(target=ask, args=("second",))
    first.start()
    time.sleep(0.3)
    second.start()
    first.join(120)
    second.join(120)
    assert done["first"][1] == done["second"][1] == expected_chat.text


def test_a_client_that_disconnects_mid_stream_leaves_the_model_consistent(server, client, expected_chat):
    base, _ = server
    body = {"model": "qwen-test", "messages": MESSAGES, "temperature": 0, "max_tokens": 200, "stream": True,
            "n_draft": 2}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data:")
            if events == 4:
                break  # leave mid-stream: the connection closes here
    r = client.chat.completions.create(model="qwen-test", messages=MESSAGES, temperature=0, max_tokens=N_TOKENS,
                                       extra_body={"n_draft": 2})
    assert r.choices[0].message.content == expected_chat.text


def post(server, path: str, body, key: str | None = KEY) -> httpx.Response:
    return post_to(server[0], path, body, key)


BAD = [
    ("malformed JSON", "/v1/chat/completions", '{"messages": [', 400, None),
    ("no messages", "/v1/chat/completions", {"model": "qwen-test"}, 400, "messages"),
    ("max_tokens of the wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("a model name that is not a string", "/v1/chat/completions", {"model": 4, "messages": MESSAGES}, 400, "model"),
    ("n_draft out of range", "/v1/chat/completions", {"messages": MESSAGES, "n_draft": 500}, 400, "n_draft"),
    ("mirostat is not applied", "/v1/completions", {"prompt": "hi", "mirostat_mode": 2}, 400, "mirostat_mode"),
    ("a grammar that does not parse", "/v1/completions", {"prompt": "hi", "grammar": "root ::= ("}, 400, "grammar"),
    ("a tool_choice naming no tool", "/v1/chat/completions",
     {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ("top_logprobs without logprobs", "/v1/chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, 400,
     "top_logprobs"),
]


@pytest.mark.parametrize("name, path, body, status, param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_gets_an_openai_error_and_the_server_lives_on(server, client, expected_chat, name, path, body,
                                                                 status, param):
    r = post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["type"]
    assert error["param"] == param
    ok = client.chat.completions.create(model="qwen-test", messages=MESSAGES, temperature=0, max_tokens=N_TOKENS)
    assert ok.choices[0].message.content == expected_chat.text


def test_the_api_key_guards_every_endpoint_but_health(server):
    for key in (None, "wrong"):
        r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, key=key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{server[0]}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 401
    assert httpx.get(f"{server[0]}/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0).models.list()


def test_metrics_in_prometheus_format(server, client):
    client.chat.completions.create(model="qwen-test", messages=MESSAGES, temperature=0, max_tokens=4,
                                   extra_body={"n_draft": 2})
    text = httpx.get(f"{server[0]}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["specllama_generated_tokens_total"] >= 4
    assert values["specllama_drafted_tokens_total"] > 0 and "specllama_accepted_tokens_total" in values
    assert values['specllama_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert values['specllama_phase_seconds_total{phase="verify"}'] > 0
    # each request that drafted, by the share the target accepted
    assert values["specllama_request_acceptance_count"] >= 1
    assert values['specllama_request_acceptance_bucket{le="1.0"}'] == values["specllama_request_acceptance_count"]


def test_a_second_turn_reuses_the_prompt_cache_and_starts_sooner(server, client):
    """Two turns of a chat over a long system prompt, as aider or Continue send them."""
    from prompts import LONG_CODE

    messages = [{"role": "system", "content": "You review this file:\n" + LONG_CODE},
                {"role": "user", "content": "What does summarize() return?"}]
    seen = []
    for turn in range(2):
        t0 = time.monotonic()
        first_token, text, usage, timings = None, "", None, None
        for chunk in client.chat.completions.create(model="qwen-test", messages=messages, temperature=0,
                                                    max_tokens=16, stream=True,
                                                    stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content and first_token is None:
                first_token = time.monotonic() - t0
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                timings = (chunk.model_extra or {}).get("timings") or timings
            if chunk.usage is not None:
                usage = chunk.usage
        seen.append((first_token, usage, timings))
        messages = messages + [{"role": "assistant", "content": text},
                               {"role": "user", "content": "And wettest_stations()?"}]
    (ttft1, usage1, timings1), (ttft2, usage2, timings2) = seen
    assert usage1.prompt_tokens_details.cached_tokens < usage2.prompt_tokens_details.cached_tokens
    assert usage2.prompt_tokens_details.cached_tokens > usage1.prompt_tokens // 2
    assert timings2["cache_n"] == usage2.prompt_tokens_details.cached_tokens
    assert timings2["prompt_n"] == usage2.prompt_tokens - timings2["cache_n"]
    assert ttft2 < ttft1 and timings2["prompt_ms"] < timings1["prompt_ms"], (seen,)
    text = httpx.get(f"{server[0]}/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    values = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    assert values["specllama_prompt_cached_tokens_total"] >= usage2.prompt_tokens_details.cached_tokens
    assert values['specllama_prompt_cache_lookups_total{source="live"}'] >= 1


# --- structured output, tools and logprobs through real client libraries -------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def test_openai_parse_returns_a_pydantic_object(client):
    from pydantic import BaseModel

    class Person(BaseModel):
        name: str
        age: int
        languages: list[str]

    r = client.chat.completions.parse(
        model="qwen-test", temperature=0, max_tokens=96, response_format=Person,
        messages=[{"role": "user", "content": "Extract the person: Maria Lopez is 34 and writes Rust and Go."}])
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and person.age == 34 and "Maria" in person.name


def test_instructor_extracts_a_model_through_a_required_tool_call(server):
    import instructor
    from pydantic import BaseModel

    class City(BaseModel):
        city: str
        country: str

    extractor = instructor.from_openai(openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0))
    got = extractor.chat.completions.create(
        model="qwen-test", response_model=City, temperature=0, max_tokens=96, max_retries=0,
        messages=[{"role": "user", "content": "Where is the Eiffel Tower? Give the city and the country."}])
    assert isinstance(got, City) and got.city and got.country


def test_a_required_tool_call_streams_to_the_same_call(client):
    kw = dict(model="qwen-test", messages=ASK_WEATHER, tools=[WEATHER], tool_choice="required", temperature=0,
              max_tokens=64)
    whole = client.chat.completions.create(**kw)
    (call,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"]
    name, arguments, finish = "", "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for delta in chunk.choices[0].delta.tool_calls or []:
            name += delta.function.name or ""
            arguments += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
        assert not chunk.choices[0].delta.content, "a call must not leak out as content"
    assert (name, json.loads(arguments), finish) == (call.function.name, json.loads(call.function.arguments),
                                                     "tool_calls")


def test_an_agent_calls_a_python_tool_and_uses_its_result(server):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # traces would go to OpenAI; tests talk to 127.0.0.1 only
    calls = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"It is 17 degrees and raining in {city}."

    model = OpenAIChatCompletionsModel(
        model="qwen-test", openai_client=openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0))
    # "required" for the first turn; the SDK then resets tool_choice so the model can answer
    agent = Agent(name="weather", tools=[get_weather], model=model,
                  instructions="You are a weather reporter. Once you have the weather, write a short sentence "
                               "for the user.",
                  model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=96))
    result = Runner.run_sync(agent, "Tell me in a sentence how the weather is in Paris.", max_turns=4)
    assert calls and "paris" in calls[0].lower()
    assert isinstance(result.final_output, str) and result.final_output.strip()
    assert any(word in result.final_output.lower() for word in ("17", "rain")), result.final_output


def test_tool_results_in_the_history_are_rendered(pair):
    """An assistant tool call and its tool message reach the prompt in the template's format."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    history = ASK_WEATHER + [{"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "call_1", "content": "17 degrees, raining"}]
    text = pair.detokenize(pair.chat_tokens(history, tools=[WEATHER]))
    assert '"name": "get_weather"' in text and '{"city": "Paris"}' in text
    assert "<tool_response>\n17 degrees, raining\n</tool_response>" in text


def test_logprobs_have_openai_shapes(client):
    r = client.chat.completions.create(model="qwen-test", messages=MESSAGES, temperature=0, max_tokens=8,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0 and t.top_logprobs[0].logprob >= t.logprob - 1e-9
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    text = client.completions.create(model="qwen-test", prompt="def add(a, b):", max_tokens=6, temperature=0,
                                     logprobs=2)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == text.choices[0].text and all(len(top) == 2 for top in lp.top_logprobs)
