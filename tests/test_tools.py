"""Tool-call formats: parsing each family's output, holding a stream back, the grammar of calls."""

from __future__ import annotations

import json

import pytest

import specllama
from conftest import SETTINGS
from specllama import InvalidParameterError
from specllama.surfaces.tools import ToolFormat, chosen_tools, detect

HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>")
LLAMA3 = ToolFormat("llama3", "", "", arguments_key="parameters")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def calls_of(fmt, text):
    content, calls = fmt.parse(text)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("fmt, text, expected", [
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     ("Let me check.", [("get_weather", {"city": "Paris"})])),
    (HERMES, '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n'
             '{"name": "add", "arguments": "{\\"a\\": 2}"}\n</tool_call>',
     ("", [("add", {"a": 1}), ("add", {"a": 2})])),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Oslo"}}', ("", [("get_weather", {"city": "Oslo"})])),
    (LLAMA3, '<|python_tag|>{"name": "add", "parameters": {}}; {"name": "add", "parameters": {"b": 3}}',
     ("", [("add", {}), ("add", {"b": 3})])),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]',
     ("", [("get_weather", {"city": "Rome"})])),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima"}[TOOL_CALLS]add[ARGS]{}',
     ("", [("get_weather", {"city": "Lima"}), ("add", {})])),
])
def test_calls_are_parsed_from_each_format(fmt, text, expected):
    assert calls_of(fmt, text) == expected


# Small models copy the call example of their template (Qwen2.5's shows doubled braces) rather
# than its tags: an output that is nothing but a call to one of the request's tools is that call.
LENIENT = ToolFormat("hermes", "<tool_call>", "</tool_call>", names=("get_weather", "add"))


@pytest.mark.parametrize("text, expected", [
    ('{{"name": "get_weather", "arguments": {"city": "Paris"}}}', [("get_weather", {"city": "Paris"})]),
    ('```json\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n```', [("get_weather", {"city": "Oslo"})]),
    ('{"name": "add", "arguments": {"a": 1}}\n{"name": "add", "arguments": {"a": 2}}', [("add", {"a": 1}),
                                                                                    ("add", {"a": 2})]),
    ('[{"name": "add", "arguments": {}}]', [("add", {})]),
    ('<tool_call>\n{{"name": "add", "arguments": {"a": 3}}}\n</tool_call>', [("add", {"a": 3})]),
])
def test_a_bare_call_to_a_known_tool_is_a_call(text, expected):
    assert calls_of(LENIENT, text) == ("", expected)
    assert LENIENT.holds(text[:3]) == 3  # a stream holds it back while it may become one


@pytest.mark.parametrize("text", [
    '{"name": "delete_everything", "arguments": {}}',  # not one of the request's tools
    'The answer is {"name": "add", "arguments": {}}',  # text around it: an answer, not a call
    '{"city": "Paris"}',  # JSON without a name
    '{"name": "add", "arguments": [1, 2]}',  # arguments that are not an object
])
def test_json_that_is_not_a_bare_call_stays_text(text):
    assert calls_of(LENIENT, text) == (text, [])
    assert calls_of(HERMES, '{{"name": "add", "arguments": {}}}')[1] == []  # no tool names: no leniency


@pytest.mark.parametrize("fmt, text", [
    (HERMES, "No tools needed: the answer is 4."),
    (HERMES, "<tool_call>\n{not json}\n</tool_call>"),
    (HERMES, '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    (LLAMA3, '{"answer": 42}'),
    (LLAMA3, "The weather is fine."),
    (MISTRAL, "[TOOL_CALLS] nonsense"),
])
def test_text_that_is_not_a_call_stays_content(fmt, text):
    assert fmt.parse(text) == (text, [])


def test_a_stream_holds_back_only_what_may_be_a_call():
    assert HERMES.holds("Sure, here") == 0
    assert HERMES.holds("Sure <tool") == len("<tool")
    assert HERMES.holds('ok <tool_call>\n{"na') == len('<tool_call>\n{"na')
    assert LLAMA3.holds('  {"name"') == len('  {"name"') and LLAMA3.holds("It is") == 0


def test_tool_choice_picks_the_named_function_or_says_what_is_allowed():
    assert chosen_tools(TOOLS, {"type": "function", "function": {"name": "add"}}) == ("required", TOOLS[1:])
    assert chosen_tools(TOOLS, None) == ("auto", TOOLS)
    with pytest.raises(InvalidParameterError) as e:
        chosen_tools(TOOLS, {"type": "function", "function": {"name": "nope"}})
    assert e.value.name == "tool_choice"


def test_templates_are_told_apart():
    assert detect("{% for t in tools %}<tool_call>{% endfor %}") == HERMES
    assert detect("{{ tools }} [TOOL_CALLS]") == MISTRAL
    assert detect("<|start_header_id|>ipython{{ tools }}") == LLAMA3
    assert detect("{{ messages }}") is None


def test_a_required_call_is_valid_and_verified_like_any_constrained_output(pair, plain):
    """Greedy under the grammar of calls: a valid call, the same tokens with and without drafting."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(tools=TOOLS, tool_choice="required", temperature=0, max_tokens=64)
    spec = pair.create_chat_completion(messages, n_draft=4, **kw)
    alone = plain.create_chat_completion(messages, **kw)
    (call,) = spec["choices"][0]["message"]["tool_calls"]
    assert spec["choices"][0]["finish_reason"] == "tool_calls"
    assert call["function"]["name"] in ("get_weather", "add") and json.loads(call["function"]["arguments"]) is not None
    assert alone["choices"][0]["message"]["tool_calls"][0]["function"] == call["function"]


def test_a_template_without_tools_is_refused_naming_the_model(model_paths):
    with specllama.load(model_paths["smollm2"], **SETTINGS) as llm:
        with pytest.raises(InvalidParameterError, match=model_paths["smollm2"].name) as e:
            llm.create_chat_completion([{"role": "user", "content": "hi"}], tools=TOOLS)
        assert e.value.name == "tools"
        assert llm.create_chat_completion([{"role": "user", "content": "hi"}], max_tokens=2)["choices"]
