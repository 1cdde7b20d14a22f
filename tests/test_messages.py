"""messages.normalize: OpenAI message shapes into what chat templates expect, or an error naming the field."""

from __future__ import annotations

import pytest

from specllama import InvalidParameterError
from specllama.surfaces.messages import normalize


def test_parts_are_joined_and_roles_mapped():
    out = normalize([{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                     {"role": "user", "content": [{"type": "text", "text": "a"}, "b", {"type": "input_text",
                                                                                        "text": "c"}]}])
    assert out == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a\nb\nc"}]


def test_assistant_calls_get_object_arguments_and_empty_content():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    (m,) = normalize([{"role": "assistant", "content": None, "tool_calls": [call]}])
    assert m["content"] == "" and m["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert call["function"]["arguments"] == '{"x": 1}'  # the caller's message is not changed


@pytest.mark.parametrize("messages, name", [
    ("hi", "messages"),
    ([], "messages"),
    ([1], "messages.0"),
    ([{"content": "x"}], "messages.0.role"),
    ([{"role": None, "content": "x"}], "messages.0.role"),
    ([{"role": "user", "content": None}], "messages.0.content"),
    ([{"role": "user", "content": {"text": "x"}}], "messages.0.content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages.0.content.0.type"),
    ([{"role": "user", "content": [{"type": "text", "text": 5}]}], "messages.0.content.0.text"),
    ([{"role": "user", "content": [7]}], "messages.0.content.0"),
    ([{"role": "user", "content": "x", "name": 3}], "messages.0.name"),
    ([{"role": "tool", "content": "17"}], "messages.0.tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages.0.tool_calls"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     "messages.0.tool_calls.0.function.name"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
     "messages.0.tool_calls.0.function.arguments"),
])
def test_each_malformed_field_is_named(messages, name):
    with pytest.raises(InvalidParameterError) as e:
        normalize(messages)
    assert e.value.name == name and name in str(e.value)
