"""Spans of an agent run, exported to a real Arize Phoenix over OTLP/HTTP and read back through its API.

Starts ``phoenix serve`` on free loopback ports in a temporary folder (about 20-40 s) and stops it
afterwards. The agent is a ``create_agent`` run on a tiny random Llama behind the embedded model's
tokenizer (its first call is forced to call a tool, its second answers), traced by OpenInference's
LangChain instrumentation when it is installed (else under one hand-made root span). Every span also
goes to an in-memory exporter, so what Phoenix returns is compared with what was sent.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("phoenix", reason="arize-phoenix (a dev dependency) is not installed")
pytest.importorskip(
    "opentelemetry.exporter.otlp.proto.http",
    reason="opentelemetry-exporter-otlp-proto-http (a dev dependency) is not installed",
)

from langchain_core.messages import AIMessage, HumanMessage  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from scripted_calls import WholeCall, now  # noqa: E402  (the scripted tool call)

from agentspec.cache import PrefixCache  # noqa: E402
from agentspec.models import ModelPair, ensure_default_model  # noqa: E402
from agentspec.telemetry import attributes as A  # noqa: E402
from examples.phoenix_local import local_phoenix, otlp_processor, spans_dataframe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _run_agent(llm) -> list:
    from langchain.agents import create_agent
    from langchain.agents.middleware import AgentMiddleware

    class Script(AgentMiddleware):
        def wrap_model_call(self, request, handler):
            done = any(isinstance(m, AIMessage) for m in request.messages)
            return handler(request.override(tool_choice="none" if done else "now"))

    agent = create_agent(llm, tools=[now], middleware=[Script()])
    return agent.invoke({"messages": [HumanMessage("What time is it?")]})["messages"]


def _nested(row, dotted: str):
    """A dotted attribute from Phoenix's dataframe (it nests attributes by their dots)."""
    head, *rest = dotted.split(".")
    value = row[f"attributes.{head}"]
    for key in rest:
        value = value[key]
    return value


def test_agent_spans_reach_phoenix_and_come_back(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    model = tiny_llama(5, vocab_size=len(tokenizer), max_positions=1024)
    pair = ModelPair(target=model, tokenizer=tokenizer, name="tiny-smol", prefix_cache=PrefixCache(64 << 20))
    try:
        from openinference.instrumentation.langchain import LangChainInstrumentor
    except ImportError:
        LangChainInstrumentor = None  # noqa: N806

    with local_phoenix(tmp_path / "phoenix") as url:
        memory = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(memory))
        provider.add_span_processor(otlp_processor(url))
        llm = WholeCall(pair=pair, max_tokens=6, tracer_provider=provider)
        if LangChainInstrumentor is not None:
            instrumentor = LangChainInstrumentor()
            instrumentor.instrument(tracer_provider=provider)
            try:
                messages = _run_agent(llm)
            finally:
                instrumentor.uninstrument()
        else:
            with provider.get_tracer("test").start_as_current_span("agent"):
                messages = _run_agent(llm)
        kinds = [type(m).__name__ for m in messages]
        assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"], kinds
        provider.force_flush()
        sent = memory.get_finished_spans()

        deadline = time.monotonic() + 60  # Phoenix ingests asynchronously
        while True:
            df = spans_dataframe(url)
            if len(df) >= len(sent) or time.monotonic() > deadline:
                break
            time.sleep(1)
        provider.shutdown()

    assert len(df) == len(sent), (len(df), [s.name for s in sent])
    rows = {row["context.span_id"]: row for _, row in df.iterrows()}
    chats = [row for row in rows.values() if row["name"] == "chat tiny-smol"]
    assert len(chats) == 2, df["name"].tolist()
    ours = {format(s.context.span_id, "016x"): s for s in sent if s.name == "chat tiny-smol"}
    for row in chats:
        span = ours[row["context.span_id"]]
        for name in (A.DRAFTER, A.DRAFT_TOKENS, A.ACCEPTED_TOKENS, A.VERIFY_STEPS, A.PREFIX_TOKENS_RESTORED):
            assert _nested(row, name) == span.attributes[name], name
        assert list(_nested(row, A.ACCEPTANCE_HISTOGRAM)) == list(span.attributes[A.ACCEPTANCE_HISTOGRAM])
        assert _nested(row, A.LATENCY_SAVED) == pytest.approx(span.attributes[A.LATENCY_SAVED])
        assert _nested(row, A.USAGE_INPUT_TOKENS) == span.attributes[A.USAGE_INPUT_TOKENS]
        # under the agent's tree: a chain of parents up to one root, shared by both calls
        chain, at = [], row
        while isinstance(at["parent_id"], str) and at["parent_id"] in rows:
            at = rows[at["parent_id"]]
            chain.append(at["name"])
        assert chain, "our span has no parent in Phoenix"
        assert not isinstance(at["parent_id"], str), f"a parent is missing: {at['parent_id']}"
        row["root"] = at["context.span_id"]
        if LangChainInstrumentor is not None:
            assert rows[row["parent_id"]]["span_kind"] == "LLM", chain  # the LangChain model run
    assert chats[0]["root"] == chats[1]["root"]
