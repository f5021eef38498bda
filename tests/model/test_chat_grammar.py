"""Grammar-constrained tool calls and structured output through ChatSpecDecode, on the real model.

Unconstrained, SmolLM2-135M-Instruct answers "What is 7 times 8?" in prose, or copies a tool's JSON
schema instead of writing argument values. Under the grammar every forced call names a bound tool
and its arguments validate; the model itself picks the tool and the values. Greedy, so each run is
the same; speculation and jump-forward must not change a token.
"""

from __future__ import annotations

import pytest
from langchain.agents import create_agent
from langchain.agents.middleware import AgentMiddleware
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

import agentspec
from agentspec.grammar import GrammarError
from benchmarks.workloads import PROMPTS, STRUCTURED, TOOLS, City, multiply
from langchain_agentspec import ChatSpecDecode

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def smol_pair():
    return agentspec.load_pair()


BY_NAME = {t.name: t for t in TOOLS}


def test_forced_calls_are_always_valid(smol_pair):
    llm = ChatSpecDecode(pair=smol_pair, max_tokens=64)
    bound = llm.bind_tools(TOOLS, tool_choice="any", parallel_tool_calls=False)
    right = 0
    for prompt, expected in PROMPTS:
        m = bound.invoke(prompt)
        assert not m.invalid_tool_calls, (prompt, m.invalid_tool_calls)
        assert len(m.tool_calls) == 1, (prompt, m)
        call = m.tool_calls[0]
        BY_NAME[call["name"]].args_schema.model_validate(call["args"])  # raises if invalid
        assert m.response_metadata["finish_reason"] == "stop"
        right += call["name"] == expected
    # the model's own choice of tool, greedy: measured 14/20 (the grammar makes every call valid;
    # which tool fits is the 135M model's judgement). The bound catches a grammar that skews it.
    assert right >= 12, right


def test_named_tool_and_plain_baseline_agree(smol_pair):
    fast = ChatSpecDecode(pair=smol_pair, max_tokens=48).bind_tools(TOOLS, tool_choice="multiply")
    plain = ChatSpecDecode(pair=smol_pair, max_tokens=48, speculative=False, prefix_cache=False)
    plain = plain.bind_tools(TOOLS, tool_choice="multiply")
    a, b = fast.invoke("What is 14 times 3?"), plain.invoke("What is 14 times 3?")
    assert [c["args"] for c in a.tool_calls] == [c["args"] for c in b.tool_calls] == [{"a": 14, "b": 3}]
    sa, sb = a.response_metadata["stats"], b.response_metadata["stats"]
    assert sb["forced_tokens"] == 0 and sb["draft_tokens"] == 0  # the baseline has no jump-forward
    assert sa["forced_tokens"] > 0 and sa["verify_steps"] < sb["verify_steps"]


def test_stream_and_invoke_give_the_same_calls(smol_pair):
    bound = ChatSpecDecode(pair=smol_pair, max_tokens=48).bind_tools(TOOLS, tool_choice="any")
    whole = bound.invoke("How many letters are in the word banana?")
    chunks = list(bound.stream("How many letters are in the word banana?"))
    merged = chunks[0]
    for c in chunks[1:]:
        merged += c
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [
        (c["name"], c["args"]) for c in whole.tool_calls
    ]
    assert "<tool_call>" not in "".join(c.content for c in chunks)


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_always_validates(smol_pair, method):
    llm = ChatSpecDecode(pair=smol_pair, max_tokens=96)
    for schema, text in STRUCTURED:
        result = llm.with_structured_output(schema, method=method).invoke(text)
        assert isinstance(result, schema), (method, text, result)


def test_structured_output_dict_schema_and_include_raw(smol_pair):
    schema = {
        "title": "Weather",
        "description": "A weather report.",
        "type": "object",
        "properties": {"city": {"type": "string"}, "celsius": {"type": "integer"}},
        "required": ["city", "celsius"],
    }
    llm = ChatSpecDecode(pair=smol_pair, max_tokens=64)
    out = llm.with_structured_output(schema, include_raw=True).invoke("It is 18 degrees in Rome.")
    assert out["parsing_error"] is None and isinstance(out["raw"], AIMessage)
    assert set(out["parsed"]) == {"city", "celsius"} and isinstance(out["parsed"]["celsius"], int)


def test_response_format_from_create_agent(smol_pair):
    """create_agent's provider strategy binds ``response_format``: the answer is constrained."""
    agent = create_agent(ChatSpecDecode(pair=smol_pair, max_tokens=64), tools=[], response_format=City)
    out = agent.invoke({"messages": [HumanMessage("Rome is in Italy.")]})
    assert isinstance(out["structured_response"], City)


def test_bad_schemas_fail_at_bind_time(smol_pair):
    llm = ChatSpecDecode(pair=smol_pair)
    broken = {
        "type": "function",
        "function": {
            "name": "broken",
            "description": "A tool whose schema points nowhere.",
            "parameters": {"type": "object", "properties": {"x": {"$ref": "#/$defs/Nowhere"}}},
        },
    }
    with pytest.raises(GrammarError, match="'broken'"):
        llm.bind_tools([multiply, broken], tool_choice="any")
    with pytest.raises(ValueError, match="response_format"):
        llm.bind(response_format={"type": "xml"}).invoke("Hi")
    with pytest.raises(GrammarError):
        llm.with_structured_output({"title": "T", "type": "object", "properties": {"x": {"$ref": "#/no"}}})
    # unconstrained, the same tool binds (its output is then only parsed)
    ChatSpecDecode(pair=smol_pair, constrained=False).bind_tools([broken], tool_choice="any")


class FirstCallUsesTools(AgentMiddleware):
    """The first model call of a task must make one tool call (the model picks the tool and its
    arguments); the next one answers. A common agent pattern for small models."""

    def wrap_model_call(self, request, handler):
        if any(isinstance(m, ToolMessage) for m in request.messages):
            return handler(request.override(tool_choice="none"))
        settings = {**request.model_settings, "parallel_tool_calls": False}
        return handler(request.override(tool_choice="any", model_settings=settings))


def test_agent_loop_where_the_model_chooses_and_calls(smol_pair):
    llm = ChatSpecDecode(pair=smol_pair, max_tokens=48)
    agent = create_agent(llm, tools=TOOLS, middleware=[FirstCallUsesTools()])
    for question, tool_name, result in [
        ("What is 7 times 8?", "multiply", "56"),
        ("How many letters are in the word banana?", "word_length", "6"),
    ]:
        messages = agent.invoke({"messages": [HumanMessage(question)]})["messages"]
        kinds = [type(m).__name__ for m in messages]
        assert kinds == ["HumanMessage", "AIMessage", "ToolMessage", "AIMessage"], kinds
        assert messages[1].tool_calls[0]["name"] == tool_name
        assert messages[2].content == result  # the real tool ran on the model's own arguments
        assert messages[3].content and not messages[3].tool_calls
