"""Chat messages checked and put in the form chat templates expect.

Clients send OpenAI's message shapes: content as a string, as null (an assistant turn with
tool calls) or as a list of content parts; assistant tool calls with their arguments as JSON
text; tool results with the id of the call they answer. Templates want plain strings and
arguments as objects. normalize() turns the first into the second and raises
InvalidParameterError naming the field (`messages.2.content.0.type`) for anything else, so a
malformed message is a clear 400 rather than a template crash or a silently odd prompt.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import InvalidParameterError

ROLES = ("system", "user", "assistant", "tool")
# OpenAI's newer name for the system role; llama.cpp's server maps it the same way
ALIASES = {"developer": "system"}
# content parts that carry something other than text: refused with a reason, never dropped
MEDIA_PARTS = ("image_url", "input_image", "image", "input_audio", "audio", "video_url", "file", "input_file")
TEXT_PARTS = ("text", "input_text", "output_text")
PART_SEPARATOR = "\n"  # as llama.cpp joins text parts


def normalize(messages: Any) -> list[dict]:
    """Checked copies of messages with string content and tool-call arguments as objects.

    Raises InvalidParameterError naming the first field that is wrong.
    """
    if not isinstance(messages, list) or not messages:
        raise InvalidParameterError("messages", _short(messages),
                                    "a non-empty list of {'role': ..., 'content': ...} objects")
    return [_message(m, f"messages.{i}") for i, m in enumerate(messages)]


def _message(m: Any, where: str) -> dict:
    if not isinstance(m, dict):
        raise InvalidParameterError(where, _short(m), "an object with a role and content")
    if "role" not in m:
        raise InvalidParameterError(f"{where}.role", None, f"one of {', '.join(ROLES)} (it is missing)")
    role = m["role"]
    if not isinstance(role, str) or ALIASES.get(role, role) not in ROLES:
        raise InvalidParameterError(f"{where}.role", _short(role), f"one of {', '.join(ROLES)} or developer")
    out = dict(m)
    out["role"] = role = ALIASES.get(role, role)
    out["content"] = content_text(m.get("content"), f"{where}.content", allow_none=role == "assistant")
    if m.get("name") is not None and not isinstance(m["name"], str):
        raise InvalidParameterError(f"{where}.name", _short(m["name"]), "a string")
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidParameterError(f"{where}.tool_call_id", _short(call_id),
                                        "the id of the tool call this message answers (a non-empty string)")
    if m.get("tool_calls") is not None:
        if role != "assistant":
            raise InvalidParameterError(f"{where}.tool_calls", "...", "left out: only assistant messages make calls")
        out["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
    elif "tool_calls" in out:
        del out["tool_calls"]
    return out


def content_text(content: Any, where: str, allow_none: bool = True) -> str:
    """A message's content as one string: text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if content is None:
        if allow_none:
            return ""
        raise InvalidParameterError(where, None, "a string or a list of content parts")
    if not isinstance(content, list):
        raise InvalidParameterError(where, _short(content), "a string or a list of content parts "
                                    "([{'type': 'text', 'text': ...}])")
    texts = []
    for j, part in enumerate(content):
        at = f"{where}.{j}"
        if isinstance(part, str):  # some clients send bare strings in the list
            texts.append(part)
            continue
        if not isinstance(part, dict):
            raise InvalidParameterError(at, _short(part), "a content part object {'type': 'text', 'text': ...}")
        kind = part.get("type")
        if kind in TEXT_PARTS:
            text = part.get("text")
            if not isinstance(text, str):
                raise InvalidParameterError(f"{at}.text", _short(text), "a string")
            texts.append(text)
        elif kind in MEDIA_PARTS:
            raise InvalidParameterError(f"{at}.type", kind, "text: this model reads text only, so images, audio "
                                        "and files are not supported by it")
        else:
            raise InvalidParameterError(f"{at}.type", _short(kind), "text (the content part type a text model "
                                        "reads)")
    return PART_SEPARATOR.join(texts)


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise InvalidParameterError(where, _short(calls), "a list of {'id', 'type': 'function', 'function': "
                                    "{'name', 'arguments'}}")
    out = []
    for k, call in enumerate(calls):
        at = f"{where}.{k}"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise InvalidParameterError(f"{at}.function", _short(function), "an object with a name and arguments")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidParameterError(f"{at}.function.name", _short(function.get("name")), "a non-empty string")
        arguments = function.get("arguments")
        if isinstance(arguments, str):  # OpenAI sends JSON text; templates render an object
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                pass  # a model's malformed arguments stay as it wrote them
        elif arguments is not None and not isinstance(arguments, dict):
            raise InvalidParameterError(f"{at}.function.arguments", _short(arguments), "JSON text or an object")
        out.append({**call, "function": {**function, "arguments": {} if arguments is None else arguments}})
    return out


def _short(value: Any) -> Any:
    """A value short enough to quote in an error message."""
    text = repr(value)
    return value if len(text) <= 80 else text[:77] + "..."
