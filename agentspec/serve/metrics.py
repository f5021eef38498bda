"""The server's Prometheus metrics at ``GET /metrics``: requests, tokens, speculation, latency saved.

Counted on the server, once per request it answers: a client of this server (``ChatSpecDecode``
against an endpoint, a router) must not count the same tokens again. Names follow vLLM's
``vllm:*`` families under ``agentspec_`` (Prometheus names take no colon outside recording rules).
Each app has a registry of its own, so several apps in one process (tests) never share counts.
The OpenTelemetry metrics of ``agentspec.telemetry`` (where the process configures an SDK) record
the same calls; a dashboard reads one of the two.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from agentspec.stats import DecodeStats

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    def __init__(self, model: str):
        self.registry = CollectorRegistry()
        self.model = model
        labels = ["model_name"]
        reg = self.registry
        self.requests = Counter(
            "agentspec_requests", "Chat completion requests answered", [*labels, "status"], registry=reg
        )
        self.in_flight = Gauge(
            "agentspec_requests_in_flight", "Requests admitted: decoding or queued", labels, registry=reg
        )
        self.closed_early = Counter(
            "agentspec_requests_closed_early",
            "Requests whose client went away before the reply finished (their decode stopped there)",
            labels,
            registry=reg,
        )
        self.prompt_tokens = Counter("agentspec_prompt_tokens", "Prompt tokens", labels, registry=reg)
        self.cached_tokens = Counter(
            "agentspec_prompt_tokens_cached",
            "Prompt tokens restored from the prefix cache",
            labels,
            registry=reg,
        )
        self.generation_tokens = Counter(
            "agentspec_generation_tokens", "Generated tokens", labels, registry=reg
        )
        self.drafts = Counter(
            "agentspec_spec_decode_num_drafts",
            "Verify passes over at least one draft token",
            labels,
            registry=reg,
        )
        self.draft_tokens = Counter(
            "agentspec_spec_decode_num_draft_tokens", "Draft tokens verified", labels, registry=reg
        )
        self.accepted_tokens = Counter(
            "agentspec_spec_decode_num_accepted_tokens", "Draft tokens accepted", labels, registry=reg
        )
        # a gauge: a call that lost time (negative saving) moves it down
        self.latency_saved = Gauge(
            "agentspec_latency_saved_seconds",
            "Estimated time saved against plain decoding without cache, summed over requests",
            labels,
            registry=reg,
        )
        self.duration = Histogram(
            "agentspec_request_duration_seconds", "Request time, queueing included", labels, registry=reg
        )
        for family in (self.in_flight, self.closed_early, self.prompt_tokens, self.cached_tokens):
            family.labels(model)  # shown at 0 from the start, not only once counted
        for family in (self.generation_tokens, self.drafts, self.draft_tokens, self.accepted_tokens):
            family.labels(model)
        self.latency_saved.labels(model)

    def answered(self, status: int) -> None:
        self.requests.labels(self.model, str(status)).inc()

    def decoded(self, stats: DecodeStats, spec_steps: int, saved_s: float, duration_s: float) -> None:
        m = self.model
        self.prompt_tokens.labels(m).inc(stats.prompt_tokens)
        self.cached_tokens.labels(m).inc(stats.cached_tokens)
        self.generation_tokens.labels(m).inc(stats.output_tokens)
        self.drafts.labels(m).inc(spec_steps)
        self.draft_tokens.labels(m).inc(stats.draft_tokens)
        self.accepted_tokens.labels(m).inc(stats.accepted_tokens)
        self.latency_saved.labels(m).inc(saved_s)
        self.duration.labels(m).observe(duration_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
