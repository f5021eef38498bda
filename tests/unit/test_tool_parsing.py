"""Tool-call parsing on a table of model outputs (no model, no tokenizer).

Each row: what the model wrote, then the expected content, valid calls (name, args) and invalid
calls (name, start of the error). Streaming must agree with one-shot parsing however the text is cut.
"""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessageChunk
from langchain_core.messages.tool import tool_call_chunk

from langchain_agentspec.tool_parsing import ParsedOutput, ToolCallSplitter, collect, parse_tool_calls

NAMES = {"get_weather", "add"}
JOKE = '{"setup": "Why?", "punchline": "Because."}'

TABLE = [
    # plain answer, no markup
    ("plain", "It is sunny in Paris.", "It is sunny in Paris.", [], []),
    # Hermes / Qwen2.5: one block, newlines inside the tags
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
        "",
        [("get_weather", {"city": "Paris"})],
        [],
    ),
    # several blocks; whitespace between them is dropped
    (
        "several",
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
        "",
        [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Oslo"})],
        [],
    ),
    # text before the call is content (the whitespace before the tag is not)
    (
        "text_before",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Rome"})],
        [],
    ),
    # broken JSON: an invalid call, never an exception; the name is read off when possible
    (
        "broken_json",
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": }\n</tool_call>',
        "",
        [],
        [("add", "tool call is not valid JSON")],
    ),
    # a tool that was not bound
    (
        "unknown_tool",
        '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>',
        "",
        [],
        [("launch_rocket", "unknown tool 'launch_rocket'")],
    ),
    # unterminated tag with complete JSON (the model stopped before the closing tag): accepted
    (
        "unterminated_complete",
        '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}',
        "",
        [("add", {"a": 2, "b": 3})],
        [],
    ),
    # unterminated tag with cut JSON (ran out of tokens): invalid
    (
        "unterminated_cut",
        'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 2,',
        "Sure.",
        [],
        [("add", "unterminated <tool_call> block")],
    ),
    # SmolLM2: a JSON list inside the tags
    (
        "smollm2_list",
        '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 1}}, '
        '{"name": "get_weather", "arguments": {"city": "Lima"}}]</tool_call>',
        "",
        [("add", {"a": 1, "b": 1}), ("get_weather", {"city": "Lima"})],
        [],
    ),
    # SmolLM2 list with one unknown tool: the good call survives
    (
        "smollm2_list_mixed",
        '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 1}}, {"name": "nope", "arguments": {}}]'
        "</tool_call>",
        "",
        [("add", {"a": 1, "b": 1})],
        [("nope", "unknown tool 'nope'")],
    ),
    # Llama 3: bare JSON with "parameters"
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", {"city": "Paris"})],
        [],
    ),
    # Llama 3: several calls joined by ";" after <|python_tag|>
    (
        "llama3_python_tag",
        '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
        '{"name": "get_weather", "arguments": {"city": "Bern"}}',
        "",
        [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Bern"})],
        [],
    ),
    # bare JSON that is not a call to a bound tool is an answer, not a call
    (
        "json_answer",
        '{"setup": "Why?", "punchline": "Because."}',
        '{"setup": "Why?", "punchline": "Because."}',
        [],
        [],
    ),
    # OpenAI style: arguments as a JSON string
    (
        "string_arguments",
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 4, \\"b\\": 5}"}</tool_call>',
        "",
        [("add", {"a": 4, "b": 5})],
        [],
    ),
    # no arguments at all: an empty dict
    ("no_arguments", '<tool_call>{"name": "get_weather"}</tool_call>', "", [("get_weather", {})], []),
    # arguments that are not an object
    (
        "scalar_arguments",
        '<tool_call>{"name": "add", "arguments": 3}</tool_call>',
        "",
        [],
        [("add", "arguments must be a JSON object")],
    ),
    # text after a call stays content
    (
        "text_after",
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>\nDone.',
        "Done.",
        [("add", {"a": 1, "b": 1})],
        [],
    ),
    # a '<' that never becomes a tag is released as text
    ("angle_bracket", "1 < 2 and <b>bold</b>", "1 < 2 and <b>bold</b>", [], []),
]

ROWS = pytest.mark.parametrize(
    ("text", "content", "calls", "invalid"), [r[1:] for r in TABLE], ids=[r[0] for r in TABLE]
)


