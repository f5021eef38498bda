"""Spans of an agent run, exported to a real Arize Phoenix over OTLP/HTTP and read back through its API.

Starts ``phoenix serve`` on free loopback ports in a temporary folder (about 20-40 s) and stops it
afterwards. The agent is a ``create_agent`` run on a tiny random Llama behind the embedded model's
tokenizer (its first call is forced to call a tool, its second answers), traced by OpenInference's
LangChain instrumentation when it is installed (else under one hand-made root span). Every span also
goes to an in-memory exporter, so what Phoenix returns is compared with what was sent. The run's
speculation totals (``get_speculation_callback``) come back on its root span as ``agentspec.run.*``,
equal to the sums over the calls; each call's tokens come back on one span of the trace.
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
from langchain_agentspec import get_speculation_callback  # noqa: E402

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


def _nested(row, dotted: str, default=KeyError):
    """A dotted attribute from Phoenix's dataframe, which has a column of its own for each
    OpenInference name (``attributes.llm.token_count.prompt``) and nests other names by their dots
    (``attributes.agentspec`` holds ``{"run": {...}, ...}``); ``default`` where it is absent (else
    KeyError)."""
    parts = dotted.split(".")
    cut = next((n for n in range(len(parts), 0, -1) if f"attributes.{'.'.join(parts[:n])}" in row.index), 0)
    value = row.get(f"attributes.{'.'.join(parts[:cut])}") if cut else None
    for key in parts[cut:]:
        value = value.get(key) if isinstance(value, dict) else None
    if value is None or value != value:  # absent, or pandas' NaN in a column other rows fill
        if default is KeyError:
            raise KeyError(dotted)
        return default
    return value


def _traced_run(llm, provider, instrumentor) -> tuple[list, object]:
    """The agent's messages and its totals: under OpenInference's instrumentation when there is one
    (the totals then reach its root span by themselves), else under a hand-made root span given them
    (the documented way with no tracer)."""
    if instrumentor is not None:
        instrumentor.instrument(tracer_provider=provider)
        try:
            with get_speculation_callback() as cb:
                messages = _run_agent(llm)
        finally:
            instrumentor.uninstrument()
        return messages, cb.totals
    with provider.get_tracer("test").start_as_current_span("agent") as root:
        with get_speculation_callback() as cb:
            messages = _run_agent(llm)
        root.set_attributes(cb.totals.attributes())
    return messages, cb.totals


def _read_back(url: str, provider, memory) -> tuple[object, tuple]:
    """Phoenix's spans once it holds every span sent (or after 60 s), and the spans sent."""
    provider.force_flush()
    sent = memory.get_finished_spans()
    deadline = time.monotonic() + 60  # Phoenix ingests asynchronously
    while True:
        df = spans_dataframe(url)
        if len(df) >= len(sent) or time.monotonic() > deadline:
            return df, sent
        time.sleep(1)


def test_agent_spans_reach_phoenix_and_come_back(tiny_llama, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model())
    model = tiny_llama(5, vocab_size=len(tokenizer), max_positions=1024)
    pair = ModelPair(target=model, tokenizer=tokenizer, name="tiny-smol", prefix_cache=PrefixCache(64 << 20))
    try:
        from openinference.instrumentation.langchain import LangChainInstrumentor
    except ImportError:
        LangChainInstrumentor = None  # noqa: N806
    instrumentor = LangChainInstrumentor() if LangChainInstrumentor is not None else None

    with local_phoenix(tmp_path / "phoenix") as url:
        memory = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(memory))
        provider.add_span_processor(otlp_processor(url))
        llm = WholeCall(pair=pair, max_tokens=6, tracer_provider=provider)
        messages, totals = _traced_run(llm, provider, instrumentor)
        kinds = [type(m).__name__ for m in messages]
        assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"], kinds
        df, sent = _read_back(url, provider, memory)
        provider.shutdown()

    assert len(df) == len(sent), (len(df), [s.name for s in sent])
    rows = {row["context.span_id"]: row for _, row in df.iterrows()}
    chats = [row for row in rows.values() if row["name"] == "chat tiny-smol"]
    assert len(chats) == 2, df["name"].tolist()
    ours = {format(s.context.span_id, "016x"): s for s in sent if s.name == "chat tiny-smol"}
    for row in chats:
        _check_chat_row(row, ours[row["context.span_id"]], rows, instrumentor is not None)
    assert chats[0]["root"] == chats[1]["root"]
    _check_run_totals(rows[chats[0]["root"]], chats, totals)
    replies = [m for m in messages if isinstance(m, AIMessage)]
    _check_tokens_once(rows.values(), replies)


