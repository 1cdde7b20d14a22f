"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens), what Claude Code speaks.

A request becomes chat messages and tools in OpenAI's shapes (the one generate path the chat
endpoint uses: template, tools, prompt cache, constraints), and the chunks come back as
Anthropic's content blocks and stream events. Tool results in user turns become tool
messages; tool_use blocks in assistant turns become tool calls.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, Optional, Union

from fastapi import FastAPI, Request
from pydantic import ConfigDict
from sse_starlette.sse import ServerSentEvent

from ..surfaces.completions import Completion, generate_options, shaping_options, tool_setup
from ..errors import InvalidParameterError, PromptTooLongError
from ..surfaces.messages import content_text
from .core import Server
from .errors import ApiError, from_library
from .jobs import Job
from .limits import Body

if TYPE_CHECKING:
    from ..engine import SpecLlama

log = logging.getLogger("specllama")

PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Claude Code's attribution block at the head of the system prompt: a billing header that
# Anthropic's API reads and removes before the model sees the prompt. Removed here too, so it
# never reaches the model and the prompt cache keeps serving the rest of the prompt
BILLING_HEADER = "x-anthropic-billing-header:"
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


class MessagesBody(Body):
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    messages: list[Any]
    system: Union[None, str, list[Any]] = None
    max_tokens: int = 4096
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: float = 1.0  # Anthropic's default
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[dict] = None
    metadata: Optional[dict] = None
    thinking: Optional[dict] = None  # accepted; this server's models answer without a thinking block


class CountBody(Body):
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    messages: list[Any]
    system: Union[None, str, list[Any]] = None
    tools: Optional[list[dict]] = None
    tool_choice: Optional[dict] = None


def add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/messages")
    async def messages(body: MessagesBody, request: Request) -> Any:
        llm = server.ready()
        server.check_model(body.model)
        scope = server.scope_of(request)
        return await server.answer(request, lambda: Turn.of(server, llm, body, scope), body.stream,
                                   lambda job, turn: server.events(
                                       request, job, _events(job), ping=10,
                                       ping_message_factory=lambda: ServerSentEvent(data='{"type": "ping"}',
                                                                                    event="ping")))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountBody) -> dict:
        llm = server.ready()
        server.check_model(body.model)

        def count() -> int:
            server.limits.check(messages=body.messages, tools=body.tools)
            try:
                messages, tools, tool_choice, parallel = translate(body)
                return len(tool_setup(llm, messages, tools, tool_choice, parallel, None)[0])
            except Exception as e:
                raise _error(e) from None

        return {"input_tokens": await server.prepare(count)}


def _error(e: Exception) -> ApiError:
    if isinstance(e, PromptTooLongError):  # the words Claude Code's SDK looks for to compact the history
        return ApiError(400, f"prompt is too long: {e.n_prompt_tokens} tokens > {e.n_ctx} maximum",
                        code="context_length_exceeded")
    return e if isinstance(e, ApiError) else from_library(e, param="messages")


def translate(body: Union[MessagesBody, CountBody]) -> tuple[list[dict], Optional[list[dict]], Any, Optional[bool]]:
    """(chat messages, tools, tool_choice, parallel_tool_calls) in OpenAI's shapes."""
    messages: list[dict] = []
    system = body.system
    if isinstance(system, list):
        system = [b for b in system if not (isinstance(b, dict) and str(b.get("text", "")).startswith(BILLING_HEADER))]
    elif isinstance(system, str) and system.startswith(BILLING_HEADER):
        system = system.split("\n", 1)[1] if "\n" in system else ""
    if system:
        messages.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(body.messages):
        messages += _message(m, f"messages.{i}")
    tools: list[dict] = []
    if body.tools:
        for j, tool in enumerate(body.tools):
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise InvalidParameterError(f"tools.{j}.name", tool.get("name"), "a tool name")
            if tool.get("type") not in (None, "custom"):  # Anthropic's server tools run on their side
                log.info("skipping tool %s of type %s: this server runs no server-side tools", tool["name"],
                         tool.get("type"))
                continue
            function = {"name": tool["name"], "description": tool.get("description", ""),
                        "parameters": tool.get("input_schema") or {"type": "object"}}
            tools.append({"type": "function", "function": function})
    choice, parallel = _tool_choice(body.tool_choice)
    return messages, tools or None, choice if tools else None, parallel