def _check(out: ParsedOutput, content, calls, invalid) -> None:
    assert out.content == content, f"{out.content=} {content=}"
    got = [(c["name"], c["args"]) for c in out.tool_calls]
    assert got == calls, f"{got=} {calls=}"
    got_invalid = [(c["name"], c["error"]) for c in out.invalid_tool_calls]
    assert len(got_invalid) == len(invalid), f"{got_invalid=} {invalid=}"
    for (name, error), (want_name, want_error) in zip(got_invalid, invalid):
        assert name == want_name and error.startswith(want_error), f"{name=} {error=} {want_error=}"
    for c in [*out.tool_calls, *out.invalid_tool_calls]:
        assert c["id"] and c["id"].startswith("call_"), c


@pytest.mark.parametrize(
    ("text", "content", "calls", "invalid"), [r[1:] for r in TABLE], ids=[r[0] for r in TABLE]
)
def test_parse_table(text, content, calls, invalid):
    _check(parse_tool_calls(text, NAMES), content, calls, invalid)


@pytest.mark.parametrize(
    ("text", "content", "calls", "invalid"), [r[1:] for r in TABLE], ids=[r[0] for r in TABLE]
)
@pytest.mark.parametrize("size", [1, 3, 7])
def test_streaming_agrees_with_one_shot(text, content, calls, invalid, size):
    splitter = ToolCallSplitter(NAMES)
    out = ParsedOutput("")
    released = []
    for i in range(0, len(text), size):
        events = splitter.feed(text[i : i + size])
        released += [v for k, v in events if k == "text"]
        collect(events, out)
    collect(splitter.finish(), out)
    _check(out, content, calls, invalid)
    assert "<tool_call" not in "".join(released), f"markup leaked as text: {released=}"


def test_unique_ids():
    out = parse_tool_calls('<tool_call>[{"name": "add"}, {"name": "add"}, {"name": "x"}]</tool_call>', NAMES)
    ids = [c["id"] for c in [*out.tool_calls, *out.invalid_tool_calls]]
    assert len(set(ids)) == 3, ids


def test_names_none_accepts_any_tool():
    out = parse_tool_calls('<tool_call>{"name": "anything", "arguments": {}}</tool_call>', None)
    assert [c["name"] for c in out.tool_calls] == ["anything"]


def test_invalid_calls_stay_invalid_through_chunk_merging():
    """LangChain re-parses streamed args leniently; an invalid call's args must not parse back."""
    for text in [
        '<tool_call>{"name": "add", "arguments": {"a": 1,',  # cut: partial JSON would "repair"
        '<tool_call>{"name": "nope", "arguments": {"a": 1}}</tool_call>',  # valid JSON, unknown tool
    ]:
        bad = parse_tool_calls(text, NAMES).invalid_tool_calls[0]
        chunk = AIMessageChunk(
            content="",
            tool_call_chunks=[tool_call_chunk(name=bad["name"], args=bad["args"], id=bad["id"], index=0)],
        )
        merged = chunk + AIMessageChunk(content="", chunk_position="last")
        assert merged.tool_calls == [], merged.tool_calls
        assert [c["id"] for c in merged.invalid_tool_calls] == [bad["id"]]


def test_stream_releases_text_early():
    splitter = ToolCallSplitter(NAMES)
    assert splitter.feed("Hello ") == [("text", "Hello")]  # the space waits: a call may follow
    assert splitter.feed("world <tool") == [("text", " world")]  # "<tool" may be a tag
    assert splitter.feed("_call>") == []


def test_a_block_cut_inside_its_closing_tag_keeps_its_complete_call():
    for cut in ["\n</tool_call", "\n</tool_", "\n</", "\n<", "\n"]:
        out = parse_tool_calls('<tool_call>\n{"name": "square", "arguments": {"x": 3}}' + cut, {"square"})
        assert [(c["name"], c["args"]) for c in out.tool_calls] == [("square", {"x": 3})], cut
    out = parse_tool_calls('<tool_call>\n{"name": "square", "arguments": {"x": 3', {"square"})
    assert not out.tool_calls and out.invalid_tool_calls  # the JSON itself is cut: invalid


def test_a_reply_cut_inside_the_next_calls_opening_tag_has_no_markup_in_its_content():
    call = '<tool_call>\n{"name": "square", "arguments": {"x": 3}}\n</tool_call>'
    for cut in ["\n<tool_call", "\n<tool", "\n<", " <tool_ca"]:
        out = parse_tool_calls(call + cut, {"square"})
        assert out.content == "" and not out.invalid_tool_calls, (cut, out)
        assert [(c["name"], c["args"]) for c in out.tool_calls] == [("square", {"x": 3})], cut
    # text after a call that is not a tag prefix stays content
    assert parse_tool_calls(call + "\nDone <3", {"square"}).content == "Done <3"
