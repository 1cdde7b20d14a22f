"""The FastAPI app: loading the model, authentication, CORS, errors in each API's shape, and the
endpoints every API shares (/health, /metrics, /v1/models). The wire formats are translators
in modules of their own, each registering its routes on the one generate path.

The event loop only parses, routes and streams: a request's preparation (template, tokenizer,
grammar) runs in a worker thread (Server.prepare) and its generation in a Job's thread."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Optional, TypeVar, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette.sse import EventSourceResponse, SendTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..errors import RpcError, SpecLlamaError
from .errors import ApiError, api_of, from_library
from .jobs import ClientGone, Disconnect, Job, acquire
from .guard import Guard, access
from .limits import ServerLimits
from .metrics import Metrics

log = logging.getLogger("specllama")

# requests prepared at once (template, tokenizer, grammar compile): the rest wait on the event loop
# without holding a thread, counted in the queue
N_PREPARING = 2
T = TypeVar("T")


class Server:
    """What the translators share: the model once loaded, the turn, metrics and settings."""

    def __init__(self, model_id: str, strict_model: bool, metrics: Metrics, n_parallel: int = 4,
                 limits: ServerLimits = ServerLimits(), cache_scope: str = "shared"):
        self.model_id, self.strict_model, self.metrics = model_id, strict_model, metrics
        self.limits, self.cache_scope = limits, cache_scope
        self.llm: Any = None
        self.error: Optional[BaseException] = None
        self.lost: Optional[str] = None  # why the model cannot answer any more (a lost RPC worker)
        self.preparing = asyncio.Semaphore(N_PREPARING)
        # n_parallel generations at once, each in a slot of the model's; waiters served in arrival order
        self.n_parallel = n_parallel
        self.turn = asyncio.Semaphore(n_parallel)
        self.n_active = self.n_queued = 0
        metrics.slots.set(n_parallel)
        self.created = int(time.time())
        self.fingerprint = f"specllama-{__version__}"

    def ready(self) -> Any:
        if self.error is not None:
            raise ApiError(503, f"the model failed to load: {self.error}", kind="server_error", code="load_failed")
        if self.llm is None:
            raise ApiError(503, "the model is still loading; retry shortly", kind="server_error", code="loading")
        if self.lost is not None:
            raise ApiError(503, f"the model cannot answer: {self.lost}", kind="server_error", code="model_lost")
        return self.llm

    def scope_of(self, request: Request) -> str:
        """The prompt-cache scope of a request: its API key's under --cache-scope key, else shared."""
        return getattr(request.state, "key_scope", "") if self.cache_scope == "key" else ""

    async def prepare(self, work: Callable[[], T]) -> T:
        """work() (a request's template, tokens, grammar: CPU work) in a worker thread, a few at
        a time, so the event loop keeps streaming; 503 with Retry-After past the queue limit."""
        if self.n_queued >= self.limits.queue:
            self.metrics.refused.labels("queue").inc()
            raise ApiError(503, f"{self.n_queued} requests are waiting already (this server's queue limit, "
                           "--limit queue=...); retry shortly", kind="server_error", code="queue_full",
                           headers={"Retry-After": "5"})
        self._count(queued=1)
        try:
            async with self.preparing:
                return await asyncio.to_thread(work)
        finally:
            self._count(queued=-1)

    def failed(self, e: BaseException) -> None:
        """A job's work raised e (in its thread): a lost RPC worker takes the model with it."""
        if isinstance(e, RpcError):
            self.lost = str(e)

    def events(self, request: Request, job: Job, content: Any, **sse: Any) -> Response:
        """The SSE response of a streamed job: ends (and cancels the job) when the client leaves
        or stops reading for the send timeout; counted in /metrics either way."""
        return _Events(self, request, job, content, send_timeout=self.limits.send_timeout, **sse)

    def check_model(self, name: Any) -> None:
        """Any name is served, as llama-server and llama-cpp-python do, unless --strict-model."""
        if name is not None and not isinstance(name, str):
            raise ApiError(400, "model: a string naming the model", param="model", code="invalid_value")
        if self.strict_model and name is not None and name != self.model_id:
            raise ApiError(404, f"model {name!r} is not served here; this server serves {self.model_id!r}",
                           param="model", code="model_not_found")

    async def run(self, request: Request, work: Callable[[Job], Any], stream: bool) -> Optional[Job]:
        """Start work once it is this request's turn; None if the client left while waiting.
        A non-streamed job's result is then result(request, job)."""
        disconnect = Disconnect(request)
        self._count(queued=1)
        try:
            admitted = await acquire(self.turn, disconnect)
        finally:
            self._count(queued=-1)
        if not admitted:
            self.metrics.cancelled.labels(self.metrics.endpoint(request.url.path)).inc()
            return None
        self._count(active=1)
        job = Job(work, self._release, self.failed, self.limits.backlog)
        if stream:  # the stream's response watches its own client
            disconnect.close()
        else:
            job.disconnect = disconnect
        return job

    def _count(self, active: int = 0, queued: int = 0) -> None:
        self.n_active, self.n_queued = self.n_active + active, self.n_queued + queued
        self.metrics.active.set(self.n_active)
        self.metrics.queued.set(self.n_queued)

    def _release(self) -> None:
        self._count(active=-1)
        self.turn.release()

    async def answer(self, request: Request, prepare: Callable[[], T], stream: bool,
                     events: Callable[[Job, T], Response]) -> Any:
        """Prepare the request (Server.prepare), run its work(job) in its turn and answer:
        events(job, prepared) for a stream, the job's result otherwise; 499 (nobody reads it)
        for a client that left, while waiting or while it ran."""
        prepared: Any = await self.prepare(prepare)
        job = await self.run(request, prepared.work, stream)
        if job is None:
            return gone()
        if stream:
            return events(job, prepared)
        try:
            return await self.result(request, job)
        except ClientGone:
            return gone()

    async def result(self, request: Request, job: Optional[Job]) -> Any:
        """A non-streamed job's result, cancelled if its client leaves (ClientGone)."""
        if job is None:
            raise ClientGone()
        disconnect = job.disconnect
        assert disconnect is not None  # set by run() for a non-streamed job
        try:
            return await job.result(disconnect)
        except ClientGone:
            self.metrics.cancelled.labels(self.metrics.endpoint(request.url.path)).inc()
            raise
        finally:
            disconnect.close()

    def record(self, what: str, stats: Any) -> None:
        """A generation ended: its counters, and one log line (what it cost, as llama-server logs)."""
        self.metrics.record(stats)
        log.info("%s: %d prompt tokens (%d cached%s), first token after %.2f s, %d tokens in %.2f s (%.1f tok/s, "
                 "%d of %d drafts accepted)", what, stats.n_prompt, stats.n_prompt_cached,
                 " from disk" if stats.prompt_cache == "disk" else "", stats.t_prefill,
                 stats.n_generated, stats.t_total, stats.decode_tokens_per_second, stats.n_accepted, stats.n_drafted)

    def stream_ended(self, request: Request, job: Job) -> None:
        """A stream's response ended: a generation still running lost its client."""
        if not job.finished:
            job.cancel()
            self.metrics.cancelled.labels(self.metrics.endpoint(request.url.path)).inc()


