"""The server's Prometheus counters, in a registry of its own."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    """Requests by endpoint and status, tokens, the prompt cache, phases, cancellations."""

    def __init__(self, endpoints: set[str]) -> None:
        self.endpoints = endpoints  # the label values; any other path counts as "other"
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("specllama_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.cancelled = Counter("specllama_requests_cancelled", "Generations stopped because their client left",
                                 ["endpoint"], registry=r)
        self.refused = Counter("specllama_requests_refused",
                               "Requests and streams the server's limits ended: queue (503), send_timeout (a client "
                               "that stopped reading), backlog (one reading slower than it generates)",
                               ["reason"], registry=r)
        self.prompt_tokens = Counter("specllama_prompt_tokens", "Prompt tokens processed", registry=r)
        self.prompt_cached_tokens = Counter("specllama_prompt_cached_tokens",
                                            "Prompt tokens reused from the prompt cache, not decoded", registry=r)
        self.prompt_cache_lookups = Counter("specllama_prompt_cache_lookups",
                                            "Prefills by where their reused state came from (live, saved, none)",
                                            ["source"], registry=r)
        self.generated_tokens = Counter("specllama_generated_tokens", "Tokens generated", registry=r)
        self.drafted_tokens = Counter("specllama_drafted_tokens", "Tokens drafted", registry=r)
        self.accepted_tokens = Counter("specllama_accepted_tokens", "Drafted tokens the target accepted", registry=r)
        self.near_ties = Counter("specllama_near_ties", "Greedy tokens decided at a near-tie (fidelity)", registry=r)
        self.acceptance = Histogram("specllama_request_acceptance",
                                    "Each drafting request's share of drafted tokens the target accepted",
                                    buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0), registry=r)
        self.seconds = Counter("specllama_phase_seconds", "Time spent per phase", ["phase"], registry=r)
        self.active = Gauge("specllama_requests_active", "Generations running now, each in a slot of its own",
                            registry=r)
        self.queued = Gauge("specllama_requests_queued", "Requests waiting for a free slot", registry=r)
        self.slots = Gauge("specllama_slots", "Requests that may decode side by side (--parallel)", registry=r)

    def endpoint(self, path: str) -> str:
        return path if path in self.endpoints else "other"

    def record(self, stats: Any) -> None:
        self.prompt_tokens.inc(stats.n_prompt)
        self.prompt_cached_tokens.inc(stats.n_prompt_cached)
        self.prompt_cache_lookups.labels(stats.prompt_cache).inc()
        self.generated_tokens.inc(stats.n_generated)
        self.drafted_tokens.inc(stats.n_drafted)
        self.accepted_tokens.inc(stats.n_accepted)
        if stats.n_drafted:
            self.acceptance.observe(stats.n_accepted / stats.n_drafted)
        self.near_ties.inc(stats.near_ties or 0)
        for phase, seconds in (("prefill", stats.t_prefill + stats.t_draft_prefill), ("draft", stats.t_draft),
                               ("verify", stats.t_verify),
                               ("other", stats.t_other)):
            self.seconds.labels(phase).inc(seconds)

    def text(self) -> str:
        return generate_latest(self.registry).decode()
