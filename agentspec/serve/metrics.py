"""The server's Prometheus metrics at ``GET /metrics``: requests, tokens, speculation, latency saved,
and the size of what the pair keeps per namespace (``agentspec.drafters.tenants``).

Counted on the server, once per request it answers: a client of this server (``ChatSpecDecode``
against an endpoint, a router) must not count the same tokens again. Names follow vLLM's
``vllm:*`` families under ``agentspec_`` (Prometheus names take no colon outside recording rules).
Each app has a registry of its own, so several apps in one process (tests) never share counts.
The OpenTelemetry metrics of ``agentspec.telemetry`` (where the process configures an SDK) record
the same calls; a dashboard reads one of the two. The families are declared in one table, ``METRICS``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from agentspec.drafters.tenants import TenantStore
from agentspec.stats import DecodeStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
LABELS = ("model_name",)  # every family's first label: the model requests name


@dataclass(frozen=True)
class MetricSpec:
    """One metric family: its kind (``Counter``, ``Gauge`` or ``Histogram``), name, help and the
    labels it has after ``LABELS``."""

    kind: type
    name: str
    help: str
    labels: tuple[str, ...] = ()


# the server's families, by key (``ServerMetrics.family``), in the order /metrics shows them
METRICS: dict[str, MetricSpec] = {
    "requests": MetricSpec(Counter, "agentspec_requests", "Chat completion requests answered", ("status",)),
    "in_flight": MetricSpec(Gauge, "agentspec_requests_in_flight", "Requests admitted: decoding or queued"),
    "closed_early": MetricSpec(
        Counter,
        "agentspec_requests_closed_early",
        "Requests whose client went away before the reply finished (their decode stopped there)",
    ),
    "prompt_tokens": MetricSpec(Counter, "agentspec_prompt_tokens", "Prompt tokens"),
    "cached_tokens": MetricSpec(
        Counter, "agentspec_prompt_tokens_cached", "Prompt tokens restored from the prefix cache"
    ),
    "generation_tokens": MetricSpec(Counter, "agentspec_generation_tokens", "Generated tokens"),
    "drafts": MetricSpec(
        Counter, "agentspec_spec_decode_num_drafts", "Verify passes over at least one draft token"
    ),
    "draft_tokens": MetricSpec(Counter, "agentspec_spec_decode_num_draft_tokens", "Draft tokens verified"),
    "accepted_tokens": MetricSpec(
        Counter, "agentspec_spec_decode_num_accepted_tokens", "Draft tokens accepted"
    ),
    # a gauge: a call that lost time (negative saving) moves it down
    "latency_saved": MetricSpec(
        Gauge,
        "agentspec_latency_saved_seconds",
        "Estimated time saved against plain decoding without cache, summed over requests",
    ),
    "duration": MetricSpec(
        Histogram, "agentspec_request_duration_seconds", "Request time, queueing included"
    ),
    # read from the pair's TenantStore when /metrics is scraped
    "tenant_bytes": MetricSpec(
        Gauge,
        "agentspec_tenant_store_bytes",
        "Estimated bytes of what the pair keeps per namespace (drafting memories, drafter health)",
    ),
    "tenant_budget": MetricSpec(
        Gauge, "agentspec_tenant_store_budget_bytes", "The byte budget of the per-namespace store"
    ),
    "tenant_namespaces": MetricSpec(
        Gauge, "agentspec_tenant_store_namespaces", "Namespaces the per-namespace store holds"
    ),
}


class ServerMetrics:
    """The families of ``METRICS`` in a registry of their own, and what the server observes."""

    def __init__(self, model: str, tenants: TenantStore):
        self.registry = CollectorRegistry()
        self.model = model
        self.family: dict[str, Any] = {
            key: spec.kind(spec.name, spec.help, [*LABELS, *spec.labels], registry=self.registry)
            for key, spec in METRICS.items()
        }
        for key, spec in METRICS.items():
            if not spec.labels:
                self.family[key].labels(model)  # shown at 0 from the start, not only once counted
        f = self.family
        f["tenant_bytes"].labels(model).set_function(lambda: tenants.bytes)
        f["tenant_budget"].labels(model).set_function(lambda: tenants.max_bytes)
        f["tenant_namespaces"].labels(model).set_function(lambda: len(tenants))

    def _of(self, key: str) -> Any:
        return self.family[key].labels(self.model)

    def admitted(self) -> None:
        self._of("in_flight").inc()

    def left(self, closed_early: bool) -> None:
        """A request admitted has left (answered, failed or closed by its client)."""
        self._of("in_flight").dec()
        if closed_early:
            self._of("closed_early").inc()

    def answered(self, status: int) -> None:
        self.family["requests"].labels(self.model, str(status)).inc()

    def decoded(self, stats: DecodeStats, spec_steps: int, saved_s: float, duration_s: float) -> None:
        self._of("prompt_tokens").inc(stats.prompt_tokens)
        self._of("cached_tokens").inc(stats.cached_tokens)
        self._of("generation_tokens").inc(stats.output_tokens)
        self._of("drafts").inc(spec_steps)
        self._of("draft_tokens").inc(stats.draft_tokens)
        self._of("accepted_tokens").inc(stats.accepted_tokens)
        self._of("latency_saved").inc(saved_s)
        self._of("duration").observe(duration_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
