"""What a streamed answer promises over HTTP, through the real client libraries on the session's
server: text never runs past a stop string (OpenAI `stop`, Anthropic `stop_sequences`), a
streamed tool call arrives as Anthropic's input_json_delta pieces of the final input, and
`response_format: json_object` is a JSON object."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

from conftest import SERVER_KEY, SERVER_MODEL

COUNT = [{"role": "user", "content": "Count from 1 to 20, one number per line, nothing else."}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def oai(served):
    return openai.OpenAI(base_url=served[0] + "/v1", api_key=SERVER_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(served):
    return anthropic.Anthropic(base_url=served[0], api_key=SERVER_KEY, max_retries=0, timeout=120)


@pytest.mark.parametrize("stop", ["7", "\n5", "1\n1"])
def test_a_streamed_chat_never_shows_text_past_a_stop_string(oai, stop):
    whole = oai.chat.completions.create(model=SERVER_MODEL, messages=COUNT, max_tokens=40, stop=[stop], **GREEDY)
    pieces, finish = [], None
    for chunk in oai.chat.completions.create(model=SERVER_MODEL, messages=COUNT, max_tokens=40, stop=[stop],
                                             stream=True, **GREEDY):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
            assert stop not in "".join(pieces), pieces  # not even for one chunk
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == finish == "stop"
    assert "".join(pieces) == text and stop not in text
    # without the stop string the answer does contain it: the stop is what cut it
    free = oai.chat.completions.create(model=SERVER_MODEL, messages=COUNT, max_tokens=40, **GREEDY)
    assert free.choices[0].message.content.startswith(text + stop)


def test_anthropic_stop_sequences_end_a_stream_before_the_sequence(claude):
    texts = []
    with claude.messages.stream(model="m", max_tokens=40, messages=COUNT, stop_sequences=["7"],
                                extra_body=GREEDY) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                texts.append(event.delta.text)
                assert "7" not in "".join(texts), texts
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "7"
    assert final.content[0].text == "".join(texts) and "6" in final.content[0].text


def test_a_streamed_tool_use_arrives_as_input_json_deltas_of_its_input(claude):
    tools = [{"name": "get_weather", "description": "The weather in a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    partial, kinds = [], []
    with claude.messages.stream(model="m", max_tokens=64, tools=tools, tool_choice={"type": "any"}, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "What is the weather in Paris?"}]) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                partial.append(event.delta.partial_json)
        final = stream.get_final_message()
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and use.name == "get_weather" and use.input["city"]
    assert partial and json.loads("".join(partial)) == use.input
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"


def test_json_object_response_format_gives_a_json_object(oai):
    reply = oai.chat.completions.create(
        model=SERVER_MODEL, max_tokens=64, response_format={"type": "json_object"}, **GREEDY,
        messages=[{"role": "user", "content": "Describe a cat as JSON with its name and age."}])
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_color_true_says_who_chose_each_streamed_token(oai):
    """For a UI that colours the answer as `run --color` does: each chunk's choice carries its
    tokens' origins, as many as the completion's tokens; without color, none."""
    origins, n_tokens = [], None
    for chunk in oai.chat.completions.create(model=SERVER_MODEL, messages=COUNT, max_tokens=30, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"color": True, "n_draft": 3, **GREEDY}):
        if chunk.usage is not None:
            n_tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            origins += (chunk.choices[0].model_extra or {})["origins"]
    assert len(origins) == n_tokens and set(origins) <= {"draft", "lookup", "target"}, origins
    assert "draft" in origins and "target" in origins, origins  # counting is what the draft gets right
    plain = oai.chat.completions.create(model=SERVER_MODEL, messages=COUNT, max_tokens=8, stream=True, **GREEDY)
    assert not any(c.choices and "origins" in (c.choices[0].model_extra or {}) for c in plain)