class _Events(EventSourceResponse):
    """A stream's SSE response, which cancels its job however it ends; a client that stops
    reading for send_timeout seconds ends it (the chunks it left unread are freed with it)."""

    def __init__(self, server: Server, request: Request, job: Job, content: Any, **sse: Any):
        super().__init__(content, **sse)
        self.server, self.request, self.job = server, request, job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            self.server.metrics.refused.labels("send_timeout").inc()
            log.warning("%s: the client read nothing for %g s (--limit send_timeout); its stream is cancelled",
                        self.request.url.path, self.send_timeout)
        finally:
            if self.job.overflowed:
                self.server.metrics.refused.labels("backlog").inc()
            self.server.stream_ended(self.request, self.job)


def create_app(load: Callable[[], Any], model_id: str, api_key: Union[None, str, Sequence[str]] = None,
               cors_origins: Sequence[str] = (), strict_model: bool = False, n_parallel: int = 4,
               allowed_hosts: Optional[Sequence[str]] = None, limits: ServerLimits = ServerLimits(),
               cache_scope: Optional[str] = None) -> FastAPI:
    """The app; load() builds the SpecLlama in a background thread once the server is up.

    Args:
        load: returns the SpecLlama to serve.
        model_id: the name /v1/models lists and responses carry (requests may name any model).
        api_key: a key or keys; when given, every endpoint but /health and / needs
            "Authorization: Bearer KEY" or "x-api-key: KEY" (Anthropic's header). An empty or
            blank key is refused (ValueError): it would look like protection and be none.
        cors_origins: origins browsers may call from ("*" for any); none by default.
        strict_model: answer 404 for a request naming another model, as OpenAI does.
        n_parallel: requests generating at once (load()'s n_parallel); others wait in arrival order.
        allowed_hosts: the Host header values served ("*": any). Default: any with a key; only
            loopback names without one, so a web page that rebinds its DNS name to 127.0.0.1
            cannot drive a keyless local server.
        limits: what one request may ask (ServerLimits).
        cache_scope: "key" (the default with keys): a prompt cached for one key is reused only by
            requests with the same key; "shared": by every request.
    """
    keys, hosts, cache_scope = access(api_key, allowed_hosts, cache_scope)
    from . import anthropic_messages, llama_server, openai_chat, openai_responses

    translators = (openai_chat, anthropic_messages, openai_responses, llama_server)
    metrics = Metrics({"/health", "/metrics", "/v1/models", "/"} | {p for t in translators for p in t.PATHS})
    server: Server

    server = Server(model_id, strict_model, metrics, n_parallel, limits, cache_scope)
    app = FastAPI(title="specllama", docs_url=None, redoc_url=None, lifespan=_lifespan(server, load))
    app.state.server = server

    _error_handlers(app)
    _shared_routes(app, server)
    for translator in translators:
        translator.add_routes(app, server)

    app.add_middleware(Guard, keys=keys, hosts=hosts, max_body=int(limits.body_mb * 2**20), metrics=metrics)
    # outermost: a browser's preflight is answered before the key is asked for (it never carries one)
    app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST", "OPTIONS"],
                       allow_headers=["*"], expose_headers=["*"], allow_credentials=False, max_age=600)
    return app


