"""OpenTelemetry glue: one span and one set of metric points per model call.

``CallTrace`` is built before a call, wraps its Step generator (``watch``), is told of a failure
(``fail``) and ends after the generator is closed (``end``). It turns what it saw into attributes
with the pure functions of ``attributes`` and the estimate of ``latency``. The span is started as a
child of the current span and never made current itself (it has no children, and a context
attached inside a generator would leak into the caller between chunks).

With no SDK configured (the global providers are the API's no-op/proxy ones and none was injected),
``CallTrace`` records nothing, calibrates nothing and hands the generator back unwrapped.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from agentspec.config import GenerationConfig
from agentspec.decode import Step
from agentspec.models import ModelPair
from agentspec.stats import DecodeStats
from agentspec.telemetry import attributes as A
from agentspec.telemetry.latency import Observed, baseline_seconds, cost_model, passes_of

try:  # the API's stand-in until a global MeterProvider is set (private name: checked by type only)
    from opentelemetry.metrics._internal import _ProxyMeterProvider as _ProxyMP
except ImportError:  # pragma: no cover - a future API without it
    _ProxyMP = metrics.NoOpMeterProvider

SCOPE = "agentspec"


def _version() -> str:
    from agentspec import __version__

    return __version__


def tracer_provider_or_none(provider: Any = None) -> Any:
    """The injected or global TracerProvider; None when it is the API's no-op or proxy one."""
    provider = provider if provider is not None else trace.get_tracer_provider()
    if isinstance(provider, (trace.NoOpTracerProvider, trace.ProxyTracerProvider)):
        return None
    return provider


def meter_provider_or_none(provider: Any = None) -> Any:
    """The injected or global MeterProvider; None when it is the API's no-op or proxy one."""
    provider = provider if provider is not None else metrics.get_meter_provider()
    if isinstance(provider, (metrics.NoOpMeterProvider, _ProxyMP)):
        return None
    return provider


class Instruments:
    """The metric instruments of one MeterProvider (created once: the SDK warns on duplicates)."""

    def __init__(self, provider: Any):
        meter = provider.get_meter(SCOPE, _version())
        hist = meter.create_histogram
        self.duration = hist(
            A.METRIC_OPERATION_DURATION,
            unit="s",
            description="Duration of a model call",
            explicit_bucket_boundaries_advisory=A.DURATION_BUCKETS,
        )
        self.tokens = hist(
            A.METRIC_TOKEN_USAGE,
            unit="{token}",
            description="Input and output tokens per call",
            explicit_bucket_boundaries_advisory=A.TOKEN_BUCKETS,
        )
        self.ttft = hist(
            A.METRIC_TIME_TO_FIRST_TOKEN,
            unit="s",
            description="Time to the first output token (prefix-cache restore included)",
            explicit_bucket_boundaries_advisory=A.DURATION_BUCKETS,
        )
        self.tpot = hist(
            A.METRIC_TIME_PER_OUTPUT_TOKEN,
            unit="s",
            description="Decoding time per output token after the first",
            explicit_bucket_boundaries_advisory=A.PER_TOKEN_BUCKETS,
        )
        self.baseline = hist(
            A.METRIC_BASELINE_DURATION,
            unit="s",
            description="Estimated decoding time of the call with plain decoding and no prefix cache",
            explicit_bucket_boundaries_advisory=A.DURATION_BUCKETS,
        )
        count = meter.create_counter
        self.draft = count(A.METRIC_DRAFT_TOKENS, unit="{token}", description="Draft tokens verified")
        self.accepted = count(A.METRIC_ACCEPTED_TOKENS, unit="{token}", description="Draft tokens accepted")
        self.forced = count(A.METRIC_FORCED_TOKENS, unit="{token}", description="Tokens forced by a grammar")
        self.cache_read = count(
            A.METRIC_CACHE_READ_TOKENS, unit="{token}", description="Prompt tokens restored from cache"
        )
        self.saved = meter.create_up_down_counter(
            A.METRIC_LATENCY_SAVED,
            unit="s",
            description="Estimated time saved against plain decoding without cache (negative: lost)",
        )


_TRACERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_INSTRUMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_CACHE_LOCK = threading.Lock()


def _tracer(provider: Any) -> Any:
    with _CACHE_LOCK:
        tracer = _TRACERS.get(provider)
        if tracer is None:
            tracer = _TRACERS[provider] = provider.get_tracer(SCOPE, _version())
        return tracer


def _instruments(provider: Any) -> Instruments:
    with _CACHE_LOCK:
        found = _INSTRUMENTS.get(provider)
        if found is None:
            found = _INSTRUMENTS[provider] = Instruments(provider)
        return found


