"""The GenAI convention names and the pure functions of ``agentspec.telemetry.attributes``.

The published names are checked against ``opentelemetry-semantic-conventions``' constants (a typo
would otherwise pass every other test); the content shapes against hand-written OpenAI messages.
"""

from __future__ import annotations

import json

import pytest
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as G
from opentelemetry.semconv._incubating.metrics import gen_ai_metrics as GM

from agentspec.stats import DecodeStats
from agentspec.telemetry import attributes as A
from langchain_agentspec.conversation import conversation_id


@pytest.mark.parametrize(
    "ours, published",
    [
        (A.CONVERSATION_ID, G.GEN_AI_CONVERSATION_ID),
        (A.OUTPUT_TYPE, G.GEN_AI_OUTPUT_TYPE),
        (A.RESPONSE_ID, G.GEN_AI_RESPONSE_ID),
        (A.RESPONSE_TIME_TO_FIRST_CHUNK, G.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK),
        (A.REQUEST_STREAM, G.GEN_AI_REQUEST_STREAM),
        (A.USAGE_CACHE_CREATION_INPUT_TOKENS, G.GEN_AI_USAGE_CACHE_CREATION_INPUT_TOKENS),
        (A.USAGE_CACHE_READ_INPUT_TOKENS, G.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS),
        (A.INPUT_MESSAGES, G.GEN_AI_INPUT_MESSAGES),
        (A.OUTPUT_MESSAGES, G.GEN_AI_OUTPUT_MESSAGES),
        (A.SYSTEM_INSTRUCTIONS, G.GEN_AI_SYSTEM_INSTRUCTIONS),
        (A.TOOL_DEFINITIONS, G.GEN_AI_TOOL_DEFINITIONS),
        (A.OPERATION_NAME, G.GEN_AI_OPERATION_NAME),
        (A.PROVIDER_NAME, G.GEN_AI_PROVIDER_NAME),
        (A.TOKEN_TYPE, G.GEN_AI_TOKEN_TYPE),
        (A.METRIC_OPERATION_DURATION, GM.GEN_AI_CLIENT_OPERATION_DURATION),
        (A.METRIC_TOKEN_USAGE, GM.GEN_AI_CLIENT_TOKEN_USAGE),
        (A.METRIC_TIME_TO_FIRST_TOKEN, GM.GEN_AI_SERVER_TIME_TO_FIRST_TOKEN),
        (A.METRIC_TIME_PER_OUTPUT_TOKEN, GM.GEN_AI_SERVER_TIME_PER_OUTPUT_TOKEN),
    ],
)
def test_published_names(ours, published):
    assert ours == published


@pytest.mark.parametrize(
    "metadata, expected",
    [
        (None, None),
        ({}, None),
        ({"langgraph_step": 1}, None),
        ({"thread_id": "t-1"}, "t-1"),
        ({"thread_id": 7}, "7"),
        ({"conversation_id": "c", "thread_id": "t"}, "c"),
        ({"session_id": "s", "conversation_id": "c", "thread_id": "t"}, "s"),  # OpenInference's order
        ({"session_id": "", "thread_id": "t"}, "t"),
    ],
)
def test_conversation_id(metadata, expected):
    assert conversation_id(metadata) == expected


@pytest.mark.parametrize(
    "value, on",
    [(None, False), ("", False), ("false", False), ("NO_CONTENT", False), ("EVENT_ONLY", False)]
    + [("true", True), ("True", True), (" SPAN_ONLY ", True), ("span_and_event", True)],
)
def test_capture_content_switch(value, on):
    assert A.capture_content(value) is on


@pytest.mark.parametrize(
    "value, on",
    [(None, False), ("", False), ("http", False), ("gen_ai_latest_experimental", True)]
    + [("http/dup, gen_ai_latest_experimental", True), ("gen_ai_latest_experimentalx", False)],
)
def test_latest_experimental_switch(value, on):
    assert A.latest_experimental(value) is on


def test_request_stream_only_when_streaming():
    assert A.REQUEST_STREAM not in A.request_attributes("m", None, True, streamed=False)
    assert A.request_attributes("m", None, True, streamed=True)[A.REQUEST_STREAM] is True
    attrs = A.request_attributes("m", None, True, False, conversation_id="t-1", output_type="json")
    assert attrs[A.CONVERSATION_ID] == "t-1" and attrs[A.OUTPUT_TYPE] == "json"


def test_cache_writes_under_either_name():
    stats = DecodeStats(prompt_tokens=10, cached_tokens=4, cache_creation_tokens=6, finish_reason="stop")
    published = A.response_attributes("m", stats, "chatcmpl-1")
    assert published[A.USAGE_CACHE_CREATION_INPUT_TOKENS] == 6 and published[A.RESPONSE_ID] == "chatcmpl-1"
    assert A.USAGE_CACHE_WRITE_INPUT_TOKENS not in published
    draft = A.response_attributes("m", stats, latest=True)
    assert draft[A.USAGE_CACHE_WRITE_INPUT_TOKENS] == 6 and A.USAGE_CACHE_CREATION_INPUT_TOKENS not in draft
    assert A.RESPONSE_ID not in draft


WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}


def test_input_content_in_the_conventions_shapes():
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}],
        },
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rainy"},
        {"role": "assistant", "content": "Rainy."},
    ]
    attrs = A.input_content_attributes(messages, [WEATHER])
    assert json.loads(attrs[A.SYSTEM_INSTRUCTIONS]) == [{"type": "text", "content": "Be brief."}]
    assert json.loads(attrs[A.INPUT_MESSAGES]) == [
        {"role": "user", "parts": [{"type": "text", "content": "Weather in Paris?"}]},
        {
            "role": "assistant",
            "parts": [
                {"type": "tool_call", "id": "call_1", "name": "weather", "arguments": {"city": "Paris"}}
            ],
        },
        {"role": "tool", "parts": [{"type": "tool_call_response", "id": "call_1", "response": "rainy"}]},
        {"role": "assistant", "parts": [{"type": "text", "content": "Rainy."}]},
    ]
    assert json.loads(attrs[A.TOOL_DEFINITIONS]) == [
        {
            "type": "function",
            "name": "weather",
            **{k: WEATHER["function"][k] for k in ("description", "parameters")},
        }
    ]
    bare = A.input_content_attributes([{"role": "user", "content": "hi"}], [])
    assert set(bare) == {A.INPUT_MESSAGES}  # no system message, no tools: not recorded


def test_output_content_in_the_conventions_shape():
    invalid = {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": "{city"}}
    (message,) = json.loads(
        A.output_content_attributes("Let me see.", [CALL, invalid], "stop")[A.OUTPUT_MESSAGES]
    )
    assert message == {
        "role": "assistant",
        "parts": [
            {"type": "text", "content": "Let me see."},
            {"type": "tool_call", "id": "call_1", "name": "weather", "arguments": {"city": "Paris"}},
            {"type": "tool_call", "id": "call_2", "name": "weather", "arguments": "{city"},  # raw, as parsed
        ],
        "finish_reason": "stop",
    }