def _lifespan(server: Server, load: Callable[[], Any]) -> Callable[[FastAPI], Any]:
    """The model's life in the app: loaded in a background thread once the server is up (/health
    says loading meanwhile), closed when the server stops."""

    def load_in_background() -> None:
        try:
            llm = load()
            # the grammars' tokenizer, built now while /health says loading: its build holds the
            # GIL for about 0.7 s (151k tokens), which froze the event loop at the first request
            # with a grammar, a JSON schema or a required tool call
            with contextlib.suppress(SpecLlamaError):  # a target on RPC workers takes no grammar
                llm.target.grammar_tokenizer()
            server.llm = llm
        except BaseException as e:  # reported by /health and every request
            server.error = e
            log.error("loading failed: %s", e)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        threading.Thread(target=load_in_background, name="specllama-load", daemon=True).start()
        yield
        if server.llm is not None:  # open streams end at their next token, then the models are freed
            await asyncio.to_thread(server.llm.close)

    return lifespan


def _error_handlers(app: FastAPI) -> None:
    """Every error as JSON in the shape of the API the path belongs to."""
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return e.response(api_of(request.url.path))

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        content_type = request.headers.get("content-type", "")
        if tuple(first.get("loc", ())) == ("body",) and content_type and not _is_json(content_type):
            # curl -d without -H sends application/x-www-form-urlencoded: FastAPI then reads no JSON
            error = ApiError(400, f"the request body must be JSON sent with Content-Type: application/json, "
                             f"not {content_type!r} (curl: add -H 'Content-Type: application/json')",
                             code="invalid_content_type")
        elif first.get("type") == "json_invalid":
            error = ApiError(400, "the request body is not valid JSON", code="invalid_json")
        else:
            param = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or None
            error = ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param,
                             code="invalid_value")
        return error.response(api_of(request.url.path))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        detail = e.detail if isinstance(e.detail, str) else "invalid request"
        if e.status_code == 404:
            detail = f"{request.method} {request.url.path} is not an endpoint of this server"
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(e.status_code,
                                                                                            "invalid_request")
        return ApiError(e.status_code, detail, code=code).response(api_of(request.url.path))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception) -> JSONResponse:
        return from_library(e).response(api_of(request.url.path))  # logs the traceback


def _is_json(content_type: str) -> bool:
    """What FastAPI parses as a JSON body: application/json or application/*+json, any parameters."""
    kind = content_type.split(";")[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def _shared_routes(app: FastAPI, server: Server) -> None:
    """/health, /, /metrics and /v1/models."""
    metrics = server.metrics
    @app.get("/health")
    async def health() -> JSONResponse:
        if server.llm is None:
            return JSONResponse({"status": "error" if server.error else "loading"}, status_code=503)
        if server.lost is not None:  # every request would fail: a balancer should stop sending them
            return JSONResponse({"status": "error", "error": server.lost}, status_code=503)
        sharing = getattr(server.llm, "sharing", None)  # rows of requests in one pass (--batch-requests)
        note = getattr(server.llm, "sharing_note", "")  # why they do not
        shared = sharing.as_dict() if sharing is not None else {"n_lanes": 0, "why": note} if note else None
        return JSONResponse({"status": "ok", "slots": server.n_parallel, "requests_active": server.n_active,
                             "requests_queued": server.n_queued, **({"batch_requests": shared} if shared else {})})

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root() -> JSONResponse:
        return JSONResponse({"status": "ok" if server.llm is not None else "loading", "model": server.model_id})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        entry = {"id": server.model_id, "object": "model", "created": server.created, "owned_by": "specllama"}
        if server.llm is not None:
            entry["meta"] = {"n_ctx": server.llm.target.n_ctx, "n_vocab": server.llm.target.n_vocab}
        # "models" as well: what Codex and llama-server's own clients read
        return {"object": "list", "data": [entry],
                "models": [{"name": server.model_id, "model": server.model_id, **entry}]}


def gone() -> Response:
    """What a handler returns for a client that already left (nobody reads it)."""
    return Response(status_code=499)
