"""The chat span under each LangChain tracer, and an agent run's totals, read back from memory.

A ``create_agent`` run (its first model call forced to call ``now``, its second to answer) on a tiny
random Llama behind the embedded tokenizer, traced by the real packages into an
``InMemorySpanExporter`` through an injected TracerProvider: OpenInference's and OpenLLMetry's
LangChain instrumentations, LangSmith's OpenTelemetry export (a ``LangChainTracer`` whose client is in
``tracing_mode="otel"``: spans only, no request to LangSmith, which the test checks by refusing every
connection), and no tracer at all (the caller's span). In each, ``chat tiny-smol`` is a child of the
tracer's span of its model run, ``gen_ai.usage.*`` is on one span per call, and
``get_speculation_callback``'s totals, the root span's ``agentspec.run.*`` and the sum over the
calls' spans and replies agree.
"""

from __future__ import annotations

import socket

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from scripted_calls import WholeCall, now

from agentspec.models import ModelPair
from agentspec.telemetry import attributes as A
from langchain_agentspec import ChatSpecDecode, get_speculation_callback

pytestmark = pytest.mark.usefixtures("one_thread")

CHAT = "chat tiny-smol"
USAGE = (A.USAGE_INPUT_TOKENS, A.USAGE_OUTPUT_TOKENS, A.USAGE_CACHE_READ_INPUT_TOKENS)


def _run_agent(llm, config: dict | None = None) -> tuple[list, object]:
    """The agent's messages and the totals of ``get_speculation_callback`` over its run."""
    from langchain.agents import create_agent
    from langchain.agents.middleware import AgentMiddleware

    class Script(AgentMiddleware):
        def wrap_model_call(self, request, handler):
            done = any(isinstance(m, AIMessage) for m in request.messages)
            return handler(request.override(tool_choice="none" if done else "now"))

    agent = create_agent(llm, tools=[now], middleware=[Script()])
    with get_speculation_callback() as cb:
        out = agent.invoke({"messages": [HumanMessage("What time is it?")]}, config=config)
    messages = out["messages"]
    assert [type(m).__name__ for m in messages] == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"]
    return messages, cb.totals


def _check(spans, messages, totals, root_name: str, usage_on_ours: bool) -> list:
    """The chat spans' parents, once checked: usage on our spans as ``usage_on_ours`` says; the
    totals equal to the sums over the calls' spans and replies, and on the span ``root_name`` of
    the run's root, in the chat spans' trace."""
    by_id = {s.context.span_id: s for s in spans}
    chats = [s for s in spans if s.name == CHAT]
    replies = [m for m in messages if isinstance(m, AIMessage)]
    assert len(chats) == len(replies) == 2, [s.name for s in spans]
    for span in chats:
        assert all((name in span.attributes) is usage_on_ours for name in USAGE), dict(span.attributes)
    saved = sum(s.attributes[A.LATENCY_SAVED] for s in chats)
    assert totals.calls == 2
    assert totals.latency_saved_s == pytest.approx(saved)
    assert totals.latency_saved_s == pytest.approx(
        sum(m.response_metadata["latency"]["latency_saved_s"] for m in replies)
    )
    assert totals.draft_tokens == sum(s.attributes[A.DRAFT_TOKENS] for s in chats)
    assert totals.accepted_tokens == sum(s.attributes[A.ACCEPTED_TOKENS] for s in chats)
    assert totals.cache_read_tokens == sum(s.attributes[A.PREFIX_TOKENS_RESTORED] for s in chats)
    assert totals.decode_s == pytest.approx(sum(s.attributes[A.DECODE_TIME] for s in chats))
    # OpenLLMetry adds a span of its own (invoke_agent) above the root run's
    (root,) = [s for s in spans if s.name == root_name and s.context.trace_id == chats[0].context.trace_id]
    on_root = {k: v for k, v in root.attributes.items() if k.startswith("agentspec.run.")}
    assert on_root == pytest.approx(totals.attributes()) and on_root[A.RUN_LATENCY_SAVED] == pytest.approx(
        saved
    )
    assert all(s.context.trace_id == root.context.trace_id and s.parent is not None for s in chats)
    return [by_id[s.parent.span_id] for s in chats]


def test_no_tracer_the_callers_span_is_the_parent(tiny_smol, spans):
    exporter, provider = spans
    with provider.get_tracer("test").start_as_current_span("caller") as caller:
        messages, totals = _run_agent(WholeCall(pair=tiny_smol, max_tokens=6, tracer_provider=provider))
        caller.set_attributes(totals.attributes())  # the documented way with no tracer
    parents = _check(exporter.get_finished_spans(), messages, totals, "caller", usage_on_ours=True)
    assert {p.name for p in parents} == {"caller"}


