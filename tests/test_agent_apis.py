"""The APIs coding agents and editors speak, against a real `specllama serve`, through the real
client libraries: Anthropic Messages (the anthropic SDK: what Claude Code sends), OpenAI
Responses (the openai SDK: the Codex CLI's API), and llama-server's /tokenize, /detokenize and
/infill (as llama.vscode calls them). Greedy text equals the chat endpoint's, token for token."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel

from conftest import SERVER_KEY, SERVER_MODEL
from serving import post

N = 24
SYSTEM = "You are terse."
QUESTION = "Name three primary colors."
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
GREEDY = {"temperature": 0}  # the anthropic SDK no longer takes sampling fields: sent as extra body


@pytest.fixture(scope="module")
def base(served):
    return served[0]


@pytest.fixture(scope="module")
def claude(base):
    return anthropic.Anthropic(base_url=base, api_key=SERVER_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oai(base):
    return openai.OpenAI(base_url=base + "/v1", api_key=SERVER_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_text(oai):
    r = oai.chat.completions.create(model=SERVER_MODEL, temperature=0, max_tokens=N, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    return r.choices[0].message.content, r.usage.completion_tokens


# --- Anthropic Messages ----------------------------------------------------------------------------

def test_messages_create_is_the_chat_endpoints_text(claude, chat_text):
    r = claude.messages.create(model="claude-sonnet-4-5", max_tokens=N, system=SYSTEM, extra_body=GREEDY,
                               messages=[{"role": "user", "content": QUESTION}])
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == chat_text[0]
    assert r.role == "assistant" and r.model == SERVER_MODEL and r.stop_reason in ("end_turn", "max_tokens")
    assert r.usage.output_tokens == chat_text[1] and r.usage.input_tokens + r.usage.cache_read_input_tokens > 10


def test_messages_stream_sends_text_deltas_in_anthropics_event_order(claude, chat_text):
    kinds = []
    with claude.messages.stream(model="m", max_tokens=N, system=[{"type": "text", "text": SYSTEM}],
                                extra_body=GREEDY, messages=[{"role": "user", "content": QUESTION}]) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].text == chat_text[0] and final.usage.output_tokens == chat_text[1]
    order = [k for k in kinds if k != "text"]
    assert order[0] == "message_start" and order[-2:] == ["message_delta", "message_stop"]
    assert "content_block_start" in order and "content_block_stop" in order
    # what the prompt cache reused is reported as Anthropic's cache reads
    assert final.usage.cache_read_input_tokens > 0


def test_a_tool_use_answered_by_a_tool_result(claude):
    tools = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER_SCHEMA}]
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = claude.messages.create(model="m", max_tokens=64, tools=tools, tool_choice={"type": "any"},
                               extra_body=GREEDY, messages=ask)
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and use.name == "get_weather" and use.input["city"]
    # the small test model would call again; an agent asks for the final text this way
    answer = claude.messages.create(model="m", max_tokens=48, tools=tools, tool_choice={"type": "none"},
                                    extra_body=GREEDY, messages=[
        *ask, {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": "17 degrees and raining"}]}])
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    assert answer.content[0].text.strip()
    counted = claude.messages.count_tokens(model="m", tools=tools, messages=[
        *ask, {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "17 degrees"}]}])
    alone = claude.messages.count_tokens(model="m", tools=tools, messages=ask)
    assert counted.input_tokens > alone.input_tokens  # the call and its result are in the prompt


def test_count_tokens_counts_the_rendered_prompt(claude, pair):
    counted = claude.messages.count_tokens(model="m", system=SYSTEM, messages=[{"role": "user", "content": QUESTION}])
    expected = pair.chat_tokens([{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}])
    assert counted.input_tokens == len(expected)


def test_messages_errors_have_anthropics_shape(base, claude):
    r = post(base, "/v1/messages", {"model": "m", "max_tokens": 8, "messages": [{"role": "robot", "content": "x"}]},
             SERVER_KEY)
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "messages.0.role" in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long"):  # what the SDK compacts on
        claude.messages.create(model="m", max_tokens=8, messages=[{"role": "user", "content": "word " * 5000}])
    r = httpx.post(f"{base}/v1/messages", json={"model": "m", "max_tokens": 8, "messages": []},
                   headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.head(f"{base}/").status_code == 200  # Claude Code's probe, no key needed


def test_claude_codes_billing_header_does_not_defeat_the_prompt_cache(claude):
    """Claude Code heads its system prompt with a per-version (in some versions per-request)
    billing header that Anthropic's API strips; so does this server, and the rest is reused."""
    body = " ".join(f"Rule {i}: answer briefly and mention the rule number." for i in range(40))
    usages = []
    for marker in ("cch=1111", "cch=2222"):
        r = claude.messages.create(model="m", max_tokens=4, extra_body=GREEDY, system=[
            {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.332; {marker};"},
            {"type": "text", "text": body}], messages=[{"role": "user", "content": "Which rule is first?"}])
        usages.append(r.usage)
    assert usages[1].input_tokens <= 1 and usages[1].cache_read_input_tokens > 300, usages


# --- OpenAI Responses -----------------------------------------------------------------------------

def test_responses_create_is_the_chat_endpoints_text(oai, chat_text):
    r = oai.responses.create(model="gpt-5-codex", instructions=SYSTEM, input=QUESTION, temperature=0,
                             max_output_tokens=N)
    assert r.output_text == chat_text[0] and r.usage.output_tokens == chat_text[1]
    assert r.status in ("completed", "incomplete") and r.model == SERVER_MODEL


def test_responses_stream_events_in_order(oai, chat_text):
    events = list(oai.responses.create(model="m", input=[
        {"role": "developer", "content": SYSTEM}, {"type": "message", "role": "user",
                                                    "content": [{"type": "input_text", "text": QUESTION}]}],
        temperature=0, max_output_tokens=N, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed",
                                                                                       "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == chat_text[0]
    assert events[-1].response.usage.input_tokens_details.cached_tokens > 0


def test_a_function_call_round_trip(oai):
    tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
              "parameters": WEATHER_SCHEMA}, {"type": "web_search"}]  # a hosted tool type: skipped
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = oai.responses.create(model="m", input=ask, tools=tools, tool_choice="required", temperature=0,
                             max_output_tokens=64, store=False)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"]
    streamed = list(oai.responses.create(model="m", input=ask, tools=tools, tool_choice="required", temperature=0,
                                         max_output_tokens=64, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done and json.loads(done[0].arguments) == json.loads(call.arguments)
    answer = oai.responses.create(model="m", temperature=0, max_output_tokens=48, tools=tools, tool_choice="none",
                                  input=[
        *ask, {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "17 degrees and raining"}])
    assert answer.output_text.strip()


def test_responses_parse_returns_a_pydantic_object(oai):
    class Person(BaseModel):
        name: str
        age: int

    r = oai.responses.parse(model="m", input="Extract the person: Maria Lopez is 34.", text_format=Person,
                            temperature=0, max_output_tokens=64)
    assert isinstance(r.output_parsed, Person) and r.output_parsed.age == 34


def test_responses_errors_and_what_is_refused(base):
    r = post(base, "/v1/responses", {"model": "m", "input": "hi", "previous_response_id": "resp_1"}, SERVER_KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
    r = post(base, "/v1/responses", {"model": "m", "input": [{"type": "message", "role": "wizard", "content": "x"}]},
             SERVER_KEY)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.role"
    r = post(base, "/v1/responses", {"model": "m", "input": []}, SERVER_KEY)  # a probe with nothing to answer
    assert r.status_code == 200 and r.json()["output"] == [] and r.json()["status"] == "completed"


# --- llama-server's tokenize, detokenize and infill -----------------------------------------------

def test_tokenize_and_detokenize_as_llama_server(base, pair):
    auth = {"Authorization": f"Bearer {SERVER_KEY}"}
    tokens = httpx.post(f"{base}/tokenize", json={"content": "def add(a, b):"}, headers=auth).json()["tokens"]
    assert tokens == pair.target.tokenize("def add(a, b):", add_special=False, parse_special=True)
    pieces = httpx.post(f"{base}/tokenize", json={"content": "héllo", "with_pieces": True}, headers=auth).json()
    assert "".join(p["piece"] if isinstance(p["piece"], str) else bytes(p["piece"]).decode("utf-8", "replace")
                   for p in pieces["tokens"]) == "héllo"
    assert httpx.post(f"{base}/detokenize", json={"tokens": tokens}, headers=auth).json()["content"] == "def add(a, b):"
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [10**9]}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{base}/tokenize", json={}, headers=auth).status_code == 400


def test_infill_is_plain_decoding_of_the_fim_prompt(base, pair, plain):
    auth = {"Authorization": f"Bearer {SERVER_KEY}"}
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    extra = [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n"}]
    body = {"input_prefix": prefix, "input_suffix": suffix, "input_extra": extra, "prompt": "", "n_predict": 16,
            "temperature": 0, "top_k": 40, "top_p": 0.99, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 2000}  # as llama.vscode sends it
    r = httpx.post(f"{base}/infill", json=body, headers=auth, timeout=120).json()
    expected = plain.generate(pair.fim_tokens(prefix, suffix, extra=extra, n_predict=16), max_tokens=16, n_draft=0)
    assert r["content"] == expected.text and r["tokens_predicted"] == len(expected.tokens) and r["stop"] is True
    assert r["stop_type"] in ("eos", "limit") and "timings" in r
    streamed = []
    with httpx.stream("POST", f"{base}/infill", json={**body, "stream": True}, headers=auth, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data:"):
                streamed.append(json.loads(line[5:]))
    assert "".join(c["content"] for c in streamed) == expected.text and streamed[-1]["stop"] is True
    legacy = post(base, "/v1/completions", {"prompt": prefix, "suffix": suffix, "max_tokens": 16, "temperature": 0},
                  SERVER_KEY).json()
    without_extra = plain.generate(pair.fim_tokens(prefix, suffix, n_predict=16), max_tokens=16, n_draft=0)
    assert legacy["choices"][0]["text"] == without_extra.text


def test_infill_errors(base):
    r = post(base, "/infill", {"input_prefix": "x", "input_extra": [{"filename": 3}]}, SERVER_KEY)
    assert r.status_code == 400 and r.json()["error"]["message"]
    r = post(base, "/infill", {"input_prefix": "x", "input_extra": "not a list"}, SERVER_KEY)
    assert r.status_code == 400
