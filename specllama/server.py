"""`specllama serve`: an OpenAI-compatible HTTP server on SpecLlama's completion API.

Endpoints: POST /v1/chat/completions and /v1/completions (plain JSON or SSE streams), GET
/v1/models, GET /health (503 while loading) and GET /metrics (Prometheus). One generation runs
at a time; further requests wait their turn in arrival order. A client that disconnects
mid-stream cancels its generation at the next round. Needs the `server` extra (FastAPI,
uvicorn, sse-starlette, prometheus-client), imported only here.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from sse_starlette.sse import EventSourceResponse
from starlette.concurrency import run_in_threadpool

from .completions import (IGNORED, NEUTRAL, Completion, chat_logprobs, check_supported, generate_options,
                          shaping_options, timings, tool_setup)
from .errors import InvalidParameterError, PromptTooLongError, SpecLlamaError

log = logging.getLogger("specllama")


class _Body(BaseModel):
    """Fields both endpoints take; unknown OpenAI fields are checked, not silently dropped."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: float = 0.8
    top_p: float = 0.95
    min_p: float = 0.05
    top_k: int = 40
    stop: Union[None, str, list[str]] = None
    seed: Optional[int] = None
    stream: bool = False
    stream_options: Optional[dict] = None
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
    prompt: Union[str, list[int]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None


class ChatBody(_Body):
    messages: list[dict] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[dict]] = None
    tool_choice: Union[None, str, dict] = None
    parallel_tool_calls: Optional[bool] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None


class ApiError(Exception):
    """An OpenAI-shaped error: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error"):
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.kind, "param": self.param,
                                       "code": self.code}}, status_code=self.status)


class Metrics:
    """The server's Prometheus counters, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("specllama_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter("specllama_prompt_tokens", "Prompt tokens processed", registry=self.registry)
        self.prompt_cached_tokens = Counter("specllama_prompt_cached_tokens",
                                            "Prompt tokens reused from the prompt cache, not decoded",
                                            registry=self.registry)
        self.prompt_cache_lookups = Counter("specllama_prompt_cache_lookups",
                                            "Prefills by where their reused state came from (live, saved, none)",
                                            ["source"], registry=self.registry)
        self.generated_tokens = Counter("specllama_generated_tokens", "Tokens generated", registry=self.registry)
        self.drafted_tokens = Counter("specllama_drafted_tokens", "Tokens drafted", registry=self.registry)
        self.accepted_tokens = Counter("specllama_accepted_tokens", "Drafted tokens the target accepted",
                                       registry=self.registry)
        self.near_ties = Counter("specllama_near_ties", "Greedy tokens decided at a near-tie (fidelity)",
                                 registry=self.registry)
        self.seconds = Counter("specllama_phase_seconds", "Time spent per phase", ["phase"], registry=self.registry)

    def record(self, stats: Any) -> None:
        self.prompt_tokens.inc(stats.n_prompt)
        self.prompt_cached_tokens.inc(stats.n_prompt_cached)
        self.prompt_cache_lookups.labels(stats.prompt_cache).inc()
        self.generated_tokens.inc(stats.n_generated)
        self.drafted_tokens.inc(stats.n_drafted)
        self.accepted_tokens.inc(stats.n_accepted)
        self.near_ties.inc(stats.near_ties or 0)
        for phase, seconds in (("prefill", stats.t_prefill + stats.t_draft_prefill), ("draft", stats.t_draft),
                               ("verify", stats.t_verify),
                               ("calibrate", stats.t_calibrate), ("other", stats.t_other)):
            self.seconds.labels(phase).inc(seconds)