def test_openinference_tokens_are_reported_once_per_call(tiny_smol, spans):
    oi = pytest.importorskip("openinference.instrumentation.langchain")
    exporter, provider = spans
    instrumentor = oi.LangChainInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        messages, totals = _run_agent(WholeCall(pair=tiny_smol, max_tokens=6, tracer_provider=provider))
    finally:
        instrumentor.uninstrument()
    spans = exporter.get_finished_spans()
    parents = _check(spans, messages, totals, "LangGraph", usage_on_ours=False)
    for parent in parents:
        assert parent.attributes["openinference.span.kind"] == "LLM"
    # each call's tokens on exactly one span of the trace: its LLM span's, not ours
    replies = [m for m in messages if isinstance(m, AIMessage)]
    prompt = [
        s.attributes["llm.token_count.prompt"] for s in spans if "llm.token_count.prompt" in s.attributes
    ]
    assert sorted(prompt) == sorted(m.usage_metadata["input_tokens"] for m in replies)
    assert not [s.name for s in spans if A.USAGE_INPUT_TOKENS in s.attributes]


def test_span_usage_true_puts_usage_back(tiny_smol, spans):
    oi = pytest.importorskip("openinference.instrumentation.langchain")
    exporter, provider = spans
    instrumentor = oi.LangChainInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        llm = ChatSpecDecode(pair=tiny_smol, max_tokens=4, tracer_provider=provider, span_usage=True)
        reply = llm.invoke("hi")
    finally:
        instrumentor.uninstrument()
    (span,) = [s for s in exporter.get_finished_spans() if s.name == CHAT]
    assert span.attributes[A.USAGE_INPUT_TOKENS] == reply.usage_metadata["input_tokens"]


def _unwrap_openllmetry() -> None:
    """What OpenLLMetry's ``uninstrument`` leaves wrapped (0.62 hands its ``unwrap`` dotted names such
    as ``"BaseCallbackManager.__init__"``, which it does not resolve): unwrapped here, or every later
    LangChain run in this process would carry its handler."""
    from langchain.agents.middleware.types import AgentMiddleware
    from langchain_core.callbacks import BaseCallbackManager
    from langgraph.pregel import Pregel
    from langgraph.types import Command

    for cls in (BaseCallbackManager, Pregel, Command, AgentMiddleware):
        for name, value in list(vars(cls).items()):
            wrapper = getattr(value, "_self_wrapper", None)
            if getattr(wrapper, "__module__", "").startswith("opentelemetry.instrumentation.langchain"):
                setattr(cls, name, value.__wrapped__)


def test_openllmetry_llm_spans_are_the_parents(tiny_smol, spans):
    ol = pytest.importorskip("opentelemetry.instrumentation.langchain")
    exporter, provider = spans
    instrumentor = ol.LangchainInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        messages, totals = _run_agent(WholeCall(pair=tiny_smol, max_tokens=6, tracer_provider=provider))
    finally:
        instrumentor.uninstrument()
        _unwrap_openllmetry()
    spans = exporter.get_finished_spans()
    parents = _check(spans, messages, totals, "LangGraph.workflow", usage_on_ours=False)
    replies = [m for m in messages if isinstance(m, AIMessage)]
    assert sorted(p.attributes[A.USAGE_INPUT_TOKENS] for p in parents) == sorted(
        m.usage_metadata["input_tokens"] for m in replies
    )
    assert {p.name for p in parents} == {"WholeCall.chat"}


@pytest.fixture
def no_network(monkeypatch):
    """Every connection refused (and recorded): LangSmith must not reach its API."""
    tried = []

    def refuse(self, address):
        tried.append(address)
        raise OSError("the test allows no connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    for name in (
        "LANGSMITH_TRACING",
        "LANGCHAIN_TRACING_V2",
        "LANGSMITH_TRACING_MODE",
        "LANGSMITH_OTEL_ENABLED",
    ):
        monkeypatch.delenv(name, raising=False)
    return tried


def test_langsmith_otel_export_spans_are_the_parents(tiny_smol, spans, no_network):
    pytest.importorskip("langsmith")
    from langchain_core.tracers.langchain import LangChainTracer
    from langsmith import Client

    exporter, provider = spans
    client = Client(
        api_url="http://127.0.0.1:9", api_key="offline", tracing_mode="otel", otel_tracer_provider=provider
    )
    tracer = LangChainTracer(client=client, project_name="agentspec-test")
    llm = WholeCall(pair=tiny_smol, max_tokens=6, tracer_provider=provider)
    messages, totals = _run_agent(llm, config={"callbacks": [tracer]})
    client.flush()  # LangSmith ends its spans on its background thread
    spans = exporter.get_finished_spans()
    parents = _check(spans, messages, totals, "LangGraph", usage_on_ours=False)
    for parent in parents:
        assert parent.name == "WholeCall" and parent.attributes["langsmith.span.kind"] == "llm"
    assert no_network == []


def test_a_local_path_names_no_span(tiny_smol, spans):
    exporter, provider = spans
    at_path = ModelPair(
        target=tiny_smol.target, tokenizer=tiny_smol.tokenizer, name="/home/someone/checkpoints/tiny-smol"
    )
    ChatSpecDecode(pair=at_path, max_tokens=3, tracer_provider=provider).invoke("hi")
    (span,) = exporter.get_finished_spans()
    assert span.name == CHAT
    assert span.attributes[A.REQUEST_MODEL] == span.attributes[A.RESPONSE_MODEL] == "tiny-smol"
    assert not [v for v in span.attributes.values() if "someone" in str(v)]
