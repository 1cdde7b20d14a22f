"""What one client may ask of the server and what the server holds for it, each limit with its
default and the `--limit NAME=VALUE` that changes it (docs/server.md, "Limits and security").

Requests past a limit get a 4xx naming the field and the limit, in the API's own error shape:
413 for a body over body_mb, 503 with Retry-After past the queue, 400 for the counts and sizes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Optional

from pydantic import BaseModel, model_validator

from .errors import ApiError


@dataclass(frozen=True)
class ServerLimits:
    """Attributes:
        body_mb: the largest request body, in MiB (413 past it; an 11,600-token agent request is
            about 60 KiB of JSON).
        prompts: prompts in one /v1/completions request.
        choices: choices in one request: n times its prompts (each sampled one is a generation).
        stop: stop strings in one request (OpenAI takes 4).
        stop_chars: characters in one stop string.
        messages: messages (or Responses input items) in one request.
        tools: tools in one request.
        input_extra: /infill's input_extra files.
        grammar_kb: a grammar or JSON schema's text, in KiB.
        queue: requests waiting for a slot (or being prepared) at once; past it 503 with Retry-After.
        send_timeout: seconds a stream waits for its client to read a chunk before it is cancelled.
        backlog: chunks a stream keeps for a client that reads slower than it generates; past
            it the generation is cancelled.
    """

    body_mb: float = 16.0
    prompts: int = 16
    choices: int = 64
    stop: int = 64
    stop_chars: int = 512
    messages: int = 4096
    tools: int = 256
    input_extra: int = 256
    grammar_kb: float = 256.0
    queue: int = 64
    send_timeout: float = 30.0
    backlog: int = 4096

    @classmethod
    def parse(cls, items: Iterable[str]) -> "ServerLimits":
        """From NAME=VALUE strings (--limit); ValueError naming what is wrong and the known names."""
        known = {f.name: f.type for f in fields(cls)}
        changes: dict[str, Any] = {}
        for item in items:
            name, sep, value = item.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in known:
                raise ValueError(f"--limit {item!r}: NAME=VALUE with NAME one of {', '.join(known)}")
            try:
                number = float(value) if known[name] == "float" else int(value)
            except ValueError:
                raise ValueError(f"--limit {item!r}: {value!r} is not a {known[name]}") from None
            if number <= 0:
                raise ValueError(f"--limit {item!r}: a limit is greater than 0")
            changes[name] = number
        return dataclasses.replace(cls(), **changes)

    def check(self, *, stop: Any = None, stop_param: str = "stop", messages: Optional[Sequence] = None,
              messages_param: str = "messages", tools: Optional[Sequence] = None, grammar: Any = None,
              grammar_param: str = "grammar", n_prompts: int = 1, n: int = 1,
              input_extra: Optional[Sequence] = None) -> None:
        """ApiError (400) for the first of these request fields past its limit."""
        if n_prompts > self.prompts:
            _over("prompt", f"{n_prompts} prompts", self.prompts, "prompts")
        if n * n_prompts > self.choices:
            _over("n", f"{n} choices for each of {n_prompts} prompts", self.choices, "choices")
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        if len(stops) > self.stop:
            _over(stop_param, f"{len(stops)} stop strings", self.stop, "stop")
        for i, text in enumerate(stops):
            if isinstance(text, str) and len(text) > self.stop_chars:
                _over(f"{stop_param}.{i}", f"{len(text)} characters", self.stop_chars, "stop_chars")
        if messages is not None and len(messages) > self.messages:
            _over(messages_param, f"{len(messages)} messages", self.messages, "messages")
        if tools is not None and len(tools) > self.tools:
            _over("tools", f"{len(tools)} tools", self.tools, "tools")
        if input_extra is not None and len(input_extra) > self.input_extra:
            _over("input_extra", f"{len(input_extra)} files", self.input_extra, "input_extra")
        if grammar is not None:
            n_chars = len(grammar) if isinstance(grammar, str) else len(json.dumps(grammar))
            if n_chars > self.grammar_kb * 1024:
                _over(grammar_param, f"{n_chars / 1024:.0f} KiB", f"{self.grammar_kb:g} KiB", "grammar_kb")


def _over(param: str, given: str, limit: Any, name: str) -> None:
    raise ApiError(400, f"{param}: {given}, over this server's limit of {limit} (its operator can raise it with "
                   f"--limit {name}=...)", param=param, code="limit_exceeded")


def unpaired_surrogate(value: Any) -> Optional[str]:
    """Where a parsed JSON value holds a string with an unpaired UTF-16 surrogate (JSON's
    "\\ud800" escape parses to one, and no UTF-8 text, tokenizer or log can take it), or None."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return where or "body"
        elif isinstance(item, dict):
            for key, child in item.items():
                path = f"{where}.{key}" if where else str(key)
                stack.append((path, key))
                stack.append((path, child))
        elif isinstance(item, list):
            stack.extend((f"{where}.{i}" if where else str(i), child) for i, child in enumerate(item))
    return None


class Body(BaseModel):
    """A request body whose every string is valid Unicode: an unpaired surrogate is a 400
    naming where it is, not a UnicodeEncodeError deep in a template or the tokenizer."""

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = unpaired_surrogate(data)
        if where is not None:
            raise ApiError(400, f"{where}: the text holds an unpaired UTF-16 surrogate (an escape such as "
                           "\\ud800 with no partner); send valid Unicode", param=where, code="invalid_value")
        return data
