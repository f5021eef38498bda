"""The GenAI conventions on the spans and metrics of ``ChatSpecDecode`` calls, read back from memory.

One test per attribute (conversation id, output type, response id, stream, cache creation, the
opt-in content, the draft's metric names), on a tiny random Llama behind SmolLM2's tokenizer (its
replies are noise, which is all these need); and one inside a real ``create_agent`` run with a
checkpointer and a thread id, on the real SmolLM2 pair.
"""

from __future__ import annotations

import json

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.semconv._incubating.attributes.gen_ai_attributes import GenAiOutputTypeValues
from scripted_calls import WholeCall, now

import agentspec
from agentspec.decode import run
from agentspec.telemetry import CallInfo, Telemetry
from agentspec.telemetry import attributes as A
from langchain_agentspec import ChatSpecDecode

pytestmark = pytest.mark.usefixtures("one_thread")

CONTENT = (A.INPUT_MESSAGES, A.OUTPUT_MESSAGES, A.SYSTEM_INSTRUCTIONS, A.TOOL_DEFINITIONS)
DRAFT_METRICS = {
    A.METRIC_INFERENCE_DURATION,
    A.METRIC_INFERENCE_INPUT_TOKENS,
    A.METRIC_INFERENCE_OUTPUT_TOKENS,
    A.METRIC_USAGE_INPUT_TOKENS,
    A.METRIC_USAGE_OUTPUT_TOKENS,
    A.METRIC_USAGE_CACHE_READ_TOKENS,
    A.METRIC_USAGE_CACHE_WRITE_TOKENS,
    A.METRIC_INFERENCE_TIME_TO_FIRST_CHUNK,
}


@pytest.fixture
def otel(monkeypatch):
    """(exporter, reader, providers as ChatSpecDecode keyword arguments); both switches unset."""
    monkeypatch.delenv(A.ENV_CAPTURE_CONTENT, raising=False)
    monkeypatch.delenv(A.ENV_STABILITY_OPT_IN, raising=False)
    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    meter_provider = MeterProvider(metric_readers=[reader])
    yield exporter, reader, {"tracer_provider": tracer_provider, "meter_provider": meter_provider}
    tracer_provider.shutdown()
    meter_provider.shutdown()


def _points(reader) -> dict[str, list]:
    out: dict[str, list] = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


def _joined(chunks) -> AIMessage:
    reply = chunks[0]
    for c in chunks[1:]:
        reply += c
    return reply


def test_conversation_id_from_the_run_metadata(tiny_smol, otel):
    exporter, _, providers = otel
    llm = ChatSpecDecode(pair=tiny_smol, max_tokens=3, **providers)
    llm.invoke("hi", config={"metadata": {"session_id": "s-9"}})
    llm.invoke("hi", config={"metadata": {"conversation_id": "c-2", "thread_id": "t-2"}})
    llm.invoke("hi")
    # a bare llm.stream() has none: LangChain's stream hands _stream no run manager, nor keeps the
    # config in context (inside a LangGraph node it does: the agent test below streams)
    list(llm.stream("hi", config={"metadata": {"thread_id": "t-3"}}))
    first, second, none, streamed = exporter.get_finished_spans()
    assert first.attributes[A.CONVERSATION_ID] == "s-9" and second.attributes[A.CONVERSATION_ID] == "c-2"
    assert A.CONVERSATION_ID not in none.attributes  # no made-up fallback
    assert A.CONVERSATION_ID not in streamed.attributes


def test_output_type(tiny_smol, otel):
    exporter, _, providers = otel
    llm = ChatSpecDecode(pair=tiny_smol, max_tokens=4, **providers)
    llm.invoke("hi")
    llm.bind(response_format={"type": "json_object"}).invoke("hi")
    text, as_json = exporter.get_finished_spans()
    assert text.attributes[A.OUTPUT_TYPE] == "text" and as_json.attributes[A.OUTPUT_TYPE] == "json"
    # both are values the conventions define (what the spans carry, not our own constants)
    published = {v.value for v in GenAiOutputTypeValues}
    assert {text.attributes[A.OUTPUT_TYPE], as_json.attributes[A.OUTPUT_TYPE]} <= published, published


def test_response_id_is_the_replys(tiny_smol, otel):
    exporter, _, providers = otel
    llm = ChatSpecDecode(pair=tiny_smol, max_tokens=4, **providers)
    invoked = llm.invoke("hi")
    streamed = _joined(list(llm.stream("hi")))
    spans = exporter.get_finished_spans()
    ids = [r.response_metadata["id"] for r in (invoked, streamed)]
    assert [s.attributes[A.RESPONSE_ID] for s in spans] == ids
    assert all(i.startswith("chatcmpl-") for i in ids) and ids[0] != ids[1]


