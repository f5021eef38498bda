"""Malformed input to ChatSpecDecode, table-driven: a clear error naming the problem (or the
documented behaviour), and the next valid call answers as a fresh model does."""

from __future__ import annotations

import copy
import dataclasses

import pytest
from langchain_core.messages import (
    AIMessage,
    ChatMessage,
    HumanMessage,
    RemoveMessage,
    SystemMessage,
    ToolMessage,
)
from pydantic import ValidationError

import agentspec
from agentspec.grammar import GrammarError
from langchain_agentspec.chat_model import ChatSpecDecode
from langchain_agentspec.messages import render

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_thread")]

VALID = [HumanMessage("Say hello.")]
MAX = 6


@pytest.fixture(scope="module")
def pair():
    return agentspec.load_pair()


@pytest.fixture(scope="module")
def llm(pair):
    return ChatSpecDecode(pair=pair, max_tokens=MAX)


@pytest.fixture(scope="module")
def fresh_answer(pair) -> str:
    """What plain decoding on a model that saw nothing else answers to VALID."""
    ids = render(pair.tokenizer, VALID).ids
    return agentspec.generate(pair, ids, max_new_tokens=MAX, speculative=False, prefix_cache=False).text


def square(x: int) -> int:
    """Square x."""
    return x * x


def _tool(name=None, parameters=None):
    function = {"description": "d", "parameters": parameters or {"type": "object", "properties": {}}}
    if name is not None:
        function["name"] = name
    return {"type": "function", "function": function}


CALL = {"name": "square", "args": {"x": 3}, "id": "call_1"}


def inv(*args, **kwargs):
    return lambda m: m.invoke(*args, **kwargs)


def bind(*args, **kwargs):
    return lambda m: m.bind_tools(*args, **kwargs)


def human(content):
    return [HumanMessage(content=content)]


# (id, call(llm), exception type, regex the message must match)
BAD = [
    ("empty message list", inv([]), ValueError, "empty conversation"),
    ("None input", inv(None), ValueError, "Invalid input type"),
    ("an int as input", inv(5), ValueError, "Invalid input type"),
    ("unknown role in a tuple", inv([("wizard", "hi")]), ValueError, "wizard"),
    ("None content", lambda m: m.invoke(human(None)), ValidationError, "content"),  # LangChain's own check
    ("bytes content", lambda m: m.invoke(human([b"\xff\xfe"])), ValidationError, "content"),
    (
        "an image block",
        inv([HumanMessage(content=[{"type": "image_url", "image_url": {"url": "http://x/a.png"}}])]),
        ValueError,
        "'image_url' block; ChatSpecDecode takes text only",
    ),
    (
        "an audio block",
        inv([HumanMessage(content=[{"type": "audio", "base64": "AAAA", "mime_type": "audio/wav"}])]),
        ValueError,
        "'audio' block",
    ),
    (
        "a content block of unknown type",
        inv([HumanMessage(content=[{"type": "hologram", "x": 1}])]),
        ValueError,
        "unknown type 'hologram'",
    ),
    ("a lone surrogate (not UTF-8)", inv("bad \udcff text"), ValueError, "not valid Unicode"),
    (
        "a ToolMessage answering no call",
        inv([HumanMessage("hi"), ToolMessage("42", tool_call_id="nope")]),
        ValueError,
        "tool call id 'nope'",
    ),
    (
        "a ToolMessage before its call",
        inv([HumanMessage("hi"), ToolMessage("9", tool_call_id="call_1"), AIMessage("", tool_calls=[CALL])]),
        ValueError,
        "tool call id 'call_1'",
    ),
    ("a RemoveMessage", inv([RemoveMessage(id="1")]), ValueError, "unsupported message type"),
    (
        "tool parameters not a JSON schema",
        bind([{"name": "f", "description": "d", "parameters": "not a schema"}]),
        GrammarError,
        "tool 'f'",
    ),
    (
        "tool parameters of an unknown type",
        bind([_tool("f", {"type": "banana"})]),
        GrammarError,
        "banana",
    ),
    ("a tool without a name", bind([_tool()]), ValueError, "tool 0 has no name"),
    ("a tool with an empty name", bind([_tool("")]), ValueError, "has no name"),
    (
        "tool_choice naming no bound tool",
        bind([square], tool_choice="cube"),
        ValueError,
        "cube",
    ),
    (
        "tool_choice any with no tools",
        bind([], tool_choice="any"),
        ValueError,
        "at least one tool",
    ),
    ("a stop list with an empty string", inv(VALID, stop=[""]), ValueError, "empty strings"),
    (
        "a stop list with None",
        inv(VALID, stop=[None]),
        TypeError,
        "stop sequence must be a string",
    ),
    ("max_tokens 0", inv(VALID, max_tokens=0), ValueError, "max_new_tokens must be >= 1"),
    ("max_tokens negative", inv(VALID, max_tokens=-5), ValueError, "max_new_tokens"),
    (
        "max_tokens a float",
        inv(VALID, max_tokens=2.5),
        TypeError,
        "max_new_tokens must be an int",
    ),
    ("temperature negative", inv(VALID, temperature=-1), ValueError, "temperature"),
    ("temperature NaN", inv(VALID, temperature=float("nan")), ValueError, "temperature"),
    ("temperature infinite", inv(VALID, temperature=float("inf")), ValueError, "temperature"),
    ("top_p 0", inv(VALID, top_p=0), ValueError, "top_p"),
    ("top_p above 1", inv(VALID, top_p=2), ValueError, "top_p"),
    ("top_k 0", inv(VALID, top_k=0), ValueError, "top_k"),
    ("a negative seed", inv(VALID, seed=-1), ValueError, "seed"),
    ("an unknown call argument", inv(VALID, frobnicate=True), TypeError, "frobnicate"),
    ("a prompt beyond the context", inv("word " * 9000), ValueError, "context is 8192"),
    (
        "a response format the engine refuses",
        lambda m: m.with_structured_output({"type": "banana"}).invoke(VALID),
        ValueError,
        "response_format",
    ),
    (
        "a structured output of None",
        lambda m: m.with_structured_output(None),
        ValueError,
        "Unsupported function",
    ),
]


