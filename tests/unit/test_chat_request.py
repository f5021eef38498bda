"""The framework-free request layer (``agentspec.chat``) on OpenAI-format dicts, as a server gets them.

Hand-written messages rendered with the embedded model's tokenizer (no weights), hand-written model
outputs parsed into OpenAI-format tool calls, and what ``prepare`` makes of tools, ``tool_choice``
and ``response_format``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from agentspec import chat
from agentspec.chat import ToolCallSplitter

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {}}}
BROKEN = {"name": "add", "arguments": "{"}  # arguments cut short
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from agentspec.models import ensure_default_model

    return AutoTokenizer.from_pretrained(str(ensure_default_model()))


@pytest.mark.model
def test_a_tool_turn_renders_in_the_fallback_form(tokenizer):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "2 + 3?"}]},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    prompt = chat.render(tokenizer, messages, [ADD])
    assert prompt.text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n"), prompt.text[:80]
    assert json.dumps(ADD) in prompt.text
    assert "<|im_start|>user\n2 + 3?<|im_end|>" in prompt.text
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in prompt.text
    assert "<|im_start|>tool\n<tool_response>\n5\n</tool_response><|im_end|>" in prompt.text
    assert prompt.text.endswith("<|im_start|>assistant\n") and prompt.forced == ""
    assert tokenizer.decode(prompt.ids) == prompt.text


@pytest.mark.model
def test_plain_chat_renders_as_the_template_does(tokenizer):
    messages = [{"role": "user", "content": "hi"}]
    want = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat.render(tokenizer, messages).text == want


@pytest.mark.model
@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "x", "content": "1"}], "'x'"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "'image_url'"),
        ([{"role": "user", "content": "bad \udcff"}], "not valid Unicode"),
        ([{"content": "no role"}], "'role'"),
        ([{"role": "assistant", "content": "", "tool_calls": [{**CALL, "function": BROKEN}]}], "not JSON"),
    ],
    ids=["unanswered tool id", "image part", "lone surrogate", "no role", "arguments not JSON"],
)
def test_bad_messages_are_refused_by_name(tokenizer, messages, match):
    with pytest.raises(ValueError, match=match):
        chat.render(tokenizer, messages)


@pytest.mark.model
def test_prepare_a_required_call(tokenizer):
    user = [{"role": "user", "content": "2 + 3?"}]
    named = chat.prepare(tokenizer, user, [ADD, NOW], {"type": "function", "function": {"name": "add"}})
    assert named.single and named.tool_names == {"add", "now"} and named.stop == ()
    assert named.grammar is not None and named.prompt.forced == ""  # the grammar forces the call
    # unconstrained, the call's start is written into the prompt instead
    free = chat.prepare(tokenizer, user, [ADD, NOW], "required", constrained=False)
    assert free.grammar is None and not free.single
    assert free.prompt.forced == '<tool_call>\n{"name": "' and free.prompt.text.endswith(free.prompt.forced)
    none = chat.prepare(tokenizer, user, [ADD], "none")
    assert none.tool_names is None and none.stop == ("<tool_call>",) and none.grammar is None
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    response_format = {"type": "json_schema", "json_schema": {"schema": schema}}
    answer = chat.prepare(tokenizer, user, response_format=response_format)
    assert answer.grammar is not None and answer.tool_names is None
    with pytest.raises(ValueError, match="cube"):
        chat.prepare(tokenizer, user, [ADD], "cube")


def test_parse_reply_gives_openai_calls():
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
    text += '<tool_call>{"name": "x"}'  # unterminated, and not a bound tool
    reply = chat.parse_reply(text, {"add"})
    assert reply.content == "Sure."
    (call,) = reply.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    (bad,) = reply.invalid_tool_calls
    assert bad["function"] == {"name": "x", "arguments": '<tool_call>{"name": "x"}'}, bad
    assert bad["error"].startswith("unknown tool 'x'"), bad


def test_bare_json_is_a_call_only_when_it_calls_a_bound_tool():
    assert chat.parse_reply('{"name": "add", "parameters": {"a": 1}}', {"add"}).tool_calls
    answer = chat.parse_reply('{"setup": "Why?"}', {"add"})
    assert answer == ('{"setup": "Why?"}', [], [])


def test_the_splitter_holds_back_what_may_be_markup():
    splitter = ToolCallSplitter({"add"})
    assert splitter.feed("Hello ") == [("text", "Hello")]
    assert splitter.feed("<tool") == []
    events = splitter.feed('_call>{"name": "add", "arguments": {}}</tool_call>') + splitter.finish()
    assert [kind for kind, _ in events] == ["call"], events


def test_reply_parser_stops_after_the_one_wanted_call():
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    prompt = chat.Prompt(text="", ids=[], forced="", tool_format="hermes", native_tools=False)
    request = chat.PreparedRequest(prompt, None, frozenset({"add"}), single=True, stop=())
    parser = chat.ReplyParser(request)
    assert parser.feed(call[:20]) == [] and not parser.complete
    events = parser.feed(call[20:] + call)  # a second call after the wanted one is dropped
    assert [kind for kind, _ in events] == ["call"] and parser.complete
    assert parser.finish() == []


def test_no_langchain_and_no_trainer_at_import():
    code = (
        "import sys, agentspec, agentspec.chat, agentspec.models;"
        "bad = [m for m in sys.modules if m.startswith(('langchain', 'agentspec.distill', 'integrations'))];"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