def test_request_stream_set_only_when_streaming(tiny_smol, otel):
    exporter, _, providers = otel
    llm = ChatSpecDecode(pair=tiny_smol, max_tokens=3, **providers)
    llm.invoke("hi")
    list(llm.stream("hi"))
    invoked, streamed = exporter.get_finished_spans()
    assert A.REQUEST_STREAM not in invoked.attributes and streamed.attributes[A.REQUEST_STREAM] is True
    assert A.RESPONSE_TIME_TO_FIRST_CHUNK not in invoked.attributes
    duration = (streamed.end_time - streamed.start_time) / 1e9
    assert 0 < streamed.attributes[A.RESPONSE_TIME_TO_FIRST_CHUNK] <= duration


def test_cache_creation_on_two_turns(tiny_smol, otel):
    exporter, _, providers = otel
    llm = ChatSpecDecode(pair=tiny_smol, max_tokens=5, prefix_cache=64 << 20, **providers)  # its own cache
    turn = [HumanMessage("The prefix cache keeps this sentence between the calls of a conversation.")]
    first = llm.invoke(turn)
    second = llm.invoke([*turn, AIMessage("ok"), HumanMessage("And then?")])
    llm.invoke([*turn, AIMessage("ok"), HumanMessage("And then?")])  # the same prompt again
    spans = [s.attributes for s in exporter.get_finished_spans()]
    assert spans[0][A.USAGE_CACHE_CREATION_INPUT_TOKENS] == spans[0][A.USAGE_INPUT_TOKENS]  # all new
    assert spans[0][A.USAGE_CACHE_READ_INPUT_TOKENS] == 0
    # the second turn reads the first turn's prompt and writes the rest, none of it twice
    read, written = spans[1][A.USAGE_CACHE_READ_INPUT_TOKENS], spans[1][A.USAGE_CACHE_CREATION_INPUT_TOKENS]
    assert read > 0 and written > 0 and read + written == spans[1][A.USAGE_INPUT_TOKENS], spans[1]
    assert spans[2][A.USAGE_CACHE_CREATION_INPUT_TOKENS] == 0
    assert first.usage_metadata["input_tokens"] == spans[0][A.USAGE_INPUT_TOKENS]
    assert second.usage_metadata["input_tokens"] == spans[1][A.USAGE_INPUT_TOKENS]


def _conversation():
    return [
        SystemMessage("You tell the time."),
        HumanMessage("What time is it?"),
        AIMessage("", tool_calls=[{"name": "now", "args": {}, "id": "call_a"}]),
        ToolMessage("12:00", tool_call_id="call_a"),
        HumanMessage("And now?"),
    ]


def test_content_is_not_captured_by_default(tiny_smol, otel):
    exporter, _, providers = otel
    llm = WholeCall(pair=tiny_smol, max_tokens=20, prefix_cache=False, **providers)
    llm.bind_tools([now], tool_choice="now").invoke(_conversation())
    (span,) = exporter.get_finished_spans()
    assert not [name for name in CONTENT if name in span.attributes]


def test_content_captured_with_the_env_var(tiny_smol, otel, monkeypatch):
    exporter, _, providers = otel
    monkeypatch.setenv(A.ENV_CAPTURE_CONTENT, "true")  # read at call time: the model was built before
    llm = WholeCall(pair=tiny_smol, max_tokens=20, prefix_cache=False, **providers)
    reply = llm.bind_tools([now], tool_choice="now").invoke(_conversation())
    text = ChatSpecDecode(pair=tiny_smol, max_tokens=4, **providers).invoke("Say hi.")
    call_span, text_span = (s.attributes for s in exporter.get_finished_spans())
    assert json.loads(call_span[A.SYSTEM_INSTRUCTIONS]) == [{"type": "text", "content": "You tell the time."}]
    assert json.loads(call_span[A.INPUT_MESSAGES]) == [
        {"role": "user", "parts": [{"type": "text", "content": "What time is it?"}]},
        {
            "role": "assistant",
            "parts": [{"type": "tool_call", "id": "call_a", "name": "now", "arguments": {}}],
        },
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_a", "response": "12:00"}]},
        {"role": "user", "parts": [{"type": "text", "content": "And now?"}]},
    ]
    (definition,) = json.loads(call_span[A.TOOL_DEFINITIONS])
    assert definition["type"] == "function" and definition["name"] == "now"
    assert definition["description"] == "The current time." and "parameters" in definition
    (call,) = reply.tool_calls
    assert json.loads(call_span[A.OUTPUT_MESSAGES]) == [
        {
            "role": "assistant",
            "parts": [{"type": "tool_call", "id": call["id"], "name": "now", "arguments": {}}],
            "finish_reason": "stop",
        }
    ]
    (message,) = json.loads(text_span[A.OUTPUT_MESSAGES])
    assert message["parts"] == ([{"type": "text", "content": text.content}] if text.content else [])
    assert message["finish_reason"] == text.response_metadata["finish_reason"]
    assert A.SYSTEM_INSTRUCTIONS not in text_span and A.TOOL_DEFINITIONS not in text_span


