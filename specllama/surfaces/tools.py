"""Tool calls: the GGUF's own chat template renders the tools, the model's output is parsed into
OpenAI tool_calls, and tool_choice "required" or a named function becomes a grammar, so a call
is guaranteed and still verified token by token like any constrained output.

Formats (told apart by what the chat template writes): Hermes/Qwen `<tool_call>{json}</tool_call>`,
Llama 3.x bare JSON `{"name": ..., "parameters": ...}`, Mistral `[TOOL_CALLS] [{...}]`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any, Optional

from ..errors import InvalidParameterError


@dataclass(frozen=True)
class ToolFormat:
    """How one template family writes a call. open/close: the text around one call (close ""
    for formats that end with the text)."""

    name: str
    open: str
    close: str
    arguments_key: str = "arguments"
    # the request's tool names: an output that is nothing but a call to one of them, written
    # without the markers (bare, in a ```json fence, or in the doubled braces of Qwen2.5's own
    # template example), is that call (small models copy the example, not the tags)
    names: tuple[str, ...] = ()

    def parse(self, text: str) -> tuple[str, list[dict]]:
        """(the content before any call, the calls as OpenAI tool_calls) from a whole output.

        Text that only looks like a call (not JSON, no name) stays content."""
        content, calls = _PARSERS[self.name](self, text)
        if not calls and self.names and self.name != "llama3":
            calls = _bare_calls(text, self.names)
            if calls:
                content = ""
        return content, calls

    def holds(self, text: str) -> int:
        """How many characters at the end of text (the output so far) a stream holds back
        because they are or may become a call (0: emit it all)."""
        head = text.lstrip()
        if self.name == "llama3" or self.names:  # a whole output that starts like a call
            starts = ("{", "<|python_tag|>") if self.name == "llama3" else ("{", "[{", "```json")
            if head and any(head.startswith(s) or s.startswith(head) for s in starts) and \
                    (self.name == "llama3" or self.open not in text):
                return len(text)
            if self.name == "llama3":
                return 0
        if self.open in text:
            return len(text) - text.index(self.open)
        for i in range(len(self.open) - 1, 0, -1):
            if text.endswith(self.open[:i]):
                return i
        return 0

    def grammar(self, tools: list[dict], parallel: bool, special: Callable[[str], Optional[int]]) -> str:
        """A Lark grammar (llguidance) whose every sentence is one call, or several with parallel,
        of the given tools with arguments that match their JSON schemas. special(text): the id
        of the one special token text is, or None."""
        call = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": t["function"]["name"]},
            self.arguments_key: t["function"].get("parameters") or {"type": "object"}},
            "required": ["name", self.arguments_key], "additionalProperties": False} for t in tools]}
        body = f"%json {json.dumps(call)}"
        if self.name == "mistral":
            many = '"[" call (", " call)* "]"' if parallel else '"[" call "]"'
            return f"start: {_lark_token(self.open, special)} \" \" {many}\ncall: {body}\n"
        if self.name == "llama3":
            return f"start: call\ncall: {body}\n"
        newline = json.dumps("\n")
        one = f"{_lark_token(self.open, special)} {newline} call {newline} {_lark_token(self.close, special)}"
        more = f" ({newline} block)*" if parallel else ""
        return f"start: block{more}\nblock: {one}\ncall: {body}\n"


def _lark_token(text: str, special: Callable[[str], Optional[int]]) -> str:
    """A marker as llguidance names it: a special token by id, plain text quoted."""
    token = special(text)
    return f"<[{token}]>" if token is not None else json.dumps(text)


def detect(template: Optional[str]) -> Optional[ToolFormat]:
    """The tool-call format a chat template writes, or None when it renders no tools."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return ToolFormat("hermes", "<tool_call>", "</tool_call>")
    if "[TOOL_CALLS]" in template:
        return ToolFormat("mistral", "[TOOL_CALLS]", "")
    if "<|start_header_id|>" in template or "<|python_tag|>" in template:
        return ToolFormat("llama3", "", "", arguments_key="parameters")
    return None


def _call(name: Any, arguments: Any) -> Optional[dict]:
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _json_call(text: str) -> Any:
    """A call's JSON, also in the doubled braces of Qwen2.5's template example; ValueError if none."""
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        if text.startswith("{{") and text.endswith("}}"):
            return json.loads(text[1:-1])
        raise