@pytest.mark.parametrize(("call", "error", "match"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_is_refused_by_name(llm, fresh_answer, call, error, match):
    with pytest.raises(error, match=match):
        call(llm)
    assert llm.invoke(VALID).content == fresh_answer  # the next valid call: as on a fresh model


def test_the_corpus_is_large_enough():
    assert len(BAD) + len(ACCEPTED) >= 30


# inputs with a documented behaviour (README "In LangChain agents"): (id, call, check of the reply)
ACCEPTED = [
    ("an OpenAI-style dict message", inv([{"role": "user", "content": "hi"}]), None),
    ("text blocks", inv([HumanMessage(content=[{"type": "text", "text": "hi"}])]), None),
    (
        "another provider's reasoning block is skipped",
        inv([HumanMessage("hi"), AIMessage([{"type": "reasoning", "reasoning": "..."}, "Hi!"])]),
        None,
    ),
    ("only a system message", inv([SystemMessage("Be brief.")]), None),
    ("NUL characters are text", inv("a\x00b"), None),
    (
        "a ChatMessage role goes to the template as is",
        inv([ChatMessage(role="user", content="hi")]),
        None,
    ),
    (
        "max_tokens past the context is cut to the room left",
        inv(VALID, max_tokens=10**12),
        lambda r: r.response_metadata["finish_reason"] in ("stop", "length"),
    ),
    (
        "a tool result answering its call",
        inv(
            [
                HumanMessage("3 squared?"),
                AIMessage("", tool_calls=[CALL]),
                ToolMessage("9", tool_call_id="call_1"),
            ]
        ),
        None,
    ),
]


@pytest.mark.parametrize(("call", "check"), [c[1:] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_documented_inputs_are_answered(llm, fresh_answer, call, check):
    reply = call(llm)
    assert isinstance(reply.content, str) and (check is None or check(reply)), reply
    assert llm.invoke(VALID).content == fresh_answer


def test_a_tool_bound_twice_is_bound_once(llm, caplog):
    # LangChain's conformance tests bind a pydantic model and its JSON schema together: allowed
    bound = llm.bind_tools([square, square, {"name": "square", "description": "other", "parameters": {}}])
    assert [t["function"]["name"] for t in bound.kwargs["tools"]] == ["square"]
    assert bound.kwargs["tools"][0]["function"]["description"] == "Square x."  # the first definition
    assert "bound more than once" in caplog.text


def test_a_tokenizer_without_a_chat_template(pair):
    bare = copy.deepcopy(pair.tokenizer)
    bare.chat_template = None
    llm = ChatSpecDecode(pair=dataclasses.replace(pair, tokenizer=bare), max_tokens=MAX)
    with pytest.raises(ValueError, match="no chat template"):
        llm.invoke(VALID)
