"""OpenAI's Responses API (/v1/responses), the only API the Codex CLI speaks. Stateless: every
request carries its history (as Codex sends it), previous_response_id is refused with a 400.

input items (messages, function_call, function_call_output) become chat messages on the one
generate path; function tools become tools (other tool types are skipped, with a log line);
text.format json_schema goes through the grammar path. Output and stream events follow the
Responses shapes: output_text and function_call items, response.* events numbered in order.
"""

from __future__ import annotations

import json
from dataclasses import replace
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, Optional, Union

from fastapi import FastAPI, Request
from pydantic import ConfigDict
from sse_starlette.sse import ServerSentEvent

from ..surfaces.completions import Completion, generate_options, shaping_options, tool_setup
from ..errors import InvalidParameterError
from ..surfaces.messages import content_text
from .anthropic_messages import deltas
from .core import Server
from .errors import ApiError, from_library
from .jobs import Job, ProgressEvents
from .limits import Body

if TYPE_CHECKING:
    from ..engine import SpecLlama

log = logging.getLogger("specllama")

PATHS = ("/v1/responses",)
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponsesBody(Body):
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    input: Union[str, list[Any]] = []
    instructions: Optional[str] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[None, str, dict] = None
    parallel_tool_calls: Optional[bool] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    text: Optional[dict] = None
    stream: bool = False
    store: Optional[bool] = None
    previous_response_id: Optional[str] = None
    reasoning: Optional[dict] = None
    include: Optional[list[str]] = None
    prompt_cache_key: Optional[str] = None
    metadata: Optional[dict] = None
    return_progress: bool = False  # llama-server's: response.in_progress events with prompt_progress



def add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/responses")
    async def responses(body: ResponsesBody, request: Request) -> Any:
        llm = server.ready()
        server.check_model(body.model)
        scope = server.scope_of(request)
        return await server.answer(request, lambda: Reply.of(server, llm, body, scope), body.stream,
                                   lambda job, reply: server.events(request, job, _events(job), ping=15))


