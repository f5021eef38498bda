"""The CLIENT span of a remote call (``ChatSpecDecode(base_url=...)``), with the OpenTelemetry API alone.

``chat {model}``, kind CLIENT, child of the run's span or of the current one; its context goes out as
the W3C ``traceparent`` (``opentelemetry.propagate``), so an agentspec server's span is its child and
the two processes share one trace. It carries what the engine's span carries where the response
says it: the request's options, ``server.address`` and ``server.port``, the conversation id, the
response id, usage (``cache_read`` included), and the speculation figures the server reports. The
model is named as the engine names it (``model_label``: a served folder's last component, never its
path).

Latency saved: only what an agentspec server reports (``metrics.agentspec.latency_saved_s``, its
estimate against plain decoding without the cache, and its ``baseline_s``); other servers measure no
baseline, and a figure the client made up from their speculation counts would not be one, so their
spans have none.

The attribute names are the engine's (``agentspec.telemetry.attributes``, the one names module),
written out here because that module imports the engine, and this path runs without it; a unit test
checks each against the engine's. ``server.*`` are OpenTelemetry's stable names. No metrics: the
server counts usage (see ``remote``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from opentelemetry import propagate
from opentelemetry import trace as otel_trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

if TYPE_CHECKING:
    from tenacity import RetryCallState

# -- names: agentspec.telemetry.attributes' --------------------------------------------------------------
OPERATION_NAME = "gen_ai.operation.name"
PROVIDER_NAME = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TOP_K = "gen_ai.request.top_k"
REQUEST_SEED = "gen_ai.request.seed"
REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
REQUEST_STREAM = "gen_ai.request.stream"
CONVERSATION_ID = "gen_ai.conversation.id"
OUTPUT_TYPE = "gen_ai.output.type"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
USAGE_CACHE_READ_INPUT_TOKENS = "gen_ai.usage.cache_read.input_tokens"
USAGE_PREFIX = "gen_ai.usage."
ERROR_TYPE = "error.type"
DRAFTER = "agentspec.drafter"
DRAFT_TOKENS = "agentspec.draft_tokens"
ACCEPTED_TOKENS = "agentspec.accepted_tokens"
VERIFY_STEPS = "agentspec.verify_steps"
ACCEPTANCE_RATE = "agentspec.acceptance_rate"
MEAN_ACCEPTANCE_LENGTH = "agentspec.mean_acceptance_length"
ACCEPTANCE_HISTOGRAM = "agentspec.acceptance_histogram"
ACCEPTED_PER_POSITION = "agentspec.accepted_per_position"
DRAFTED_PER_POSITION = "agentspec.drafted_per_position"
BASELINE_ESTIMATE = "agentspec.baseline_estimate_s"
LATENCY_SAVED = "agentspec.latency_saved_s"
COST_SOURCE = "agentspec.latency.cost_source"
CLOSED_EARLY = "agentspec.closed_early"
OPERATION = "chat"
PROVIDER = "agentspec"
# -- OpenTelemetry's stable server attributes ---------------------------------------------------------
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"

_REQUEST = (  # create()'s option -> the span attribute
    ("max_tokens", REQUEST_MAX_TOKENS),
    ("temperature", REQUEST_TEMPERATURE),
    ("top_p", REQUEST_TOP_P),
    ("seed", REQUEST_SEED),
)
_SPECULATION = (  # response_metadata["speculative"] key -> the span attribute
    ("drafter", DRAFTER),
    ("draft_tokens", DRAFT_TOKENS),
    ("accepted_tokens", ACCEPTED_TOKENS),
    ("verify_steps", VERIFY_STEPS),
    ("acceptance_rate", ACCEPTANCE_RATE),
    ("mean_acceptance_length", MEAN_ACCEPTANCE_LENGTH),
    ("acceptance_histogram", ACCEPTANCE_HISTOGRAM),
    ("accepted_per_position", ACCEPTED_PER_POSITION),
    ("drafted_per_position", DRAFTED_PER_POSITION),
)
_LATENCY = (
    ("latency_saved_s", LATENCY_SAVED),
    ("baseline_s", BASELINE_ESTIMATE),
    ("cost_source", COST_SOURCE),
)


class Response(Protocol):
    """What a response told of itself, as the span reads it. Declared here so that the span helper
    needs nothing of the client above it (``remote.Reply`` is one)."""

    id: str | None
    model: str
    finish_reason: str | None
    usage: Any  # OpenAI's ``CompletionUsage`` or None
    metrics: dict[str, Any] | None  # the server's ``metrics`` as sent


def model_label(model: str) -> str:
    """The engine's ``attributes.model_label`` (a local path's last component, never the path: a
    vLLM server started on a folder serves the folder's path as the model's name)."""
    text = model.strip()
    rooted = text.startswith(("/", "~", ".")) or re.match(r"^[A-Za-z]:", text) is not None
    if not (rooted or "\\" in text or text.count("/") > 1 or text.lower().endswith(".gguf")):
        return text
    parts = [p for p in re.split(r"[/\\]+", text) if p not in ("", ".", "..", "~")]
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3].removeprefix("models--").replace("--", "/")
    if not parts:
        return text
    last = parts[-1]
    return last[: -len(".gguf")] if last.lower().endswith(".gguf") and len(last) > 5 else last


def server_of(base_url: str) -> tuple[str, int]:
    """``server.address`` and ``server.port`` of an endpoint (the scheme's port when it names none)."""
    parts = urlsplit(base_url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def request_attributes(
    options: Mapping[str, Any], server: tuple[str, int], streamed: bool, conversation: str | None
) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        OPERATION_NAME: OPERATION,
        PROVIDER_NAME: PROVIDER,
        REQUEST_MODEL: model_label(options["model"]),
        SERVER_ADDRESS: server[0],
        SERVER_PORT: server[1],
    }
    attrs.update((name, options[key]) for key, name in _REQUEST if options.get(key) is not None)
    if (top_k := (options.get("extra_body") or {}).get("top_k")) is not None:
        attrs[REQUEST_TOP_K] = top_k
    if options.get("stop"):
        attrs[REQUEST_STOP_SEQUENCES] = list(options["stop"])
    if streamed:
        attrs[REQUEST_STREAM] = True
    if conversation is not None:
        attrs[CONVERSATION_ID] = conversation
    if options.get("response_format") is not None:
        attrs[OUTPUT_TYPE] = "json" if options["response_format"].get("type") != "text" else "text"
    return attrs


def response_attributes(reply: Response, speculative: Mapping[str, Any] | None) -> dict[str, Any]:
    """What the response told of itself: id, model, finish reason, usage, speculation, latency saved."""
    attrs: dict[str, Any] = {RESPONSE_MODEL: model_label(reply.model)}
    if reply.id is not None:
        attrs[RESPONSE_ID] = reply.id
    if reply.finish_reason is not None:
        attrs[RESPONSE_FINISH_REASONS] = [reply.finish_reason]
    if reply.usage is not None:
        attrs[USAGE_INPUT_TOKENS] = reply.usage.prompt_tokens
        attrs[USAGE_OUTPUT_TOKENS] = reply.usage.completion_tokens
        details = reply.usage.prompt_tokens_details
        if details is not None and details.cached_tokens is not None:
            attrs[USAGE_CACHE_READ_INPUT_TOKENS] = details.cached_tokens
    for key, name in _SPECULATION:
        if speculative is not None and speculative.get(key) is not None:
            attrs[name] = speculative[key]
    own = (reply.metrics or {}).get("agentspec") or {}
    attrs.update((name, own[key]) for key, name in _LATENCY if own.get(key) is not None)
    return attrs


class ClientSpan:
    """One remote call's span: opened before the first attempt, ended after the reply or the error."""

    def __init__(self, span: otel_trace.Span, usage: bool = True):
        self.span = span
        self.usage = usage  # False: a LangChain tracer's span reports the call's tokens (``_run``)

    @classmethod
    def start(
        cls,
        tracer_provider: Any,
        server: tuple[str, int],
        options: Mapping[str, Any],
        streamed: bool,
        conversation: str | None,
        parent: Context | None,
        usage: bool = True,
    ) -> ClientSpan:
        tracer = otel_trace.get_tracer(__name__, tracer_provider=tracer_provider)
        attrs = request_attributes(options, server, streamed, conversation)
        name = f"{OPERATION} {model_label(options['model'])}"
        span = tracer.start_span(name, context=parent, kind=SpanKind.CLIENT, attributes=attrs)
        return cls(span, usage)

    def trace_headers(self) -> dict[str, str]:
        """``traceparent`` (and ``tracestate``) naming this span, for the request's headers."""
        headers: dict[str, str] = {}
        propagate.inject(headers, context=otel_trace.set_span_in_context(self.span))
        return headers

    def retried(self, state: RetryCallState) -> None:
        """tenacity's ``before_sleep``: an event per failed attempt that is retried."""
        exc = state.outcome.exception() if state.outcome is not None else None
        self.span.add_event(
            "retry", {"attempt": state.attempt_number, ERROR_TYPE: type(exc).__qualname__ if exc else ""}
        )

    def closed_early(self) -> None:
        self.span.set_attribute(CLOSED_EARLY, True)

    def fail(self, exc: BaseException) -> None:
        self.span.record_exception(exc)
        self.span.set_attribute(ERROR_TYPE, type(exc).__qualname__)
        self.span.set_status(Status(StatusCode.ERROR, str(exc)))

    def end(self, reply: Response, speculative: Mapping[str, Any] | None) -> None:
        attrs = response_attributes(reply, speculative)
        if not self.usage:  # the tracer's LLM span counts these tokens: a backend sums them once
            attrs = {k: v for k, v in attrs.items() if not k.startswith(USAGE_PREFIX)}
        self.span.set_attributes(attrs)
        self.span.end()
