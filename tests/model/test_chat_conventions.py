"""LangChain's conventions a chat model is expected to keep, on the embedded model: token counting
with the target's own tokenizer and chat template (offline: no GPT-2 tokenizer from a hub),
``response_metadata["model_provider"]``, and ``streaming=True`` as ChatOpenAI takes it."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage, trim_messages
from langchain_core.tools import tool
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import agentspec
from langchain_agentspec import ChatSpecDecode

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_thread")]

CONVERSATION = [
    SystemMessage("You are a terse assistant."),
    HumanMessage("What is 12 squared?"),
    AIMessage("", tool_calls=[{"name": "square", "args": {"x": 12}, "id": "call_1"}]),
    ToolMessage("144", tool_call_id="call_1"),
]


@tool
def square(x: int) -> int:
    """Square an integer."""
    return x * x


@pytest.fixture(scope="module")
def pair():
    return agentspec.load_pair()


@pytest.mark.parametrize("tools", [[], [square]])
def test_the_count_is_the_prompt_a_call_makes(pair, tools):
    llm = ChatSpecDecode(pair=pair, max_tokens=4)
    counted = llm.get_num_tokens_from_messages(CONVERSATION, tools=tools)
    reply = (llm.bind_tools(tools) if tools else llm).invoke(CONVERSATION)
    assert counted == reply.usage_metadata["input_tokens"] > 20


def test_counting_needs_no_weights_and_matches_the_pairs_tokenizer(pair):
    fresh = ChatSpecDecode(max_tokens=4)  # the embedded model, not loaded: the tokenizer alone
    assert (
        fresh.get_token_ids("Paris is sunny.")
        == pair.tokenizer("Paris is sunny.", add_special_tokens=False)["input_ids"]
    )
    assert fresh.get_num_tokens_from_messages(CONVERSATION) == ChatSpecDecode(
        pair=pair
    ).get_num_tokens_from_messages(CONVERSATION)
    assert fresh._loaded is None  # noqa: SLF001  (counting loaded no weights)


def test_trim_messages_counts_with_the_model(pair):
    llm = ChatSpecDecode(pair=pair)
    budget = llm.get_num_tokens_from_messages(CONVERSATION[:2])
    kept = trim_messages(CONVERSATION, max_tokens=budget, token_counter=llm, strategy="first")
    assert kept == CONVERSATION[:2]


def test_model_provider_on_invoke_and_on_the_streams_last_chunk(pair):
    llm = ChatSpecDecode(pair=pair, max_tokens=4)
    assert llm.invoke("Hi").response_metadata["model_provider"] == "agentspec"
    last = list(llm.stream("Hi"))[-1]
    assert last.chunk_position == "last" and last.response_metadata["model_provider"] == "agentspec"


@pytest.mark.parametrize("streaming", [False, True])
def test_streaming_true_invokes_through_the_stream(pair, streaming):
    """``invoke`` decodes through ``_stream`` (its span a streamed call's), the reply the same."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    llm = ChatSpecDecode(pair=pair, max_tokens=8, streaming=streaming, tracer_provider=provider)
    reply = llm.invoke("Name a colour.")
    (span,) = [s for s in exporter.get_finished_spans() if s.name.startswith("chat ")]
    assert span.attributes.get("gen_ai.request.stream", False) is streaming
    assert reply.content == ChatSpecDecode(pair=pair, max_tokens=8).invoke("Name a colour.").content