def create_app(load: Callable[[], Any], model_id: str, api_key: Optional[str] = None) -> FastAPI:
    """The app; load() builds the SpecLlama in a background thread once the server is up.

    Args:
        load: returns the SpecLlama to serve.
        model_id: the name /v1/models lists and requests may name.
        api_key: when set, every endpoint but /health needs "Authorization: Bearer <api_key>".
    """
    app = FastAPI(title="specllama", docs_url=None, redoc_url=None)
    state: dict[str, Any] = {"llm": None, "error": None}
    turn = asyncio.Lock()  # waiters are served in arrival order
    metrics = Metrics()
    created = int(time.time())

    def load_in_background() -> None:
        try:
            state["llm"] = load()
        except BaseException as e:  # reported by /health and every request
            state["error"] = e
            log.error("loading failed: %s", e)

    @app.on_event("startup")
    async def start_loading() -> None:
        threading.Thread(target=load_in_background, name="specllama-load", daemon=True).start()

    @app.on_event("shutdown")
    async def close_model() -> None:
        async with turn:
            if state["llm"] is not None:
                state["llm"].close()

    @app.middleware("http")
    async def guard(request: Request, call_next):
        endpoint = request.url.path
        if api_key is not None and endpoint != "/health":
            sent = request.headers.get("authorization", "")
            if not secrets.compare_digest(sent.encode(), f"Bearer {api_key}".encode()):
                response = ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>",
                                    code="invalid_api_key", kind="authentication_error").response()
                metrics.requests.labels(endpoint, "401").inc()
                return response
        try:
            response = await call_next(request)
        except ApiError as e:
            response = e.response()
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            return ApiError(400, "the request body is not valid JSON", code="invalid_json").response()
        param = ".".join(where) or None
        return ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param,
                        code="invalid_value").response()

    def ready() -> Any:
        if state["error"] is not None:
            raise ApiError(503, f"the model failed to load: {state['error']}", kind="server_error", code="load_failed")
        if state["llm"] is None:
            raise ApiError(503, "the model is still loading; retry shortly", kind="server_error", code="loading")
        return state["llm"]

    @app.get("/health")
    async def health() -> JSONResponse:
        if state["llm"] is None:
            return JSONResponse({"status": "error" if state["error"] else "loading"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "specllama"}]}

    def start(body: _Body, chat: bool) -> Completion:
        """Check the request and build its Completion (raises ApiError for bad input)."""
        llm = ready()
        if body.model is not None and body.model != model_id:
            raise ApiError(400, f"model {body.model!r} is not served here; this server serves {model_id!r}",
                           param="model", code="model_not_found")
        extra = {k: v for k, v in (body.model_extra or {}).items() if k in NEUTRAL or k in IGNORED}
        unknown = sorted(set(body.model_extra or {}) - set(extra) - {"max_completion_tokens"})
        try:
            check_supported(extra)
            grammar, tool_format = body.grammar, None
            if body.json_schema is not None:
                if body.response_format is not None or grammar is not None:
                    raise InvalidParameterError("json_schema", "...", "left out when response_format or a grammar "
                                                "is given")
                body.response_format = {"type": "json_schema", "json_schema": {"schema": body.json_schema}}
            if chat:
                tokens, tool_format, grammar = tool_setup(llm, body.messages, body.tools, body.tool_choice,
                                                          body.parallel_tool_calls, grammar)
                max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
                n_logprobs = chat_logprobs(body.logprobs, body.top_logprobs)
            else:
                tokens = llm._prompt_tokens(body.prompt)
                max_tokens, n_logprobs = body.max_tokens, body.logprobs
            shaping = shaping_options(grammar=grammar, response_format=body.response_format,
                                      logit_bias=body.logit_bias, repeat_penalty=body.repeat_penalty,
                                      frequency_penalty=body.frequency_penalty,
                                      presence_penalty=body.presence_penalty, logprobs=n_logprobs)
            options = generate_options(max_tokens, len(tokens), llm.target.n_ctx, temperature=body.temperature,
                                       top_p=body.top_p, min_p=body.min_p, top_k=body.top_k, stop=body.stop,
                                       seed=body.seed, n_draft=body.n_draft, speculative=body.speculative,
                                       **shaping)
            completion = Completion(llm, tokens, chat=chat, model=model_id, tool_format=tool_format, **options)
        except PromptTooLongError as e:
            raise ApiError(413, str(e), param="messages" if chat else "prompt", code="context_length_exceeded")
        except InvalidParameterError as e:
            raise ApiError(400, str(e), param=e.name, code="invalid_value")
        except (SpecLlamaError, ValueError) as e:
            raise ApiError(400, str(e), code="invalid_value")
        if unknown:
            log.info("ignoring request fields %s", ", ".join(unknown))
        return completion

    async def respond(body: _Body, chat: bool) -> Any:
        await turn.acquire()  # held until this request's generation has ended
        try:
            completion = start(body, chat)
        except BaseException:
            turn.release()
            raise
        if body.stream:
            run = _StreamRun(completion, turn, metrics)  # its worker thread releases the turn
            return EventSourceResponse(run.events(bool((body.stream_options or {}).get("include_usage"))), ping=15)
        try:
            response = await run_in_threadpool(completion.response)
        finally:
            turn.release()
        response["timings"] = timings(completion.stats)
        response["usage"] = completion.usage(details=True)
        metrics.record(completion.stats)
        return response

    @app.post("/v1/completions")
    async def completions(body: CompletionBody) -> Any:
        return await respond(body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatBody) -> Any:
        return await respond(body, chat=True)

    return app


class _StreamRun:
    """A streamed generation in a worker thread that holds the server's turn until it ends.

    Chunks reach events() through a queue. When the client goes away, events() is closed and
    the worker stops at the next round; a stream nobody reads still ends at max_tokens.
    """

    def __init__(self, completion: Completion, turn: asyncio.Lock, metrics: Metrics):
        self.completion, self.turn, self.metrics = completion, turn, metrics
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        threading.Thread(target=self._produce, name="specllama-stream", daemon=True).start()

    def _put(self, item: Any) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def _produce(self) -> None:
        chunks = self.completion.chunks()
        try:
            for chunk in chunks:
                if self.cancelled.is_set():
                    break
                self._put(chunk)
        except BaseException as e:
            self._put(e)
        finally:
            chunks.close()  # a cancelled generation stops here, leaving the models consistent
            if self.completion.stats is not None:
                self.metrics.record(self.completion.stats)
            self._put(None)
            self.loop.call_soon_threadsafe(self.turn.release)

    async def events(self, include_usage: bool) -> AsyncIterator[str]:
        """SSE data: the chunks (timings on the last), a usage chunk if asked, then [DONE]."""
        try:
            last = None
            while (item := await self.queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                if item["choices"][0]["finish_reason"] is not None:
                    item["timings"] = timings(self.completion.stats)  # the last chunk, as llama.cpp does
                last = item
                yield json.dumps(item)  # at once: holding one back would delay each token a round
            if include_usage:
                yield json.dumps({"id": self.completion.id, "object": last["object"] if last else
                                  "chat.completion.chunk", "created": self.completion.created,
                                  "model": self.completion.model, "choices": [],
                                  "usage": self.completion.usage(details=True)})
            yield "[DONE]"
        finally:
            self.cancelled.set()
