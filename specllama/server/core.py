"""The Server: what every API's translator shares on the one generate path: the model once
loaded, the turns of the requests generating at once, the queue of those being prepared, the
metrics, and a request's answer (a stream's SSE response, or its job's result).

The event loop only parses, routes and streams: a request's preparation (template, tokenizer,
grammar) runs in a worker thread (Server.prepare) and its generation in a Job's thread."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional, TypeVar

from fastapi import Request
from fastapi.responses import Response
from sse_starlette.sse import EventSourceResponse, SendTimeoutError

from .. import __version__
from ..errors import RpcError
from .errors import ApiError
from .jobs import ClientGone, Disconnect, Job, acquire
from .limits import ServerLimits
from .metrics import Metrics

if TYPE_CHECKING:
    from ..engine import SpecLlama

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
        self.llm: Optional[SpecLlama] = None
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

    def ready(self) -> "SpecLlama":
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


def gone() -> Response:
    """What a handler returns for a client that already left (nobody reads it)."""
    return Response(status_code=499)
