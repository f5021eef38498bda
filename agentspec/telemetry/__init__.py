"""OpenTelemetry spans and metrics for model calls: tokens, speculation, cache reuse, latency saved.

Stats are data (``agentspec.stats.DecodeStats`` and the per-pass ``agentspec.request.Step``); this
package is one exporter of them:

- ``attributes``: every attribute and metric name (``gen_ai.*`` after the OpenTelemetry GenAI
  conventions, ``agentspec.*`` for speculation, the prefix cache and the estimate), the two
  environment switches (opt-in message content, the conventions' draft names), and pure functions
  from a call's stats, request and reply to attribute dicts;
- ``otel``: ``Telemetry`` (a caller's tracer and instruments) and ``CallTrace``, the glue that opens
  a span per call (``chat {model}``, the model named by ``attributes.model_label``, never a local
  path; kind INTERNAL, child of the parent the caller gives or of the current span), records metric
  points and costs nothing when no SDK is configured; ``traced_stream``, ``agentspec.stream`` with
  a span.

The latency-saved estimate comes with the call's record (``agentspec.decode.CallRecord``), priced on
the pair's cost model (``agentspec.cost``), which the decoding loop teaches from every pass it times,
traced or not. Telemetry observes and never acts: a traced call runs exactly the model passes an
untraced one runs, and tokenizes nothing. ``ChatSpecDecode(tracer_provider=..., meter_provider=...)`` keeps a
``Telemetry`` for its calls; by default it uses the global providers. Its spans carry the run's
thread or session id as ``gen_ai.conversation.id`` (``langchain_agentspec.conversation``) and the
reply's ``response_metadata["id"]`` as ``gen_ai.response.id``; under a LangChain tracer its span is
a child of the tracer's span of the model run and leaves ``gen_ai.usage.*`` to it
(``langchain_agentspec._run``), and ``langchain_agentspec.totals`` adds an agent run's calls up.
"""

from agentspec.telemetry.otel import CallInfo, CallTrace, Telemetry, traced_stream

__all__ = ["CallInfo", "CallTrace", "Telemetry", "traced_stream"]
