"""The server's Prometheus metrics at ``GET /metrics``: requests, tokens, speculation, latency saved,
the pair's scheduler (sequences running and waiting, passes, rows and sequences fed), and the size
of what the pair keeps per namespace (``agentspec.drafters.tenants``).

Counted on the server, once per request it answers: a client of this server (``ChatSpecDecode``
against an endpoint, a router) must not count the same tokens again. Names follow vLLM's
``vllm:*`` families under ``agentspec_`` (Prometheus reserves colons for recording rules), but for
the scheduler's running and waiting gauges, which carry vLLM's own names and types
(``vllm:num_requests_running``, ``vllm:num_requests_waiting``): what reads a vLLM worker's load (a
router, a dashboard) reads this server's alike. The scheduler's families are read from its
``SchedulerStats`` when ``/metrics`` is scraped: telemetry observes what the scheduler counted, it
never runs a pass.
Each app has a registry of its own, so several apps in one process (tests) never share counts.
The OpenTelemetry metrics of ``agentspec.telemetry`` (where the process configures an SDK) record
the same calls; a dashboard reads one of the two. The families are declared in one table, ``METRICS``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
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
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agentspec.drafters.tenants import TenantStore
from agentspec.scheduler import SchedulerStats
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
    # its value, read from the pair's scheduler at each scrape (None: the server observes it)
    read: Callable[[SchedulerStats], float] | None = None


# the server's families, by key (``ServerMetrics.family``), in the order /metrics shows them
METRICS: dict[str, MetricSpec] = {
    "requests": MetricSpec(Counter, "agentspec_requests", "Chat completion requests answered", ("status",)),
    "in_flight": MetricSpec(
        Gauge,
        "agentspec_requests_in_flight",
        "Requests admitted: each a sequence decoding, joining or leaving",
    ),
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
    "accepted_per_pos": MetricSpec(
        Counter,
        "agentspec_spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by their position in the draft (0: the first)",
        ("position",),
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
    # read from the pair's scheduler (SchedulerStats) when /metrics is scraped; vLLM's help, then ours
    "running": MetricSpec(
        Gauge,
        "vllm:num_requests_running",
        "Number of requests in model execution batches (sequences in the pair's passes)",
        read=lambda s: s.running,
    ),
    "waiting": MetricSpec(
        Gauge,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed (calls waiting for the pair's lock to join or leave)",
        read=lambda s: s.waiting,
    ),
    "passes": MetricSpec(
        Counter,
        "agentspec_scheduler_passes",
        "Target forwards the pair's scheduler ran, each over the new rows of every sequence it fed",
        read=lambda s: s.passes,
    ),
    "pass_rows": MetricSpec(
        Counter,
        "agentspec_scheduler_pass_rows",
        "Tokens fed to the target, summed over passes (rows per pass: this over passes)",
        read=lambda s: s.rows,
    ),
    "pass_sequences": MetricSpec(
        Counter,
        "agentspec_scheduler_pass_sequences",
        "Sequences fed, summed over passes (sequences per pass: this over passes)",
        read=lambda s: s.members,
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


class Scraped:
    """A family of ``METRICS`` with a ``read``: its value taken from the scheduler's stats at each
    scrape (a registry's collector)."""

    def __init__(self, spec: MetricSpec, model: str, stats: SchedulerStats):
        assert spec.read is not None and not spec.labels, f"{spec.name} is not read from the scheduler"
        self.spec, self.read, self.model, self.stats = spec, spec.read, model, stats

    def collect(self) -> Iterator[Metric]:
        spec = self.spec
        family = CounterMetricFamily if spec.kind is Counter else GaugeMetricFamily
        metric = family(spec.name, spec.help, labels=LABELS)
        metric.add_metric([self.model], self.read(self.stats))
        yield metric


class ServerMetrics:
    """The families of ``METRICS`` in a registry of their own, and what the server observes.

    ``family`` holds the families the server observes (``admitted``, ``decoded`` ...) and those set
    from the tenant store; the scheduler's are ``Scraped``, registered in the table's order."""

    def __init__(self, model: str, tenants: TenantStore, scheduler: SchedulerStats):
        self.registry = CollectorRegistry()
        self.model = model
        self.family: dict[str, Any] = {}
        for key, spec in METRICS.items():
            if spec.read is not None:
                self.registry.register(Scraped(spec, model, scheduler))
                continue
            family = spec.kind(spec.name, spec.help, [*LABELS, *spec.labels], registry=self.registry)
            self.family[key] = family
            if not spec.labels:
                family.labels(model)  # shown at 0 from the start, not only once counted
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
        for position, n in enumerate(stats.accepted_per_position):
            self.family["accepted_per_pos"].labels(self.model, str(position)).inc(n)
        self._of("latency_saved").inc(saved_s)
        self._of("duration").observe(duration_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