def test_capture_content_on_the_telemetry_overrides_the_env_var(tiny_smol, otel, monkeypatch):
    exporter, _, providers = otel
    monkeypatch.setenv(A.ENV_CAPTURE_CONTENT, "true")
    request = agentspec.chat.prepare(tiny_smol.tokenizer, [{"role": "user", "content": "hi"}])
    for capture in (False, True):
        call = Telemetry(providers["tracer_provider"], capture_content=capture).call(
            CallInfo("m", None, request=request)
        )
        steps = run(tiny_smol, request.prompt.ids, "none", max_new_tokens=2)
        text = "".join(step.text for step in steps)
        call.reply(text, [])
        call.end(steps.close())
    off, on = exporter.get_finished_spans()
    assert not [name for name in CONTENT if name in off.attributes]
    assert json.loads(on.attributes[A.INPUT_MESSAGES]) == [
        {"role": "user", "parts": [{"type": "text", "content": "hi"}]}
    ]
    assert json.loads(on.attributes[A.OUTPUT_MESSAGES])[0]["parts"] == (
        [{"type": "text", "content": text}] if text else []
    )


def test_draft_metric_names_only_under_the_opt_in(tiny_smol, otel, monkeypatch):
    exporter, reader, providers = otel
    llm = ChatSpecDecode(pair=tiny_smol, max_tokens=4, **providers)
    llm.invoke("hi")
    published = _points(reader)
    assert not DRAFT_METRICS & set(published)
    assert {A.METRIC_OPERATION_DURATION, A.METRIC_TOKEN_USAGE} <= set(published)

    monkeypatch.setenv(A.ENV_STABILITY_OPT_IN, "http,gen_ai_latest_experimental")
    invoked = llm.invoke("hi")
    streamed = _joined(list(llm.stream("hi")))
    points = _points(reader)
    assert set(points) >= DRAFT_METRICS, DRAFT_METRICS - set(points)
    (duration,) = points[A.METRIC_OPERATION_DURATION]
    assert duration.count == 1  # the first call only: the draft's name replaced it since
    assert [p.count for p in points[A.METRIC_TOKEN_USAGE]] == [1, 1]  # input, output: the first call
    (inference,) = points[A.METRIC_INFERENCE_DURATION]
    assert inference.count == 2
    (first_chunk,) = points[A.METRIC_INFERENCE_TIME_TO_FIRST_CHUNK]
    assert first_chunk.count == 1  # streamed calls only
    (inputs,) = points[A.METRIC_USAGE_INPUT_TOKENS]
    assert inputs.attributes[A.TOKEN_MODALITY] == "text"
    assert inputs.value == invoked.usage_metadata["input_tokens"] + streamed.usage_metadata["input_tokens"]
    (outputs,) = points[A.METRIC_INFERENCE_OUTPUT_TOKENS]
    assert outputs.sum == invoked.usage_metadata["output_tokens"] + streamed.usage_metadata["output_tokens"]
    spans = exporter.get_finished_spans()
    assert A.USAGE_CACHE_CREATION_INPUT_TOKENS in spans[0].attributes
    for span in spans[1:]:
        assert A.USAGE_CACHE_WRITE_INPUT_TOKENS in span.attributes
        assert A.USAGE_CACHE_CREATION_INPUT_TOKENS not in span.attributes


@pytest.mark.model
def test_create_agent_run_carries_the_thread_id(otel):
    """A real agent with a checkpointer: every chat span of the run names its thread."""
    from langchain.agents import create_agent
    from langgraph.checkpoint.memory import InMemorySaver

    exporter, _, providers = otel
    llm = ChatSpecDecode(pair=agentspec.load_pair(), max_tokens=8, **providers)
    agent = create_agent(llm, tools=[now], checkpointer=InMemorySaver())
    config = {"configurable": {"thread_id": "t-1"}}
    agent.invoke({"messages": [HumanMessage("Say hello.")]}, config=config)
    first_turn = len(exporter.get_finished_spans())
    # the same thread, streamed as a LangGraph app streams tokens: the model streams, with its run manager
    events = list(agent.stream({"messages": [HumanMessage("Once more.")]}, config, stream_mode="messages"))
    assert events
    state = agent.get_state(config).values["messages"]
    assert [type(m).__name__ for m in state][:2] == ["HumanMessage", "AIMessage"]  # the first turn, kept
    spans = exporter.get_finished_spans()
    assert first_turn >= 1 and first_turn < len(spans) and all(s.name.startswith("chat ") for s in spans)
    assert [s.attributes[A.CONVERSATION_ID] for s in spans] == ["t-1"] * len(spans)
    assert spans[-1].attributes[A.REQUEST_STREAM] is True and A.REQUEST_STREAM not in spans[0].attributes
    # the second turn reads the first turn's prompt from the prefix cache and writes only the rest
    last = spans[-1].attributes
    assert last[A.USAGE_CACHE_READ_INPUT_TOKENS] > 0
    assert last[A.USAGE_CACHE_CREATION_INPUT_TOKENS] < last[A.USAGE_INPUT_TOKENS]
