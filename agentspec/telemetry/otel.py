"""OpenTelemetry glue: one span and one set of metric points per model call.

``CallTrace`` is built before a call (from a ``CallInfo``), is told of the reply (``reply``) or of a
failure (``fail``) and ends with the call's ``agentspec.decode.CallRecord`` (``end``): the steps,
the decoder's time and the latency-saved estimate, the same record the caller reports from. It
turns them into attributes with the pure functions of ``attributes``. The span is started as a child
of the given parent or the current span and never made current itself (it has no children, and a
context attached inside a generator would leak into the caller between chunks); a parent that exists
only later (LangSmith's OpenTelemetry export makes its runs' spans on a background thread) is asked
for when the call ends, and the span made then, backdated to the call's start.

``Telemetry`` holds a caller's tracer and instruments and makes the ``CallTrace`` of each call; it
reads the two switches of ``attributes`` (content capture, the draft conventions) from the
environment at each call, so a process may set them after building its callers. With no SDK
configured (the global providers are the API's no-op/proxy ones and none was injected),
``CallTrace`` records nothing. Tracing never runs the model nor tokenizes: the estimate comes from
the pair's cost model (``agentspec.cost``), taught by the loop, and the content recorded is the
request's messages and the reply the caller parsed.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from opentelemetry import context, metrics, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from agentspec.chat import PreparedRequest
from agentspec.config import GenerationConfig
from agentspec.decode import CallRecord, Step, run
from agentspec.models import ModelPair
from agentspec.telemetry import attributes as A

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


@dataclass(frozen=True)
class InstrumentSpec:
    """One metric instrument: how it is made (``kind``: "histogram", "counter" or "up_down")."""

    kind: str
    name: str
    unit: str
    description: str
    buckets: tuple | None = None  # a histogram's advisory bucket boundaries


H, C = "histogram", "counter"
# the instruments every call records to (the published conventions' and agentspec's), by key
INSTRUMENTS: dict[str, InstrumentSpec] = {
    "duration": InstrumentSpec(
        H, A.METRIC_OPERATION_DURATION, "s", "Duration of a model call", A.DURATION_BUCKETS
    ),
    "tokens": InstrumentSpec(
        H, A.METRIC_TOKEN_USAGE, "{token}", "Input and output tokens per call", A.TOKEN_BUCKETS
    ),
    "ttft": InstrumentSpec(
        H,
        A.METRIC_TIME_TO_FIRST_TOKEN,
        "s",
        "Time to the first output token (prefix-cache restore included)",
        A.DURATION_BUCKETS,
    ),
    "tpot": InstrumentSpec(
        H,
        A.METRIC_TIME_PER_OUTPUT_TOKEN,
        "s",
        "Decoding time per output token after the first",
        A.PER_TOKEN_BUCKETS,
    ),
    "baseline": InstrumentSpec(
        H,
        A.METRIC_BASELINE_DURATION,
        "s",
        "Estimated decoding time of the call with plain decoding and no prefix cache",
        A.DURATION_BUCKETS,
    ),
    "draft": InstrumentSpec(C, A.METRIC_DRAFT_TOKENS, "{token}", "Draft tokens verified"),
    "accepted": InstrumentSpec(C, A.METRIC_ACCEPTED_TOKENS, "{token}", "Draft tokens accepted"),
    "forced": InstrumentSpec(C, A.METRIC_FORCED_TOKENS, "{token}", "Tokens forced by a grammar"),
    "cache_read": InstrumentSpec(
        C, A.METRIC_CACHE_READ_TOKENS, "{token}", "Prompt tokens restored from cache"
    ),
    "saved": InstrumentSpec(
        "up_down",
        A.METRIC_LATENCY_SAVED,
        "s",
        "Estimated time saved against plain decoding without cache (negative: lost)",
    ),
}
# the draft conventions' instruments (``gen_ai.client.inference.*``), recorded only under the opt-in
# flag: an instrument never recorded exports nothing, so a process that does not opt in pays nothing
DRAFT_INSTRUMENTS: dict[str, InstrumentSpec] = {
    "duration": InstrumentSpec(
        H, A.METRIC_INFERENCE_DURATION, "s", "Duration of an inference call", A.DURATION_BUCKETS
    ),
    "first_chunk": InstrumentSpec(
        H,
        A.METRIC_INFERENCE_TIME_TO_FIRST_CHUNK,
        "s",
        "Time to the first chunk of a streamed call",
        A.DURATION_BUCKETS,
    ),
    "input_tokens": InstrumentSpec(
        H, A.METRIC_INFERENCE_INPUT_TOKENS, "{token}", "Input tokens per call", A.TOKEN_BUCKETS
    ),
    "output_tokens": InstrumentSpec(
        H, A.METRIC_INFERENCE_OUTPUT_TOKENS, "{token}", "Output tokens per call", A.TOKEN_BUCKETS
    ),
    # usage counters by what they count, each a subset or the total of its kind
    "input": InstrumentSpec(C, A.METRIC_USAGE_INPUT_TOKENS, "{token}", "Input tokens"),
    "output": InstrumentSpec(C, A.METRIC_USAGE_OUTPUT_TOKENS, "{token}", "Output tokens"),
    "cache_read": InstrumentSpec(
        C, A.METRIC_USAGE_CACHE_READ_TOKENS, "{token}", "Input tokens read from cache"
    ),
    "cache_write": InstrumentSpec(
        C, A.METRIC_USAGE_CACHE_WRITE_TOKENS, "{token}", "Input tokens written to cache"
    ),
}


def _made(meter: Any, specs: dict[str, InstrumentSpec]) -> dict[str, Any]:
    """The instruments of ``specs`` on ``meter``, by key."""
    made = {}
    for key, spec in specs.items():
        if spec.kind == H:
            made[key] = meter.create_histogram(
                spec.name,
                unit=spec.unit,
                description=spec.description,
                explicit_bucket_boundaries_advisory=spec.buckets,
            )
        elif spec.kind == C:
            made[key] = meter.create_counter(spec.name, unit=spec.unit, description=spec.description)
        else:
            made[key] = meter.create_up_down_counter(spec.name, unit=spec.unit, description=spec.description)
    return made


class Instruments:
    """The metric instruments of one MeterProvider: ``calls`` (``INSTRUMENTS``) and ``draft``
    (``DRAFT_INSTRUMENTS``), each by key."""

    def __init__(self, provider: Any):
        meter = provider.get_meter(SCOPE, _version())
        self.calls = _made(meter, INSTRUMENTS)
        self.draft = _made(meter, DRAFT_INSTRUMENTS)


@dataclass(frozen=True)
class CallInfo:
    """What is known of a call before it runs: ``Telemetry.call``'s one argument.

    ``config`` and ``prefix_cache`` are what the call passes to ``agentspec.stream`` (``config`` None:
    refused before it had one); ``streamed`` whether the caller receives chunks; ``parent`` an
    OpenTelemetry Context whose span is the parent (None: the current one), or a function giving
    that Context when the call ends, for a parent made after the call began (then the span is
    started at the end, with the call's start time); ``conversation_id`` the
    caller's thread or session id (None: it has none); ``request_id`` a served request's
    ``X-Request-Id``; ``response_id`` the id the caller gives the
    reply; ``request`` the prepared chat request, for its output type and (with content capture) its
    messages and tools; ``kind`` the span's kind (INTERNAL for a call in the caller's process, SERVER
    for one ``agentspec serve`` answers); ``usage`` False: no ``gen_ai.usage.*`` on the span, where
    another span of the same call reports them (a LangChain tracer's), so that a backend adding up
    spans counts the call's tokens once (the metrics record them either way).
    """

    model: str
    config: GenerationConfig | None
    prefix_cache: Any = True
    streamed: bool = False
    parent: Any = None
    conversation_id: str | None = None
    request_id: str | None = None  # a served request's X-Request-Id
    response_id: str | None = None
    request: PreparedRequest | None = None
    kind: SpanKind = SpanKind.INTERNAL
    usage: bool = True


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

    def call(self, info: CallInfo) -> CallTrace:
        """The ``CallTrace`` of one call, with the switches as set now."""
        tracer, instruments = self._resolved()
        capture = self.capture_content
        if capture is None:
            capture = A.capture_content(os.environ.get(A.ENV_CAPTURE_CONTENT))
        latest = A.latest_experimental(os.environ.get(A.ENV_STABILITY_OPT_IN))
        return CallTrace(info, tracer, instruments, capture, latest)


class CallTrace:
    """The span and metric points of one model call.

    Made by ``Telemetry.call`` before the call runs (``tracer`` and ``instruments`` None: nothing is
    recorded); told the reply as the caller parsed it (``reply``) or a failure (``fail``); ended with
    the call's ``agentspec.decode.CallRecord`` (``end``), whose figures it records as they are: the
    span and the caller's own report read the same record. ``latest``: the draft conventions' names.
    A call whose parent comes late (``CallInfo.parent`` a function) has its span made by ``end``,
    backdated to the call's start, its failure kept until then.
    """

    def __init__(
        self,
        info: CallInfo,
        tracer: Any = None,
        instruments: Instruments | None = None,
        capture_content: bool = False,
        latest: bool = False,
    ):
        self.info, self.instruments, self.capture, self.latest = info, instruments, capture_content, latest
        self.model = A.model_label(info.model)
        self.span = None
        self.late: tuple[Any, Any, int] | None = None  # (tracer, context now, start in ns) of a late span
        if tracer is not None and callable(info.parent):
            self.late = (tracer, context.get_current(), time.time_ns())
        elif tracer is not None:
            self._open(tracer, info.parent)
        # a sampler dropped the span and no meter records: nothing to do
        self.enabled = self.span is not None or self.late is not None or self.instruments is not None
        self.error: str | None = None
        self.exception: tuple[BaseException, int] | None = None  # a late span's failure, and when
        self.ended = False
        self.output: tuple[str, list[dict]] | None = None  # the reply, told by ``reply``
        self.start = time.perf_counter()

    def _open(self, tracer: Any, parent: Any, start_time: int | None = None) -> None:
        name = A.span_name(self.model)
        span = tracer.start_span(name, context=parent, kind=self.info.kind, start_time=start_time)
        if span.is_recording():
            self.span = span
            self._start_attributes()

    def _start_attributes(self) -> None:
        info, request = self.info, self.info.request
        output_type = request.output_type if request is not None else None
        self.span.set_attributes(
            A.request_attributes(
                self.model, info.config, info.prefix_cache, info.streamed, info.conversation_id, output_type
            )
        )
        if info.request_id is not None:  # OpenTelemetry's HTTP header attribute: a list of values
            self.span.set_attribute(A.REQUEST_ID_HEADER, [info.request_id])
        if self.capture and request is not None:
            self.span.set_attributes(A.input_content_attributes(request.messages, request.tools))

    def reply(self, text: str, tool_calls: list[dict]) -> None:
        """The reply as the caller parsed it: its text and its OpenAI-format tool calls (recorded
        as ``gen_ai.output.messages`` when content is captured)."""
        if self.enabled:
            self.output = (text, tool_calls)

    def fail(self, exc: BaseException) -> None:
        """The call raised ``exc`` (GeneratorExit: the caller closed it early, not an error)."""
        if not self.enabled or self.ended or isinstance(exc, GeneratorExit):
            return
        self.error = A.error_type(exc)
        if self.late is not None:
            self.exception = (exc, time.time_ns())
        elif self.span is not None:
            self._record_failure(exc)

    def _record_failure(self, exc: BaseException, timestamp: int | None = None) -> None:
        self.span.record_exception(exc, timestamp=timestamp)
        self.span.set_status(Status(StatusCode.ERROR, f"{self.error}: {exc}"))

    def end(self, record: CallRecord | None = None) -> None:
        """Record the call (once) from ``record`` (None: it failed before decoding); end the span."""
        if not self.enabled or self.ended:
            return
        self.ended = True
        duration = time.perf_counter() - self.start
        if self.late is not None:
            self._open_late()
        if self.span is not None:
            self.span.set_attributes(self._end_attributes(record))
            self.span.end()
        if self.instruments is not None:
            self._record_metrics(duration, record)

    def _open_late(self) -> None:
        """The span of a call whose parent came late: made now, under that parent (the context
        current at the call's start where none came), from the call's start."""
        tracer, at_start, start_ns = self.late
        parent = self.info.parent()
        self._open(tracer, parent if parent is not None else at_start, start_ns)
        if self.span is not None and self.exception is not None:
            self._record_failure(*self.exception)

    def _end_attributes(self, record: CallRecord | None) -> dict[str, Any]:
        attrs: dict[str, Any] = {}
        stats = record.stats if record is not None else None
        if stats is not None:
            attrs.update(
                A.response_attributes(self.model, stats, self.info.response_id, self.latest, self.info.usage)
            )
            attrs.update(A.speculation_attributes(stats))
            attrs.update(A.timing_attributes(record, self.info.streamed))
        if self.capture and self.output is not None:
            attrs.update(A.output_content_attributes(*self.output, stats.finish_reason if stats else None))
        if self.error is not None:
            attrs[A.ERROR_TYPE] = self.error
        if record is not None and record.closed_early:
            attrs[A.CLOSED_EARLY] = True
        return attrs

    def _record_metrics(self, duration: float, record: CallRecord | None) -> None:
        m, attrs = self.instruments, A.metric_attributes(self.model, self.error)
        assert m is not None
        stats = record.stats if record is not None else None
        if self.latest:
            self._record_draft_metrics(m.draft, duration, record, attrs)
        else:
            m.calls["duration"].record(duration, attrs)
        if stats is None:
            return
        c = m.calls
        if not self.latest:
            c["tokens"].record(stats.prompt_tokens, {**attrs, A.TOKEN_TYPE: "input"})
            c["tokens"].record(stats.output_tokens, {**attrs, A.TOKEN_TYPE: "output"})
        if record.ttft_s is not None:
            c["ttft"].record(record.ttft_s, attrs)
            if stats.output_tokens > 1:
                per_token = max(0.0, record.decode_s - record.ttft_s) / (stats.output_tokens - 1)
                c["tpot"].record(per_token, attrs)
        spec = {**attrs, A.DRAFTER: stats.drafter or "none"}
        drafted = stats.source_draft_tokens or {"none": stats.draft_tokens}
        for source, n in drafted.items():  # by source: a dashboard can split auto's suffix/model drafts
            if n:
                by_source = {**spec, A.DRAFT_SOURCE: source}
                c["draft"].add(n, by_source)
                c["accepted"].add(stats.source_accepted_tokens.get(source, 0), by_source)
        c["forced"].add(stats.forced_tokens, attrs)
        c["cache_read"].add(stats.cached_tokens, attrs)
        if record.baseline_s is not None:
            c["baseline"].record(record.baseline_s, attrs)
            c["saved"].add(record.latency_saved_s, spec)

    def _record_draft_metrics(
        self, m: dict[str, Any], duration: float, record: CallRecord | None, attrs: dict[str, Any]
    ) -> None:
        """The draft conventions' points, in place of the published duration and token usage."""
        m["duration"].record(duration, attrs)
        if record is None:
            return
        if self.info.streamed and record.first_chunk_s is not None:
            m["first_chunk"].record(record.first_chunk_s, attrs)
        stats = record.stats
        if stats is None:
            return
        m["input_tokens"].record(stats.prompt_tokens, attrs)
        m["output_tokens"].record(stats.output_tokens, attrs)
        text = {**attrs, A.TOKEN_MODALITY: "text"}
        for kind, n in (
            ("input", stats.prompt_tokens),
            ("output", stats.output_tokens),
            ("cache_read", stats.cached_tokens),
            ("cache_write", stats.cache_creation_tokens),
        ):
            m[kind].add(n, text)


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
    try:  # the request's attributes; a bad option is raised by run() below, inside the span
        config = options["config"] if "config" in options else GenerationConfig(**options)
    except (TypeError, ValueError):
        config = None
    # one call: a Telemetry of its own (a caller making many keeps one and calls its ``call``)
    telemetry = Telemetry(tracer_provider, meter_provider)
    trace_ = telemetry.call(CallInfo(model or pair.name, config, prefix_cache, streamed=True))
    steps = None
    try:
        steps = run(pair, prompt_ids, drafter, prefix_cache, **options)
        yield from steps
    except BaseException as exc:
        trace_.fail(exc)
        raise
    finally:
        trace_.end(steps.close() if steps is not None else None)