def _tool_choice(choice: Optional[dict]) -> tuple[Any, Optional[bool]]:
    if choice is None:
        return None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = None if not isinstance(choice, dict) or "disable_parallel_tool_use" not in choice \
        else not choice["disable_parallel_tool_use"]
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise InvalidParameterError("tool_choice", choice, '{"type": "auto"}, {"type": "any"}, {"type": "none"} or '
                                '{"type": "tool", "name": ...}')


def _text(content: Any, where: str) -> str:
    """Text of a string or of text blocks (cache_control and citations are accepted, not used)."""
    if isinstance(content, list):
        content = [block for block in content if not (isinstance(block, dict) and block.get("type") in
                                                      ("thinking", "redacted_thinking"))]
    return content_text(content, where, allow_none=False)


def _message(m: Any, where: str) -> list[dict]:
    """One Anthropic message as chat messages: tool results first (each a tool message), then
    the rest; an assistant's tool_use blocks become its tool calls."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
        raise InvalidParameterError(f"{where}.role", m.get("role") if isinstance(m, dict) else m,
                                    "user, assistant (or system)")
    content = m.get("content")
    if not isinstance(content, list):
        return [{"role": m["role"], "content": _text(content, f"{where}.content")}]
    out: list[dict] = []
    texts: list[Any] = []
    calls: list[dict] = []
    for k, block in enumerate(content):
        at = f"{where}.content.{k}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result":
            result = block.get("content", "")
            text = _text(result, f"{at}.content") if result is not None else ""
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text})
        elif kind == "tool_use":
            if not isinstance(block.get("name"), str):
                raise InvalidParameterError(f"{at}.name", block.get("name"), "the name of the tool called")
            calls.append({"id": str(block.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"), "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # an earlier model's reasoning: not part of what this model is shown
        else:
            texts.append(block)
    if texts or (not out and not calls):
        out.append({"role": m["role"], "content": _text(texts, f"{where}.content")})
    if calls:
        if m["role"] != "assistant":
            raise InvalidParameterError(f"{where}.content", "tool_use", "tool_use blocks in assistant messages only")
        if out and out[-1]["role"] == "assistant":
            out[-1]["tool_calls"] = calls
        else:
            out.append({"role": "assistant", "content": "", "tool_calls": calls})
    return out


class Turn:
    """One Messages request on the chat path: its Completion, and the blocks it produced."""

    def __init__(self, server: Server, completion: Completion, stream: bool):
        self.server, self.completion, self.stream = server, completion, stream
        self.id = f"msg_{uuid.uuid4().hex[:24]}"

    @classmethod
    def of(cls, server: Server, llm: "SpecLlama", body: MessagesBody, scope: str = "") -> "Turn":
        """The request's turn (in a worker thread); scope: its prompt-cache scope."""
        server.limits.check(stop=body.stop_sequences, stop_param="stop_sequences", messages=body.messages,
                            tools=body.tools)
        try:
            messages, tools, tool_choice, parallel = translate(body)
            tokens, tool_format, grammar = tool_setup(llm, messages, tools, tool_choice, parallel, None)
            shaping = shaping_options(grammar=grammar)
            options = generate_options(body.max_tokens if body.max_tokens > 0 else None, len(tokens),
                                       llm.target.n_ctx, temperature=body.temperature,
                                       top_p=1.0 if body.top_p is None else body.top_p, min_p=0.0,
                                       top_k=0 if body.top_k is None else body.top_k, stop=body.stop_sequences,
                                       seed=None, cache_scope=scope, **shaping)
            completion = Completion(llm, tokens, options, chat=True, model=server.model_id, tool_format=tool_format)
        except Exception as e:
            raise _error(e) from None
        if body.thinking:
            log.info("thinking was asked for; %s answers without a thinking block", server.model_id)
        return cls(server, completion, body.stream)

    def usage(self) -> dict:
        stats, n_out = self.completion.stream.stats, 0
        if self.completion.stream.result is not None:
            n_out = len(self.completion.stream.result.tokens)
        n_cached = stats.n_prompt_cached if stats is not None else 0
        return {"input_tokens": len(self.completion.tokens) - n_cached, "output_tokens": n_out,
                "cache_read_input_tokens": n_cached, "cache_creation_input_tokens": 0}

    def stop(self, finish: str) -> tuple[str, Optional[str]]:
        result = self.completion.stream.result
        matched = result.stop_sequence if result is not None else None
        return ("stop_sequence", matched) if matched else (_STOP_REASONS.get(finish, "end_turn"), None)

    def message(self, content: list[dict], stop_reason: Optional[str] = None,
                stop_sequence: Optional[str] = None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.server.model_id,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": self.usage()}

    def work(self, job: Job) -> Optional[dict]:
        job.track(self.completion.stream)
        try:
            if self.stream:
                for event in self._stream_events():
                    job.emit(event)
                return None
            blocks: list[dict] = []
            finish = "stop"
            for kind, value in deltas(self.completion):
                if kind == "text":
                    if not blocks or blocks[-1]["type"] != "text":
                        blocks.append({"type": "text", "text": ""})
                    blocks[-1]["text"] += value
                elif kind == "tool_call":
                    blocks.append(_tool_use(value))
                else:
                    finish = value
            return self.message(blocks, *self.stop(finish))
        finally:
            if self.completion.stats is not None:
                self.server.record("messages", self.completion.stats)

    def _stream_events(self) -> Iterator[tuple[str, dict]]:
        """Anthropic's event sequence: message_start, each block's start/deltas/stop, message_delta
        with the stop reason and usage, message_stop. message_start waits for the prefill, so its
        usage says how much of the prompt the cache served."""
        index, open_block, started, finish = -1, None, False, "stop"
        for kind, value in deltas(self.completion):
            if not started:
                started = True
                yield "message_start", {"type": "message_start", "message": self.message([])}
            if kind == "end":
                finish = value
                continue
            if open_block is not None and (kind == "tool_call" or open_block != "text"):
                yield "content_block_stop", {"type": "content_block_stop", "index": index}
                open_block = None
            if kind == "text":
                if open_block is None:
                    index, open_block = index + 1, "text"
                    yield "content_block_start", {"type": "content_block_start", "index": index,
                                                  "content_block": {"type": "text", "text": ""}}
                yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                              "delta": {"type": "text_delta", "text": value}}
            else:
                block, index, open_block = _tool_use(value), index + 1, "tool_use"
                yield "content_block_start", {"type": "content_block_start", "index": index,
                                              "content_block": {**block, "input": {}}}
                yield "content_block_delta", {"type": "content_block_delta", "index": index,
                                              "delta": {"type": "input_json_delta",
                                                        "partial_json": json.dumps(block["input"])}}
        if not started:
            yield "message_start", {"type": "message_start", "message": self.message([])}
        if open_block is not None:
            yield "content_block_stop", {"type": "content_block_stop", "index": index}
        stop_reason, stop_sequence = self.stop(finish)
        yield "message_delta", {"type": "message_delta", "usage": self.usage(),
                                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}}
        yield "message_stop", {"type": "message_stop"}


def deltas(completion: Completion) -> Iterator[tuple[str, Any]]:
    """A chat Completion's chunks as ("text", str), ("tool_call", OpenAI call) and ("end", reason)."""
    for chunk in completion.chunks():
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        if delta.get("content"):
            yield "text", delta["content"]
        for call in delta.get("tool_calls") or ():
            yield "tool_call", call
        if choice.get("finish_reason") is not None:
            yield "end", choice["finish_reason"]


def _tool_use(call: dict) -> dict:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": arguments}


async def _events(job: Job) -> AsyncIterator[ServerSentEvent]:
    try:
        async for name, data in job.items():
            yield ServerSentEvent(data=json.dumps(data), event=name)
    except Exception as e:  # mid-stream the status is sent already: an error event, as Anthropic does
        yield ServerSentEvent(data=json.dumps(_error(e).body("anthropic")), event="error")
