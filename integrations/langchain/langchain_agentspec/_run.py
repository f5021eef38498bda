"""What a LangChain run tells a model call about its place: the span to hang under, the conversation.

Both paths of ``ChatSpecDecode`` read these: the local one for the engine's span, the remote one for
its CLIENT span and its session headers.
"""

from __future__ import annotations

from typing import Any

from langchain_core.runnables import ensure_config
from opentelemetry import context as otel_context
from opentelemetry import trace as otel_trace

from langchain_agentspec.conversation import conversation_id


def parent_context(run_manager: Any) -> otel_context.Context | None:
    """The span a LangChain tracer opened for this run, as a parent context, when it has one
    (OpenInference's ``get_span(run_id)``: it does not make its spans current); None: the current
    span is the parent."""
    parent = None
    for handler in getattr(run_manager, "handlers", None) or []:
        span = handler.get_span(run_manager.run_id) if hasattr(handler, "get_span") else None
        if isinstance(span, otel_trace.Span):
            parent = otel_trace.set_span_in_context(span)
    return parent


def run_conversation_id(run_manager: Any) -> str | None:
    """The run's thread or session id (``conversation``), read from the run manager's metadata;
    LangChain streams (``stream``, and an invoke it streams for a LangGraph
    ``stream_mode="messages"``) hand the model no run manager, and then the metadata is the config
    LangChain keeps in context (a LangGraph node's: the thread is there; a bare
    ``llm.stream(config=...)`` leaves none)."""
    return conversation_id(
        run_manager.metadata if run_manager is not None else ensure_config().get("metadata")
    )
