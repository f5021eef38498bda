"""OpenTelemetry glue: one span and one set of metric points per model call.

``CallTrace`` is built before a call, wraps its Step generator (``watch``), is told of the reply
(``reply``) or of a failure (``fail``) and ends after the generator is closed (``end``). It turns
what it saw into attributes with the pure functions of ``attributes`` and the estimate of
``latency``. The span is started as a child of the current span and never made current itself (it
has no children, and a context attached inside a generator would leak into the caller between
chunks).

``Telemetry`` holds a caller's tracer and instruments and makes the ``CallTrace`` of each call; it
reads the two switches of ``attributes`` (content capture, the draft conventions) from the
environment at each call, so a process may set them after building its callers. With no SDK
configured (the global providers are the API's no-op/proxy ones and none was injected),
``CallTrace`` records nothing and hands the generator back unwrapped. Tracing never runs the model
nor tokenizes: the latency estimate learns from the passes the loop timed
(``agentspec.telemetry.latency``), and the content recorded is the request's messages and the
reply the caller parsed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Generator, Iterator
from typing import TYPE_CHECKING, Any

from opentelemetry import metrics, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from agentspec.config import GenerationConfig
from agentspec.stats import DecodeStats
from agentspec.telemetry import attributes as A
from agentspec.telemetry.latency import baseline_seconds, cost_model

if TYPE_CHECKING:  # models.py imports this package (ModelPair.latency): annotations only
    from agentspec.chat import PreparedRequest
    from agentspec.decode import Step
    from agentspec.models import ModelPair

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
    """The metric instruments of one MeterProvider."""

    def __init__(self, provider: Any):
        meter = provider.get_meter(SCOPE, _version())

        def hist(name: str, unit: str, description: str, buckets: Any) -> Any:
            return meter.create_histogram(
                name, unit=unit, description=description, explicit_bucket_boundaries_advisory=buckets
            )

        self.duration = hist(A.METRIC_OPERATION_DURATION, "s", "Duration of a model call", A.DURATION_BUCKETS)
        self.tokens = hist(
            A.METRIC_TOKEN_USAGE, "{token}", "Input and output tokens per call", A.TOKEN_BUCKETS
        )
        self.ttft = hist(
            A.METRIC_TIME_TO_FIRST_TOKEN,
            "s",
            "Time to the first output token (prefix-cache restore included)",
            A.DURATION_BUCKETS,
        )
        self.tpot = hist(
            A.METRIC_TIME_PER_OUTPUT_TOKEN,
            "s",
            "Decoding time per output token after the first",
            A.PER_TOKEN_BUCKETS,
        )
        self.baseline = hist(
            A.METRIC_BASELINE_DURATION,
            "s",
            "Estimated decoding time of the call with plain decoding and no prefix cache",
            A.DURATION_BUCKETS,
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
        self.draft_names = DraftInstruments(meter, hist)  # recorded only under the opt-in flag


class DraftInstruments:
    """The draft conventions' instruments (``gen_ai.client.inference.*``). An instrument never
    recorded exports nothing, so making them costs a process that does not opt in nothing."""

    def __init__(self, meter: Any, hist: Any):
        self.duration = hist(
            A.METRIC_INFERENCE_DURATION, "s", "Duration of an inference call", A.DURATION_BUCKETS
        )
        self.first_chunk = hist(
            A.METRIC_INFERENCE_TIME_TO_FIRST_CHUNK,
            "s",
            "Time to the first chunk of a streamed call",
            A.DURATION_BUCKETS,
        )
        self.input_tokens = hist(
            A.METRIC_INFERENCE_INPUT_TOKENS, "{token}", "Input tokens per call", A.TOKEN_BUCKETS
        )
        self.output_tokens = hist(
            A.METRIC_INFERENCE_OUTPUT_TOKENS, "{token}", "Output tokens per call", A.TOKEN_BUCKETS
        )
        count = meter.create_counter
        self.usage = {  # counters by what they count, each a subset or the total of its kind
            "input": count(A.METRIC_USAGE_INPUT_TOKENS, unit="{token}", description="Input tokens"),
            "output": count(A.METRIC_USAGE_OUTPUT_TOKENS, unit="{token}", description="Output tokens"),
            "cache_read": count(
                A.METRIC_USAGE_CACHE_READ_TOKENS, unit="{token}", description="Input tokens read from cache"
            ),
            "cache_write": count(
                A.METRIC_USAGE_CACHE_WRITE_TOKENS, unit="{token}", description="Input tokens written to cache"
            ),
        }


class Telemetry:
    """Where one caller's calls are recorded: a tracer and metric instruments of its providers.

    The caller keeps one (the chat model builds it once) and makes a ``CallTrace`` per call with
    ``call``. A provider given as None is the global one, looked up at every call: an app may set
    its SDK after building the caller. The tracer and instruments of the provider last seen are kept
    (for the same names, the SDK hands back the instruments it made before, without a warning).
    ``capture_content``: record messages on the spans (True), never (False), or as
    ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT`` says at each call (None).
    """

    def __init__(
        self, tracer_provider: Any = None, meter_provider: Any = None, capture_content: bool | None = None
    ):
        self.tracer_provider, self.meter_provider = tracer_provider, meter_provider
        self.capture_content = capture_content
        self._lock = threading.Lock()
        self._tracing: Any = None  # the provider resolved at the last call, and its tracer
        self._tracer: Any = None
        self._metering: Any = None  # the same for metrics
        self._instruments: Instruments | None = None

    def __deepcopy__(self, memo: dict) -> Telemetry:
        # a deep copy of its caller (pydantic's model_copy(deep=True)) records to the same providers
        return Telemetry(self.tracer_provider, self.meter_provider, self.capture_content)

    def _resolved(self) -> tuple[Any, Instruments | None]:
        tracing = tracer_provider_or_none(self.tracer_provider)
        metering = meter_provider_or_none(self.meter_provider)
        with self._lock:
            if tracing is not self._tracing:
                self._tracing = tracing
                self._tracer = tracing.get_tracer(SCOPE, _version()) if tracing is not None else None
            if metering is not self._metering:
                self._metering = metering
                self._instruments = Instruments(metering) if metering is not None else None
            return self._tracer, self._instruments

    def call(
        self,
        pair: ModelPair | None,
        model: str,
        config: GenerationConfig | None,
        prefix_cache: Any = True,
        *,
        streamed: bool,
        parent: Any = None,
        conversation_id: str | None = None,
        response_id: str | None = None,
        request: PreparedRequest | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> CallTrace:
        """The ``CallTrace`` of one call (the arguments are ``CallTrace``'s), with the switches as set now."""
        tracer, instruments = self._resolved()
        capture = self.capture_content
        if capture is None:
            capture = A.capture_content(os.environ.get(A.ENV_CAPTURE_CONTENT))
        return CallTrace(
            pair,
            model,
            config,
            prefix_cache,
            streamed=streamed,
            parent=parent,
            conversation_id=conversation_id,
            response_id=response_id,
            request=request,
            kind=kind,
            tracer=tracer,
            instruments=instruments,
            capture_content=capture,
            latest=A.latest_experimental(os.environ.get(A.ENV_STABILITY_OPT_IN)),
        )


class CallTrace:
    """The span and metric points of one model call.

    ``pair`` may be None for a call that failed before a model was chosen (no estimate then).
    ``config`` and ``prefix_cache`` are what the call passes to ``agentspec.stream`` (``config``
    None: refused before it had one); ``streamed`` whether the caller
    receives chunks; ``parent`` an OpenTelemetry Context whose span is the parent (None: the
    current one); ``conversation_id`` the caller's thread or session id (None: it has none);
    ``response_id`` the id the caller gives the reply; ``request`` the prepared chat request, for
    its output type and (with ``capture_content``) its messages and tools; ``kind`` the span's kind
    (INTERNAL for a call in the caller's process, SERVER for one ``agentspec serve`` answers); ``tracer`` and
    ``instruments`` where the call is recorded (``Telemetry.call`` resolves them; both None:
    nothing is); ``latest``: the draft conventions' names (``attributes``). Looking up the pair's
    CostModel runs no model pass. The reply's content is told with ``reply``.
    """

    def __init__(
        self,
        pair: ModelPair | None,
        model: str,
        config: GenerationConfig | None,
        prefix_cache: Any = True,
        *,
        streamed: bool,
        parent: Any = None,
        conversation_id: str | None = None,
        response_id: str | None = None,
        request: PreparedRequest | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        tracer: Any = None,
        instruments: Instruments | None = None,
        capture_content: bool = False,
        latest: bool = False,
    ):
        self.enabled = tracer is not None or instruments is not None
        if not self.enabled:
            return
        self.pair, self.model = pair, model
        self.instruments = instruments
        self.streamed, self.response_id, self.latest = streamed, response_id, latest
        self.capture = capture_content
        self.cost = cost_model(pair) if pair is not None else None
        self.span = None
        if tracer is not None:
            span = tracer.start_span(A.span_name(model), context=parent, kind=kind)
            if span.is_recording():
                output_type = request.output_type if request is not None else None
                span.set_attributes(
                    A.request_attributes(model, config, prefix_cache, streamed, conversation_id, output_type)
                )
                if capture_content and request is not None:
                    span.set_attributes(A.input_content_attributes(request.messages, request.tools))
                self.span = span
        if self.span is None and self.instruments is None:  # a sampler dropped the span: nothing to do
            self.enabled = False
            return
        self.steps: list[Step] = []
        self.error: str | None = None
        self.closed_early = False
        self.ended = False
        self.decode_s = 0.0  # inside the decoder: its passes and the time around them (see _watch)
        self.ttft_s: float | None = None
        # to the first pass that released text or finished: the earliest a caller gets a chunk
        self.first_chunk_s: float | None = None
        self.output: tuple[str, list[dict]] | None = None  # the reply, told by ``reply``
        self.start = time.perf_counter()

    def watch(self, steps: Generator[Step, None, None]) -> Generator[Step, None, None]:
        """``steps``, observed. Close it to close ``steps``."""
        return self._watch(steps) if self.enabled else steps

    def _watch(self, steps: Generator[Step, None, None]) -> Generator[Step, None, None]:
        # The passes are timed by the loop (Step.started, Step.seconds: the call's perf_counter clock);
        # timed here is only the decoder's time around them: from each resume to its next pass (the
        # lock wait and cache restore before the first), and the cleanup (the cache save) after the
        # last. Its bookkeeping between a pass's end and its yield (text release) is not counted.
        resumed = time.perf_counter()
        try:
            for step in steps:
                self.decode_s += step.started - resumed + step.seconds
                self.steps.append(step)
                if self.ttft_s is None and step.tokens:
                    self.ttft_s = step.started + step.seconds - self.start
                if self.first_chunk_s is None and (step.text or step.finish_reason is not None):
                    self.first_chunk_s = step.started + step.seconds - self.start
                yield step
                resumed = time.perf_counter()
            self.decode_s += time.perf_counter() - resumed  # ran to its end: the cleanup
        finally:
            t0 = time.perf_counter()
            steps.close()  # closed early: waits for the decoder's cleanup
            self.decode_s += time.perf_counter() - t0

    def reply(self, text: str, tool_calls: list[dict]) -> None:
        """The reply as the caller parsed it: its text and its OpenAI-format tool calls (recorded
        as ``gen_ai.output.messages`` when content is captured)."""
        if self.enabled:
            self.output = (text, tool_calls)

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
        stats = self.steps[-1].stats if self.steps else None  # the call's running stats
        baseline, source = None, None
        if stats is not None and self.cost is not None:
            self.cost.refresh(self.steps)  # before the estimate: a plain call estimates itself
            baseline, source = baseline_seconds(self.cost, stats), self.cost.source
        if self.span is not None:
            attrs: dict[str, Any] = {}
            if stats is not None:
                attrs.update(A.response_attributes(self.model, stats, self.response_id, self.latest))
                attrs.update(A.speculation_attributes(stats))
                first_chunk = self.first_chunk_s if self.streamed else None
                attrs.update(A.timing_attributes(self.ttft_s, self.decode_s, baseline, source, first_chunk))
            if self.capture and self.output is not None:
                reason = stats.finish_reason if stats is not None else None
                attrs.update(A.output_content_attributes(*self.output, reason))
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
        if self.latest:
            self._record_draft_metrics(m.draft_names, duration, stats, attrs)
        else:
            m.duration.record(duration, attrs)
        if stats is None:
            return
        if not self.latest:
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
        m.forced.add(stats.forced_tokens, attrs)
        m.cache_read.add(stats.cached_tokens, attrs)
        if baseline is not None:
            m.baseline.record(baseline, attrs)
            m.saved.add(baseline - self.decode_s, spec)

    def _record_draft_metrics(
        self, m: DraftInstruments, duration: float, stats: DecodeStats | None, attrs: dict[str, Any]
    ) -> None:
        """The draft conventions' points, in place of the published duration and token usage."""
        m.duration.record(duration, attrs)
        if self.streamed and self.first_chunk_s is not None:
            m.first_chunk.record(self.first_chunk_s, attrs)
        if stats is None:
            return
        m.input_tokens.record(stats.prompt_tokens, attrs)
        m.output_tokens.record(stats.output_tokens, attrs)
        text = {**attrs, A.TOKEN_MODALITY: "text"}
        for kind, n in (
            ("input", stats.prompt_tokens),
            ("output", stats.output_tokens),
            ("cache_read", stats.cached_tokens),
            ("cache_write", stats.cache_creation_tokens),
        ):
            m.usage[kind].add(n, text)


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
        config = options["config"] if "config" in options else GenerationConfig(**options)
    except (TypeError, ValueError):
        config = None
    # one call: a Telemetry of its own (a caller making many keeps one and calls its ``call``)
    telemetry = Telemetry(tracer_provider, meter_provider)
    call = telemetry.call(pair, model or pair.name, config, prefix_cache, streamed=True)
    steps = call.watch(stream(pair, prompt_ids, drafter, prefix_cache, **options))
    try:
        yield from steps
    except BaseException as exc:
        call.fail(exc)
        raise
    finally:
        steps.close()
        call.end()
