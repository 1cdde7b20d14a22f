"""OpenAI's /v1/chat/completions and /v1/completions: requests become Completions on the one
generate path, and their chunks and results go back as OpenAI's JSON and SSE chunks.

n > 1 asks for several choices: sampled ones are generated one after another, each with its
own seed (the request's seed + the choice's index, or none); greedy ones are the same text, so
it is generated once and sent as every choice, as OpenAI's greedy choices are identical.
/v1/completions also takes a list of prompts (n choices each, indexed prompt by prompt).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import replace
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, Optional, Union

from fastapi import FastAPI, Request
from pydantic import ConfigDict

from ..surfaces.completions import (IGNORED, NEUTRAL, Completion, chat_logprobs, check_supported,
                                    generate_options, shaping_options, timings, tool_setup)
from ..errors import InvalidParameterError
from ..options import GenerateOptions
from ..streams import PromptProgress
from .core import Server
from .errors import ApiError, from_library
from .jobs import Job, ProgressEvents
from .limits import Body

if TYPE_CHECKING:
    from ..engine import SpecLlama

log = logging.getLogger("specllama")

PATHS = ("/v1/chat/completions", "/v1/completions")
MAX_N = 16  # choices per request: each sampled one is a whole generation on this machine


class _Body(Body):
    """Fields both endpoints take; unknown OpenAI fields are checked, not silently dropped."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: float = 0.8
    top_p: float = 0.95
    min_p: float = 0.05
    top_k: int = 40
    n: Optional[int] = None
    stop: Union[None, str, list[str]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[dict] = None
    return_progress: bool = False  # llama-server's: prompt_progress chunks while a stream's prompt is read
    color: bool = False  # each streamed choice's "origins": who chose its tokens (draft, lookup, target)
    n_draft: Union[None, int, str] = None
    speculative: bool = True
    # applied in verification (constraints.py): greedy output stays plain decoding's under them
    response_format: Optional[dict] = None
    grammar: Optional[str] = None  # GBNF, as llama.cpp's server takes it
    json_schema: Optional[dict] = None  # llama.cpp's server field
    logit_bias: Optional[dict[str, float]] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repeat_penalty: float = 1.0


class CompletionBody(_Body):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    suffix: Optional[str] = None  # fill in the middle between prompt and suffix


class ChatBody(_Body):
    messages: list[Any]  # checked by messages.normalize, which names the field that is wrong
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[None, str, dict] = None
    parallel_tool_calls: Optional[bool] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None


def add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> Any:
        return await respond(server, request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody, request: Request) -> Any:
        return await respond(server, request, body, chat=True)


async def respond(server: Server, request: Request, body: _Body, chat: bool) -> Any:
    llm = server.ready()
    server.check_model(body.model)
    scope = server.scope_of(request)

    def prepare() -> Plan:
        try:
            return Plan.of(server, llm, body, chat, scope)
        except ApiError:
            raise
        except Exception as e:
            raise from_library(e, param="messages" if chat else "prompt") from None

    return await server.answer(request, prepare, body.stream,
                               lambda job, plan: server.events(request, job, _events(job, plan), ping=15))


async def _events(job: Job, plan: "Plan") -> AsyncIterator[str]:
    """SSE data: the chunks (each choice's last with its timings), a usage chunk if asked, [DONE]."""
    try:
        async for chunk in job.items():
            yield json.dumps(chunk)  # at once: holding one back would delay each token a round
        if plan.include_usage:
            yield json.dumps({**plan.envelope(chunk=True), "choices": [], "usage": plan.usage(),
                              "timings": plan.timings()})
        yield "[DONE]"
    except Exception as e:  # mid-stream the status is sent already: an error event, as llama-server
        yield json.dumps(from_library(e).body())


class Plan:
    """One request's choices: which prompts, how many choices each, and the options they share.

    The first choice's Completion is built at once, so every option is checked before the
    request waits for its turn; the others are built when their turn comes."""

    def __init__(self, server: Server, llm: "SpecLlama", prompts: list[list[int]], chat: bool, options: GenerateOptions,
                 tool_format: Any, n: int, stream: bool, include_usage: bool, return_progress: bool = False,
                 color: bool = False):
        self.server, self.llm, self.prompts, self.chat = server, llm, prompts, chat
        self.tool_format, self.n = tool_format, n
        self.stream, self.include_usage, self.color = stream, include_usage, color
        self.progress = ProgressEvents(self._progress_chunk)
        self.options = replace(options, on_progress=self.progress) if return_progress and stream else options
        self.greedy = options.temperature == 0
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4()}"
        self.created = int(time.time())
        self._first: Optional[Completion] = self._completion(0, 0)
        self.done: list[tuple[int, Completion, list[int]]] = []  # (prompt, run, the choices it serves)

    @classmethod
    def of(cls, server: Server, llm: "SpecLlama", body: _Body, chat: bool, scope: str = "") -> "Plan":
        """The request's plan (in a worker thread: it renders, tokenizes and compiles); scope:
        its prompt-cache scope."""
        n = 1 if body.n is None else body.n
        if not 1 <= n <= MAX_N:
            raise InvalidParameterError("n", n, f"an integer in 1..{MAX_N} (choices per request)")
        # the field that shapes the output, if any: one is allowed (checked below), its size limited
        shaped = next((f for f in ("grammar", "json_schema", "response_format") if getattr(body, f) is not None),
                      "grammar")
        server.limits.check(stop=body.stop, messages=body.messages if isinstance(body, ChatBody) else None,
                            tools=body.tools if isinstance(body, ChatBody) else None,
                            grammar=getattr(body, shaped), grammar_param=shaped,
                            n_prompts=len(_batch(body.prompt)) if isinstance(body, CompletionBody) else 1, n=n)
        extra = {k: v for k, v in (body.model_extra or {}).items() if k in NEUTRAL or k in IGNORED}
        unknown = sorted(set(body.model_extra or {}) - set(extra) - {"max_completion_tokens"})
        check_supported(extra)
        grammar, tool_format = body.grammar, None
        response_format = body.response_format
        if body.json_schema is not None:
            if response_format is not None or grammar is not None:
                raise InvalidParameterError("json_schema", "...", "left out when response_format or a grammar "
                                            "is given")
            response_format = {"type": "json_schema", "json_schema": {"schema": body.json_schema}}
        if chat:
            assert isinstance(body, ChatBody)
            tokens, tool_format, grammar = tool_setup(llm, body.messages, body.tools, body.tool_choice,
                                                      body.parallel_tool_calls, grammar)
            prompts = [tokens]
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            n_logprobs = chat_logprobs(body.logprobs, body.top_logprobs)
        else:
            assert isinstance(body, CompletionBody)
            batch = _batch(body.prompt)
            if body.suffix is not None:  # OpenAI's legacy FIM field, with the GGUF's FIM tokens
                if not all(isinstance(p, str) for p in batch):
                    raise InvalidParameterError("suffix", body.suffix, "given with a text prompt")
                batch = [llm.fim_tokens(str(p), body.suffix, n_predict=body.max_tokens or 128) for p in batch]
            prompts = [llm.prompt_tokens(p) for p in batch]
            max_tokens, n_logprobs = body.max_tokens, body.logprobs
        shaping = shaping_options(grammar=grammar, response_format=response_format, logit_bias=body.logit_bias,
                                  repeat_penalty=body.repeat_penalty, frequency_penalty=body.frequency_penalty,
                                  presence_penalty=body.presence_penalty, logprobs=n_logprobs)
        options = generate_options(max_tokens, max(len(p) for p in prompts), llm.target.n_ctx,
                                   temperature=body.temperature, top_p=body.top_p, min_p=body.min_p,
                                   top_k=body.top_k, stop=body.stop, seed=body.seed, n_draft=body.n_draft,
                                   speculative=body.speculative, cache_scope=scope, **shaping)
        if unknown:
            log.info("ignoring request fields %s", ", ".join(unknown))
        return cls(server, llm, prompts, chat, options, tool_format, n, body.stream,
                   bool((body.stream_options or {}).get("include_usage")), body.return_progress, body.color)

    def _completion(self, j: int, i: int) -> Completion:
        options = self.options
        if not self.greedy and i and options.seed is not None:
            options = replace(options, seed=options.seed + i)
        completion = Completion(self.llm, self.prompts[j], options, chat=self.chat, model=self.server.model_id,
                                tool_format=self.tool_format, index=j * self.n + i, id=self.id,
                                origins=self.color and self.stream)
        completion.created = self.created
        return completion

    def _runs(self) -> Iterator[tuple[int, Completion, list[int]]]:
        for j in range(len(self.prompts)):
            for i in range(1 if self.greedy else self.n):
                first, self._first = self._first, None
                completion = first if first is not None else self._completion(j, i)
                yield j, completion, [j * self.n + k for k in range(self.n)] if self.greedy else [j * self.n + i]

    def work(self, job: Job) -> Optional[dict]:
        """Runs in the job's thread: every choice in turn; the response (None for a stream)."""
        self.progress.start(job)
        responses = []
        for j, completion, indices in self._runs():
            if job.cancelled:
                break
            job.track(completion.stream)
            try:
                if self.stream:
                    for chunk in completion.chunks():
                        self._decorate(chunk, completion)
                        for index in indices:
                            job.emit(_with_index(chunk, index, self.chat))
                else:
                    responses.append((completion.response(), indices))
            finally:
                if completion.stats is not None:
                    self.server.record("chat" if self.chat else "completion", completion.stats)
            self.done.append((j, completion, indices))
        if self.stream or job.cancelled:
            return None
        choices = sorted(({**response["choices"][0], "index": index} for response, indices in responses
                          for index in indices), key=lambda c: c["index"])
        return {**self.envelope(), "choices": choices, "usage": self.usage(), "timings": self.timings()}

    def _decorate(self, chunk: dict, completion: Completion) -> None:
        chunk["system_fingerprint"] = self.server.fingerprint
        delta = chunk["choices"][0].get("delta")
        if delta is not None and "role" in delta and "content" not in delta:
            delta["content"] = ""  # OpenAI's first delta: clients read delta["content"] raw
        if chunk["choices"][0]["finish_reason"] is not None and completion.stats is not None:
            chunk["timings"] = timings(completion.stats)  # on each choice's last chunk, as llama-server

    def _progress_chunk(self, progress: PromptProgress) -> dict:
        """llama-server's prompt_progress chunk: no text yet, the prefill's counts."""
        empty = {"delta": {"role": "assistant", "content": ""}} if self.chat else {"text": "", "logprobs": None}
        return {**self.envelope(chunk=True), "choices": [{"index": 0, **empty, "finish_reason": None}],
                "prompt_progress": progress.as_dict()}

    def envelope(self, chunk: bool = False) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.server.model_id,
                "system_fingerprint": self.server.fingerprint}

    def usage(self) -> dict:
        """Prompt tokens once per prompt, completion tokens of every choice; cached: what each
        prompt's first run reused."""
        n_prompt = sum(len(p) for p in self.prompts)
        n_completion = sum(len(c.stream.result.tokens) * len(indices) for _, c, indices in self.done
                           if c.stream.result is not None)
        first_runs = {j: c for j, c, _ in reversed(self.done)}.values()  # each prompt's first run
        n_cached = sum(c.stats.n_prompt_cached for c in first_runs if c.stats is not None)
        return {"prompt_tokens": n_prompt, "completion_tokens": n_completion, "total_tokens": n_prompt + n_completion,
                "prompt_tokens_details": {"cached_tokens": n_cached}}

    def timings(self) -> Optional[dict]:
        stats = self.done[0][1].stats if self.done else None
        return None if stats is None else timings(stats)


def _batch(prompt: Any) -> list:
    """/v1/completions' prompts: a list of texts or of token lists is several, anything else one."""
    return prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]


def _with_index(chunk: dict, index: int, chat: bool) -> dict:
    if chunk["choices"][0]["index"] == index:
        return chunk
    return {**chunk, "choices": [{**chunk["choices"][0], "index": index}]}