class CallTrace:
    """The span and metric points of one model call.

    ``pair`` may be None for a call that failed before a model was chosen (no estimate then).
    ``options`` are the call's ``agentspec.stream`` options; ``streamed`` whether the caller
    receives chunks; ``parent`` an OpenTelemetry Context whose span is the parent (None: the
    current one). The estimate calibrates the pair's CostModel on first use, before the span
    and the call's clock start.
    """

    def __init__(
        self,
        pair: ModelPair | None,
        model: str,
        options: Mapping[str, Any],
        *,
        streamed: bool,
        parent: Any = None,
        tracer_provider: Any = None,
        meter_provider: Any = None,
    ):
        tracing = tracer_provider_or_none(tracer_provider)
        metering = meter_provider_or_none(meter_provider)
        self.enabled = tracing is not None or metering is not None
        if not self.enabled:
            return
        self.pair, self.model = pair, model
        self.instruments = _instruments(metering) if metering is not None else None
        self.cost = cost_model(pair) if pair is not None else None  # may calibrate: before the clock
        self.span = None
        if tracing is not None:
            span = _tracer(tracing).start_span(A.span_name(model), context=parent, kind=SpanKind.INTERNAL)
            if span.is_recording():
                span.set_attributes(A.request_attributes(model, options, streamed))
                self.span = span
        if self.span is None and self.instruments is None:  # a sampler dropped the span: nothing to do
            self.enabled = False
            return
        self.stats: DecodeStats | None = None
        self.steps: list[Observed] = []
        self.verify_steps = 0  # passes seen so far
        self.error: str | None = None
        self.closed_early = False
        self.ended = False
        self.decode_s = 0.0
        self.ttft_s: float | None = None
        self.start = time.perf_counter()

    def watch(self, steps: Iterator[Step]) -> Iterator[Step]:
        """``steps``, observed (timed while inside the decoder). Close it to close ``steps``."""
        return self._watch(steps) if self.enabled else steps

    def _watch(self, steps: Iterator[Step]) -> Iterator[Step]:
        clock = time.perf_counter
        try:
            while True:
                t0 = clock()
                try:
                    step = next(steps)
                except StopIteration:
                    return
                finally:
                    t1 = clock()
                    self.decode_s += t1 - t0
                # the stats object runs along with the call: a pass ran iff its verify_steps went up
                self.stats, passes = step.stats, step.stats.verify_steps
                passed, self.verify_steps = passes > self.verify_steps, passes
                forced = getattr(step, "forced", 0)
                seen = Observed(passed, step.prefill, step.drafted, forced, len(step.tokens), step.seconds)
                self.steps.append(seen)
                if self.ttft_s is None and step.tokens:
                    self.ttft_s = t1 - self.start
                yield step
        finally:
            close = getattr(steps, "close", None)
            if close is not None:
                t0 = clock()
                close()  # waits for the decoder's cleanup (the prefix-cache save)
                self.decode_s += clock() - t0

    def fail(self, exc: BaseException) -> None:
        """The call raised ``exc`` (GeneratorExit: the caller closed it early, not an error)."""
        if not self.enabled or self.ended:
            return
        if isinstance(exc, GeneratorExit):
            self.closed_early = True
            return
        self.error = A.error_type(exc)
        if self.span is not None:
            self.span.record_exception(exc)
            self.span.set_status(Status(StatusCode.ERROR, f"{self.error}: {exc}"))

    def end(self) -> None:
        """Record the call (once): attributes, the latency estimate, metric points; end the span."""
        if not self.enabled or self.ended:
            return
        self.ended = True
        duration = time.perf_counter() - self.start
        stats = self.stats
        baseline = None
        if stats is not None and self.cost is not None:
            self.cost.refresh(passes_of(stats, self.steps))
            baseline = baseline_seconds(self.cost, stats)
        if self.span is not None:
            attrs: dict[str, Any] = {}
            if stats is not None:
                attrs.update(A.response_attributes(self.model, stats))
                attrs.update(A.speculation_attributes(stats))
                attrs.update(A.timing_attributes(self.ttft_s, self.decode_s, baseline))
            if self.error is not None:
                attrs[A.ERROR_TYPE] = self.error
            if self.closed_early:
                attrs[A.CLOSED_EARLY] = True
            self.span.set_attributes(attrs)
            self.span.end()
        if self.instruments is not None:
            self._record_metrics(duration, stats, baseline)

    def _record_metrics(self, duration: float, stats: DecodeStats | None, baseline: float | None) -> None:
        m, attrs = self.instruments, A.metric_attributes(self.model, self.error)
        assert m is not None
        m.duration.record(duration, attrs)
        if stats is None:
            return
        m.tokens.record(stats.prompt_tokens, {**attrs, A.TOKEN_TYPE: "input"})
        m.tokens.record(stats.output_tokens, {**attrs, A.TOKEN_TYPE: "output"})
        if self.ttft_s is not None:
            m.ttft.record(self.ttft_s, attrs)
            if stats.output_tokens > 1:
                m.tpot.record(max(0.0, self.decode_s - self.ttft_s) / (stats.output_tokens - 1), attrs)
        spec = {**attrs, A.DRAFTER: stats.drafter or "none"}
        drafted = stats.source_draft_tokens or {"none": stats.draft_tokens}
        for source, n in drafted.items():  # by source: a dashboard can split auto's suffix/model drafts
            if n:
                by_source = {**spec, A.DRAFT_SOURCE: source}
                m.draft.add(n, by_source)
                m.accepted.add(stats.source_accepted_tokens.get(source, 0), by_source)
        m.forced.add(getattr(stats, "forced_tokens", 0), attrs)
        m.cache_read.add(stats.cached_tokens, attrs)
        if baseline is not None:
            m.baseline.record(baseline, attrs)
            m.saved.add(baseline - self.decode_s, spec)


def traced_stream(
    pair: ModelPair,
    prompt_ids: Any,
    drafter: Any = None,
    prefix_cache: Any = True,
    *,
    model: str | None = None,
    tracer_provider: Any = None,
    meter_provider: Any = None,
    **options: Any,
) -> Iterator[Step]:
    """``agentspec.stream`` with a span and metric points for the call (same arguments and Steps)."""
    from agentspec.decode import stream

    try:  # the request's attributes; a bad option is raised by stream() below, inside the span
        config = options.get("config") or GenerationConfig(**options)
        described = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    except Exception:
        described = dict(options)
    described["prefix_cache"] = prefix_cache
    call = CallTrace(
        pair,
        model or pair.name,
        described,
        streamed=True,
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
    )
    steps = call.watch(stream(pair, prompt_ids, drafter, prefix_cache, **options))
    try:
        yield from steps
    except BaseException as exc:
        call.fail(exc)
        raise
    finally:
        steps.close()
        call.end()
