"""What a LangChain run tells a model call about its place: the span to hang under, whether a tracer
already reports the call's usage, the conversation.

Both paths of ``ChatSpecDecode`` read these: the local one for the engine's span, the remote one for
its CLIENT span and its session headers.

A LangChain tracer that exports to OpenTelemetry opens a span per run, but the model cannot count on
finding it as the current span (OpenInference never makes its spans current; OpenLLMetry attaches
them in the context its callbacks run in, which LangGraph's steps do not all share; LangSmith makes
its spans later, on a background thread). So the call looks the span up by its run id, in the
handlers of its run manager (``TRACERS``):

- OpenInference (``openinference-instrumentation-langchain``): ``tracer.get_span(run_id)``;
- OpenLLMetry (``opentelemetry-instrumentation-langchain``): ``handler.spans[run_id].span``;
- LangSmith's OpenTelemetry export (``LANGSMITH_TRACING_MODE=otel`` or ``hybrid``, or the older
  ``LANGSMITH_OTEL_ENABLED``): a ``LangChainTracer`` whose ``client.otel_exporter`` is set. Its
  exporter makes a run's span when its background thread takes up the run's creation, a batching
  delay (about 50 ms; longer in hybrid mode, behind the upload to LangSmith) after the run began, and
  keeps it by run id, in a store of its own (``_span_info``: no public lookup exists), until the run
  ends. A local call asks for it when it ends (``late_parent``), waiting at most
  ``LATE_PARENT_WAIT_S`` for it; found by then or not, the call goes on the same.

Where none of them has a span for the run, the span's parent is the current span (the caller's).
Each of these tracers reports the LLM run's token usage on its own span; ``tracer_reports_usage`` tells
the chat model so, which then leaves ``gen_ai.usage.*`` off its span.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from langchain_core.runnables import ensure_config
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace

from langchain_agentspec.conversation import conversation_id

LATE_PARENT_WAIT_S = 1.0  # the longest a call's end waits for LangSmith's span of its run
_POLL_S = 0.005


def _openinference_span(handler: Any, run_id: Any) -> Any:
    get_span = getattr(handler, "get_span", None)
    return get_span(run_id) if callable(get_span) else None


def _openllmetry_span(handler: Any, run_id: Any) -> Any:
    spans = getattr(handler, "spans", None)
    holder = spans.get(run_id) if isinstance(spans, dict) else None
    return getattr(holder, "span", None)


def _langsmith_exporter(handler: Any) -> Any:
    """The OpenTelemetry exporter of a LangSmith tracer that exports there (else None)."""
    # no tracer exists before its module is imported (and importing it here would cost every process)
    module = sys.modules.get("langchain_core.tracers.langchain")
    if module is None or not isinstance(handler, module.LangChainTracer):
        return None
    return getattr(getattr(handler, "client", None), "otel_exporter", None)


def _langsmith_span(handler: Any, run_id: Any) -> Any:
    store = getattr(_langsmith_exporter(handler), "_span_info", None)
    info = store.get(run_id) if store is not None else None
    return getattr(info, "span", None)


# how each tracer is recognised and its span of a run found (None: it has none, or none yet)
TRACERS: dict[str, tuple[Callable[[Any], bool], Callable[[Any, Any], Any]]] = {
    "openinference": (lambda h: callable(getattr(h, "get_span", None)), _openinference_span),
    # by its module: ``spans`` is too common a name to recognise a handler by
    "openllmetry": (
        lambda h: type(h).__module__.startswith("opentelemetry.instrumentation.langchain"),
        _openllmetry_span,
    ),
    "langsmith": (lambda h: _langsmith_exporter(h) is not None, _langsmith_span),
}


def tracers(handlers: Sequence[Any] | None) -> list[Any]:
    """The handlers that are OpenTelemetry tracers of LangChain runs (``TRACERS``)."""
    return [h for h in handlers or () if any(is_one(h) for is_one, _ in TRACERS.values())]


def run_span(handlers: Sequence[Any] | None, run_id: Any) -> otel_trace.Span | None:
    """The recording span a tracer among ``handlers`` opened for the run ``run_id``, if one has yet."""
    for handler in handlers or ():
        for is_one, span_of in TRACERS.values():
            span = span_of(handler, run_id) if is_one(handler) else None
            if isinstance(span, otel_trace.Span) and span.is_recording():
                return span
    return None


def trace_root(handlers: Sequence[Any] | None, run_id: Any) -> Any:
    """The id of the root run of ``run_id``'s trace as a LangChain ``BaseTracer`` among ``handlers``
    recorded it (its ``order_map``: LangSmith's tracer, OpenInference's), else None. It knows runs
    that no callback handler sees start (those of langsmith's ``traceable``, as a LangChain agent's
    middleware under LangSmith tracing is)."""
    for handler in handlers or ():
        order = getattr(handler, "order_map", None)
        entry = order.get(run_id) if isinstance(order, dict) else None
        if entry:
            return entry[0]
    return None


def parent_context(run_manager: Any) -> otel_context.Context | None:
    """The span a LangChain tracer opened for this run, as a parent context, when there is one now;
    None: the current span is the parent. Hands the run's tracers to the run's totals handlers
    (``totals.SpeculationCallbackHandler``), which LangChain tells of no other handler."""
    if run_manager is None:
        return None
    _share_tracers(run_manager.handlers)
    span = run_span(run_manager.handlers, run_manager.run_id)
    return otel_trace.set_span_in_context(span) if span is not None else None


def late_parent(run_manager: Any) -> otel_context.Context | Callable[[], Any] | None:
    """``parent_context``, or, where the run's span is yet to be made by LangSmith's exporter, a
    function that waits for it (``LATE_PARENT_WAIT_S`` at most) and gives its context, or None when
    it did not come: ``agentspec.telemetry.CallInfo.parent``, asked when the call ends."""
    found = parent_context(run_manager)
    if found is not None or run_manager is None:
        return found
    late = [h for h in run_manager.handlers or () if _langsmith_exporter(h) is not None]
    if not late:
        return None
    run_id = run_manager.run_id

    def wait() -> otel_context.Context | None:
        deadline = time.monotonic() + LATE_PARENT_WAIT_S
        while (span := run_span(late, run_id)) is None and time.monotonic() < deadline:
            time.sleep(_POLL_S)
        return otel_trace.set_span_in_context(span) if span is not None else None

    return wait


def tracer_reports_usage(run_manager: Any) -> bool:
    """Whether a tracer among the run's handlers reports the LLM run's token usage on a span of its
    own (each one of ``TRACERS`` does: OpenInference as ``llm.token_count.*``, the other two as
    ``gen_ai.usage.*``)."""
    return run_manager is not None and bool(tracers(run_manager.handlers))


class SeesTracers:
    """A callback handler that wants the run's tracers (LangChain tells a handler of no other): each
    model call hands them to it (``parent_context``)."""

    def see_tracers(self, found: list[Any]) -> None:
        """The tracers among a model call's handlers (``tracers``)."""


def _share_tracers(handlers: Sequence[Any] | None) -> None:
    listeners = [h for h in handlers or () if isinstance(h, SeesTracers)]
    if listeners:
        found = tracers(handlers)
        for listener in listeners:
            listener.see_tracers(found)


def run_conversation_id(run_manager: Any) -> str | None:
    """The run's thread or session id (``conversation``), read from the run manager's metadata;
    LangChain streams (``stream``, and an invoke it streams for a LangGraph
    ``stream_mode="messages"``) hand the model no run manager, and then the metadata is the config
    LangChain keeps in context (a LangGraph node's: the thread is there; a bare
    ``llm.stream(config=...)`` leaves none)."""
    return conversation_id(
        run_manager.metadata if run_manager is not None else ensure_config().get("metadata")
    )