def _bare_calls(text: str, names: tuple[str, ...]) -> list[dict]:
    """Calls from an output that is only calls without markers, each naming one of names: JSON
    objects (or a list of them), optionally in a ```json fence, or doubled-brace lines."""
    body = _unfenced(text.strip())
    try:
        if body.startswith("{{"):  # Qwen2.5's template example, one call a line
            values = [_json_call(line) for line in body.splitlines() if line.strip()]
        elif body.startswith("["):
            values = json.loads(body)
        else:
            values, decoder, i = [], json.JSONDecoder(), 0
            while i < len(body):
                value, i = decoder.raw_decode(body, i)
                values.append(value)
                while i < len(body) and body[i] in " \n\t,;":
                    i += 1
    except ValueError:
        return []
    calls = []
    for value in values if isinstance(values, list) else []:
        call = _call(value.get("name"), value.get("arguments", value.get("parameters"))) \
            if isinstance(value, dict) and value.get("name") in names else None
        if call is None:
            return []
        calls.append(call)
    return calls


def _unfenced(body: str) -> str:
    """The inside of a ```json (or ```) fence around the whole of body, else body. String
    operations, linear in the text: a regex here backtracked with a cost cubic in the length of
    an unclosed fence (1,500 newlines held the server's event loop 2.4 s)."""
    if len(body) < 6 or not body.startswith("```") or not body.endswith("```"):
        return body
    inside = body[3:-3]
    if inside.startswith("json"):
        inside = inside[4:]
    return inside.strip()


def _parse_hermes(fmt: ToolFormat, text: str) -> tuple[str, list[dict]]:
    calls = []
    first = text.find(fmt.open)
    if first < 0:
        return text, []
    for block in re.finditer(re.escape(fmt.open) + r"(.*?)(?:" + re.escape(fmt.close) + r"|$)", text[first:], re.S):
        try:
            value = _json_call(block.group(1))
        except ValueError:
            return text, []
        call = _call(value.get("name"), value.get(fmt.arguments_key)) if isinstance(value, dict) else None
        if call is None:
            return text, []
        calls.append(call)
    return text[:first].rstrip(), calls


def _parse_llama3(fmt: ToolFormat, text: str) -> tuple[str, list[dict]]:
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    calls = []
    decoder = json.JSONDecoder()
    i = 0
    while i < len(body):  # one call, or several separated by ";" or newlines
        try:
            value, end = decoder.raw_decode(body, i)
        except ValueError:
            return text, []
        call = _call(value.get("name"), value.get("parameters", value.get("arguments"))) \
            if isinstance(value, dict) else None
        if call is None:
            return text, []
        calls.append(call)
        i = end
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    return ("", calls) if calls else (text, [])


def _parse_mistral(fmt: ToolFormat, text: str) -> tuple[str, list[dict]]:
    first = text.find(fmt.open)
    if first < 0:
        return text, []
    rest = text[first + len(fmt.open):].strip()
    calls = []
    try:
        value = json.loads(rest)
        items = value if isinstance(value, list) else [value]
        for item in items:
            call = _call(item.get("name"), item.get("arguments")) if isinstance(item, dict) else None
            if call is None:
                return text, []
            calls.append(call)
    except ValueError:
        # the newer layout: [TOOL_CALLS]name[ARGS]{...}, repeated
        for part in text[first:].split(fmt.open)[1:]:
            name, sep, args = part.partition("[ARGS]")
            call = _call(name.strip(), args.strip()) if sep else None
            if call is None:
                return text, []
            calls.append(call)
    return text[:first].rstrip(), calls


_PARSERS = {"hermes": _parse_hermes, "llama3": _parse_llama3, "mistral": _parse_mistral}


def check_tools(tools: Any) -> list[dict]:
    """OpenAI tools: [{"type": "function", "function": {"name", "description"?, "parameters"?}}]."""
    if not isinstance(tools, list) or not tools:
        raise InvalidParameterError("tools", tools, "a non-empty list of {'type': 'function', 'function': {...}}")
    for tool in tools:
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict) \
                or not isinstance(function.get("name"), str) or not function["name"]:
            raise InvalidParameterError("tools", tool, "{'type': 'function', 'function': {'name': ..., "
                                                       "'parameters': {JSON schema}}}")
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise InvalidParameterError("tools", function["parameters"], "parameters as a JSON schema object")
    return tools


def chosen_tools(tools: list[dict], tool_choice: Any) -> tuple[str, list[dict]]:
    """("auto" | "none" | "required", the tools a call may use) from OpenAI's tool_choice."""
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return tool_choice or "auto", tools
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    match = [t for t in tools if t["function"]["name"] == name]
    if not match:
        raise InvalidParameterError("tool_choice", tool_choice, '"auto", "none", "required" or {"type": "function", '
                                    '"function": {"name": one of the tools}}')
    return "required", match
