"""llama-server's own endpoints that editors and scripts use: /tokenize, /detokenize and /infill
(fill-in-the-middle with the GGUF's FIM tokens, as llama.vscode and llama.vim call it), in
llama-server's request and response shapes, on the one generate path."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Optional, Union

from fastapi import FastAPI, Request
from pydantic import ConfigDict

from ..surfaces.completions import Completion, generate_options, timings
from .core import Server
from .errors import ApiError, from_library
from .jobs import Job
from .limits import Body

if TYPE_CHECKING:
    from ..engine import SpecLlama

PATHS = ("/tokenize", "/detokenize", "/infill")


class TokenizeBody(Body):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeBody(Body):
    tokens: list[int]


class InfillBody(Body):
    model_config = ConfigDict(extra="allow")  # llama.vscode's samplers, cache_prompt, t_max_*: accepted
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[Any] = []
    prompt: str = ""
    n_predict: Optional[int] = None
    max_tokens: Optional[int] = None
    temperature: float = 0.8  # llama-server's defaults
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    stop: Union[None, str, list[str]] = None
    seed: Optional[int] = None
    stream: bool = False
    n_draft: Union[None, int, str] = None


def add_routes(app: FastAPI, server: Server) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeBody) -> dict:
        target = server.ready().target

        def tokenize() -> dict:  # in a worker thread: a long text takes a while
            tokens = target.tokenize(body.content, add_special=body.add_special, parse_special=body.parse_special)
            if not body.with_pieces:
                return {"tokens": tokens}
            return {"tokens": [{"id": t, "piece": _piece(target.piece(t))} for t in tokens]}

        return await server.prepare(tokenize)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeBody) -> dict:
        llm = server.ready()
        bad = [t for t in body.tokens if not 0 <= t < llm.target.n_vocab]
        if bad:
            raise ApiError(400, f"tokens: {bad[0]} is not a token id of this model (0..{llm.target.n_vocab - 1})",
                           param="tokens", code="invalid_value")
        return {"content": await server.prepare(lambda: llm.detokenize(body.tokens))}

    @app.post("/infill")
    async def infill(body: InfillBody, request: Request) -> Any:
        llm = server.ready()
        scope = server.scope_of(request)
        return await server.answer(request, lambda: _Infill(server, _infill(server, llm, body, scope), body.stream),
                                   body.stream, lambda job, infill: server.events(request, job, _events(job)))


def _piece(data: bytes) -> Union[str, list[int]]:
    """A token's text, or its bytes where they are not whole UTF-8 (as llama-server sends them)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


def _infill(server: Server, llm: "SpecLlama", body: InfillBody, scope: str) -> Completion:
    """The request's completion (in a worker thread); scope: its prompt-cache scope."""
    server.limits.check(stop=body.stop, input_extra=body.input_extra)
    target = llm.target
    n_predict = body.n_predict if body.n_predict is not None else body.max_tokens
    try:
        tokens = llm.prompt_tokens(llm.fim_tokens(body.input_prefix, body.input_suffix, prompt=body.prompt,
                                                   extra=body.input_extra, n_predict=n_predict or 128))
        options = generate_options(n_predict if n_predict is None or n_predict > 0 else None, len(tokens),
                                   target.n_ctx, temperature=body.temperature, top_p=body.top_p, min_p=body.min_p,
                                   top_k=body.top_k, stop=body.stop, seed=body.seed, n_draft=body.n_draft,
                                   cache_scope=scope)
        return Completion(llm, tokens, options, chat=False, model=server.model_id)
    except Exception as e:
        raise from_library(e, param="input_prefix") from None


def _final(server: Server, completion: Completion, content: str) -> dict:
    """llama-server's /completion result for what was generated."""
    result, stats = completion.stream.result, completion.stats
    stop_type = "limit" if result is None or result.finish_reason != "stop" else \
        "word" if result.stop_sequence else "eos"
    return {"content": content, "stop": True, "model": server.model_id, "stop_type": stop_type,
            "stopping_word": (result.stop_sequence if result is not None else None) or "",
            "tokens_predicted": len(result.tokens) if result is not None else 0,
            "tokens_evaluated": len(completion.tokens),
            "tokens_cached": stats.n_prompt_cached if stats is not None else 0,
            "timings": timings(stats) if stats is not None else {}}


class _Infill:
    """One /infill request: its completion, run by work(job) in the job's thread."""

    def __init__(self, server: Server, completion: Completion, stream: bool):
        self.server, self.completion, self.stream = server, completion, stream

    def work(self, job: Job) -> Optional[dict]:
        server, completion = self.server, self.completion
        job.track(completion.stream)
        try:
            if not self.stream:
                response = completion.response()
                return _final(server, completion, response["choices"][0]["text"])
            for chunk in completion.chunks():
                text = chunk["choices"][0]["text"]
                if text:
                    job.emit({"content": text, "stop": False})
            job.emit(_final(server, completion, ""))
            return None
        finally:
            if completion.stats is not None:
                server.record("infill", completion.stats)


async def _events(job: Job) -> AsyncIterator[str]:
    try:
        async for item in job.items():
            yield json.dumps(item)
    except Exception as e:
        yield json.dumps(from_library(e).body())