def _check_chat_row(row, span, rows: dict, instrumented: bool) -> None:
    """A chat span as Phoenix returns it: agentspec's attributes as sent, usage only where no tracer
    reports it, under the agent's tree (its root noted in ``row["root"]``)."""
    for name in (A.DRAFTER, A.DRAFT_TOKENS, A.ACCEPTED_TOKENS, A.VERIFY_STEPS, A.PREFIX_TOKENS_RESTORED):
        assert _nested(row, name) == span.attributes[name], name
    assert list(_nested(row, A.ACCEPTANCE_HISTOGRAM)) == list(span.attributes[A.ACCEPTANCE_HISTOGRAM])
    assert _nested(row, A.LATENCY_SAVED) == pytest.approx(span.attributes[A.LATENCY_SAVED])
    if instrumented:  # OpenInference's LLM span, our parent, reports the call's usage
        assert (
            _nested(row, A.USAGE_INPUT_TOKENS, None) is None and A.USAGE_INPUT_TOKENS not in span.attributes
        )
    else:
        assert _nested(row, A.USAGE_INPUT_TOKENS) == span.attributes[A.USAGE_INPUT_TOKENS]
    # under the agent's tree: a chain of parents up to one root, shared by both calls
    chain, at = [], row
    while isinstance(at["parent_id"], str) and at["parent_id"] in rows:
        at = rows[at["parent_id"]]
        chain.append(at["name"])
    assert chain, "our span has no parent in Phoenix"
    assert not isinstance(at["parent_id"], str), f"a parent is missing: {at['parent_id']}"
    row["root"] = at["context.span_id"]
    if instrumented:
        assert rows[row["parent_id"]]["span_kind"] == "LLM", chain  # the LangChain model run


def _check_run_totals(root, chats: list, totals) -> None:
    """The run's root span, read back: ``agentspec.run.*`` equal to the calls' sums and the totals."""
    assert _nested(root, A.RUN_CALLS) == totals.calls == len(chats)
    saved = sum(_nested(row, A.LATENCY_SAVED) for row in chats)
    assert _nested(root, A.RUN_LATENCY_SAVED) == pytest.approx(saved) == totals.latency_saved_s
    assert (
        _nested(root, A.RUN_DRAFT_TOKENS)
        == sum(_nested(r, A.DRAFT_TOKENS) for r in chats)
        == totals.draft_tokens
    )
    accepted = sum(_nested(r, A.ACCEPTED_TOKENS) for r in chats)
    assert _nested(root, A.RUN_ACCEPTED_TOKENS) == accepted == totals.accepted_tokens
    cached = sum(_nested(r, A.PREFIX_TOKENS_RESTORED) for r in chats)
    assert _nested(root, A.RUN_CACHE_READ_TOKENS) == cached == totals.cache_read_tokens


def _check_tokens_once(rows, replies: list) -> None:
    """Each call's prompt tokens on one span of the trace, as Phoenix counts them (it reads
    ``gen_ai.usage.*`` too, as ``llm.token_count.*``): under OpenInference's instrumentation its LLM
    span's, ours carrying none; else ours."""
    counted = []
    for row in rows:
        found = {_nested(row, name, None) for name in ("llm.token_count.prompt", A.USAGE_INPUT_TOKENS)} - {
            None
        }
        assert len(found) <= 1, (row["name"], found)
        counted += [(row["name"], n) for n in found]
    assert sorted(n for _, n in counted) == sorted(m.usage_metadata["input_tokens"] for m in replies), counted
