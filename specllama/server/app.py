"""The FastAPI app: loading the model, authentication, CORS, errors in each API's shape, and the
endpoints every API shares (/health, /metrics, /v1/models). The wire formats are translators
in modules of their own (openai_chat, anthropic_messages, openai_responses, llama_server), each
registering its routes on the one generate path through the Server they share (core.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import SpecLlamaError
from . import anthropic_messages, llama_server, openai_chat, openai_responses
from .core import Server
from .errors import ApiError, api_of, from_library
from .guard import Guard, access
from .limits import ServerLimits
from .metrics import Metrics

log = logging.getLogger("specllama")


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
        sharing = server.llm.sharing  # rows of requests in one pass (--batch-requests)
        note = server.llm.sharing_note  # why they do not
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