def translate(body: ResponsesBody) -> tuple[list[dict], Optional[list[dict]], Any]:
    """(chat messages, function tools, tool_choice) in the chat endpoint's shapes."""
    messages: list[dict] = [{"role": "system", "content": body.instructions}] if body.instructions else []
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) \
        else body.input
    for i, item in enumerate(items):
        _item(item, f"input.{i}", messages)
    tools = []
    for j, tool in enumerate(body.tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            log.info("skipping tool %s of type %s: only function tools run here", j, kind)
            continue
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise InvalidParameterError(f"tools.{j}.name", tool.get("name"), "a function name")
        function = {"name": tool["name"], "description": tool.get("description") or "",
                    "parameters": tool.get("parameters") or {"type": "object"}}
        tools.append({"type": "function", "function": function})
    choice = body.tool_choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    elif isinstance(choice, dict):  # allowed_tools, hosted tools: nothing to force here
        choice = "auto"
    return messages, tools or None, choice if tools else None


def _item(item: Any, where: str, messages: list[dict]) -> None:
    if not isinstance(item, dict):
        raise InvalidParameterError(where, item, "an input item object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        role = _ROLES.get(role) if isinstance(role, str) else None
        if role is None:
            raise InvalidParameterError(f"{where}.role", item.get("role"), "user, assistant, system or developer")
        messages.append({"role": role, "content": content_text(item.get("content"), f"{where}.content",
                                                               allow_none=False)})
    elif kind == "function_call":
        call = {"id": str(item.get("call_id") or item.get("id") or ""), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # calls after its text: one assistant turn
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": str(item.get("call_id") or ""),
                         "content": output if isinstance(output, str) else json.dumps(output)})
    elif kind in ("reasoning", "item_reference"):
        return  # reasoning this model did not produce; references to stored items (nothing is stored)
    else:
        log.info("skipping input item of type %s", kind)


def _format(text: Optional[dict]) -> Optional[dict]:
    """A chat response_format from text.format."""
    fmt = (text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt["type"] == "json_object":
        return {"type": "json_object"}
    if fmt["type"] == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema") or {}}}
    raise InvalidParameterError("text.format.type", fmt["type"], "text, json_object or json_schema")


class Reply:
    """One Responses request on the chat path, and its output items."""

    def __init__(self, server: Server, body: ResponsesBody, completion: Optional[Completion]):
        self.server, self.body, self.completion = server, body, completion
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._n_event = 0
        self.progress = ProgressEvents(lambda p: self._event("response.in_progress",
                                                             response=self.response([], "in_progress"),
                                                             prompt_progress=p.as_dict()))

    @classmethod
    def of(cls, server: Server, llm: "SpecLlama", body: ResponsesBody, scope: str = "") -> "Reply":
        """The request's reply (in a worker thread); scope: its prompt-cache scope."""
        fmt = (body.text or {}).get("format") if isinstance(body.text, dict) else None
        server.limits.check(messages=body.input if isinstance(body.input, list) else None, messages_param="input",
                            tools=body.tools, grammar=fmt.get("schema") if isinstance(fmt, dict) else None,
                            grammar_param="text.format.schema")
        if body.previous_response_id is not None:
            raise ApiError(400, "previous_response_id: this server stores no responses; send the whole history "
                           "in input (as Codex does) and store: false", param="previous_response_id",
                           code="invalid_value")
        try:
            messages, tools, choice = translate(body)
            if not any(m["role"] != "system" for m in messages):
                return cls(server, body, None)  # a probe with no input: an empty response
            tokens, tool_format, grammar = tool_setup(llm, messages, tools, choice, body.parallel_tool_calls, None)
            shaping = shaping_options(grammar=grammar, response_format=_format(body.text))
            reply = cls(server, body, None)
            options = generate_options(body.max_output_tokens, len(tokens), llm.target.n_ctx,
                                       temperature=1.0 if body.temperature is None else body.temperature,
                                       top_p=1.0 if body.top_p is None else body.top_p, min_p=0.0, top_k=0,
                                       stop=None, seed=None, cache_scope=scope, **shaping)
            if body.return_progress and body.stream:
                options = replace(options, on_progress=reply.progress)
            reply.completion = Completion(llm, tokens, options, chat=True, model=server.model_id,
                                          tool_format=tool_format)
        except ApiError:
            raise
        except Exception as e:
            raise from_library(e, param="input") from None
        return reply

    def response(self, output: list[dict], status: str) -> dict:
        b, c = self.body, self.completion
        stats = c.stream.stats if c is not None else None
        n_in = len(c.tokens) if c is not None else 0
        n_out = len(c.stream.result.tokens) if c is not None and c.stream.result is not None else 0
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.server.model_id, "output": output, "instructions": b.instructions,
                "tools": b.tools or [], "tool_choice": b.tool_choice or "auto",
                "parallel_tool_calls": b.parallel_tool_calls is not False, "temperature": b.temperature,
                "top_p": b.top_p, "max_output_tokens": b.max_output_tokens,
                "text": b.text or {"format": {"type": "text"}},
                "previous_response_id": None, "store": False, "metadata": b.metadata or {}, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "usage": {"input_tokens": n_in, "output_tokens": n_out, "total_tokens": n_in + n_out,
                          "input_tokens_details": {"cached_tokens": stats.n_prompt_cached if stats else 0},
                          "output_tokens_details": {"reasoning_tokens": 0}}}

    def _event(self, kind: str, **fields: Any) -> tuple[str, dict]:
        self._n_event += 1
        return kind, {"type": kind, "sequence_number": self._n_event - 1, **fields}

    def work(self, job: Job) -> Optional[dict]:
        self.progress.start(job)
        if self.completion is not None:
            job.track(self.completion.stream)
        try:
            events = self._stream()
            if self.body.stream:
                for event in events:
                    job.emit(event)
                return None
            final = None
            for _, data in events:
                final = data.get("response", final)
            return final
        finally:
            if self.completion is not None and self.completion.stats is not None:
                self.server.record("responses", self.completion.stats)

    def _stream(self) -> Iterator[tuple[str, dict]]:
        """response.created, then per output item its added/delta/done events, then
        response.completed (or response.incomplete at max_output_tokens)."""
        yield self._event("response.created", response=self.response([], "in_progress"))
        yield self._event("response.in_progress", response=self.response([], "in_progress"))
        output: list[dict] = []
        text_item: Optional[dict] = None
        finish = "stop"
        for kind, value in deltas(self.completion) if self.completion is not None else ():
            if kind == "end":
                finish = value
            elif kind == "text":
                if text_item is None:
                    text_item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                                 "role": "assistant", "content": []}
                    yield from self._added(text_item, output)
                    yield self._event("response.content_part.added", item_id=text_item["id"],
                                      output_index=len(output) - 1, content_index=0,
                                      part={"type": "output_text", "text": "", "annotations": []})
                    text_item["content"].append({"type": "output_text", "text": "", "annotations": []})
                text_item["content"][0]["text"] += value
                yield self._event("response.output_text.delta", item_id=text_item["id"],
                                  output_index=output.index(text_item), content_index=0, delta=value, logprobs=[])
            else:
                if text_item is not None:
                    yield from self._text_done(text_item, output)
                    text_item = None
                yield from self._call(value, output)
        if text_item is not None:
            yield from self._text_done(text_item, output)
        status = "incomplete" if finish == "length" else "completed"
        yield self._event(f"response.{status}", response=self.response(output, status))

    def _added(self, item: dict, output: list[dict]) -> Iterator[tuple[str, dict]]:
        output.append(item)
        yield self._event("response.output_item.added", output_index=len(output) - 1, item=dict(item, content=[])
                          if item["type"] == "message" else item)

    def _text_done(self, item: dict, output: list[dict]) -> Iterator[tuple[str, dict]]:
        index, part = output.index(item), item["content"][0]
        yield self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                          text=part["text"], logprobs=[])
        yield self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=part)
        item["status"] = "completed"
        yield self._event("response.output_item.done", output_index=index, item=item)

    def _call(self, call: dict, output: list[dict]) -> Iterator[tuple[str, dict]]:
        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
        yield from self._added(dict(item), output)
        index, arguments = len(output) - 1, call["function"]["arguments"]
        yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=arguments)
        yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          arguments=arguments, name=item["name"])
        output[index] = {**item, "arguments": arguments, "status": "completed"}
        yield self._event("response.output_item.done", output_index=index, item=output[index])


async def _events(job: Job) -> AsyncIterator[ServerSentEvent]:
    try:
        async for name, data in job.items():
            yield ServerSentEvent(data=json.dumps(data), event=name)
    except Exception as e:  # mid-stream: an error event, then the stream ends
        error = e if isinstance(e, ApiError) else from_library(e)
        yield ServerSentEvent(data=json.dumps({"type": "error", "code": error.code, "message": error.message,
                                               "param": error.param, "sequence_number": 0}), event="error")
