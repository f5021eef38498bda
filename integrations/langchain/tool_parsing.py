"""Finding tool calls in model output: pure functions over text, no model, no tokenizer.

Formats recognised (vLLM's hermes and llama3_json parsers and SGLang's detectors are the references):

- Hermes / Qwen2.5: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or several
  blocks, usually with newlines inside the tags.
- SmolLM2: a JSON list of such objects inside the same tags.
- Llama 3.x: bare JSON ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``) as the whole
  output, optionally after ``<|python_tag|>``, possibly a list or several objects joined by ``;``.

Rules. Every call gets an id. A tagged block that does not parse, lacks a name, has non-object
arguments or names a tool that was not bound becomes an invalid tool call, never an exception; an
unterminated block at the end of the output (cut by max_tokens, possibly inside the closing tag)
is accepted if its JSON is complete, else invalid.
Bare JSON (no tag) is only a tool call when every object in it is a well-formed call to a bound
tool; anything else is an answer that happens to be JSON and stays text.

The ``args`` of an invalid tool call is the model's raw text for the call *with* its opening tag
(``<tool_call>...``). LangChain rebuilds a streamed message's tool calls from its chunks with a
lenient partial-JSON parser, which would turn raw arguments such as ``{"a": 1`` back into a valid
call; text that starts with ``<`` cannot parse, so an invalid call stays invalid after chunk merging
and ``invoke`` and ``stream`` agree.

``ToolCallSplitter`` is the incremental form used while streaming: it releases text as soon as it
cannot be the start of a tool call and returns each call once its block closes. ``parse_tool_calls``
runs it over a whole output, so the two can never disagree.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import InvalidToolCall, ToolCall
from langchain_core.messages.tool import invalid_tool_call, tool_call

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedOutput:
    content: str  # text outside tool-call markup
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)


def _invalid(name: Any, raw: str, error: str) -> InvalidToolCall:
    return invalid_tool_call(
        name=name if isinstance(name, str) else None, args=raw, id=new_call_id(), error=error
    )


def _call_from_object(obj: Any, raw: str, names: Collection[str] | None) -> ToolCall | InvalidToolCall:
    """One call from a decoded JSON object; ``raw`` is what an invalid call reports as its args."""
    if not isinstance(obj, dict):
        return _invalid(None, raw, f"expected a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return _invalid(None, raw, 'the call has no "name" string')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return _invalid(name, raw, f"arguments string is not valid JSON: {exc}")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return _invalid(name, raw, f"arguments must be a JSON object, got {type(args).__name__}")
    if names is not None and name not in names:
        bound = ", ".join(sorted(names)) or "none"
        return _invalid(name, raw, f"unknown tool {name!r}; bound tools: {bound}")
    return tool_call(name=name, args=args, id=new_call_id())


def parse_block(inner: str, names: Collection[str] | None, closed: bool = True) -> list:
    """Calls from the text between ``<tool_call>`` and ``</tool_call>`` (object or list of objects)."""
    raw = OPEN + inner + (CLOSE if closed else "")
    text = inner.strip()
    if not closed:  # cut by max_tokens inside the closing tag ("...}}\n</tool_"): the JSON may be whole
        text = next((text[: -len(p)].rstrip() for p in _close_prefixes() if text.endswith(p)), text)
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        why = "unterminated <tool_call> block" if not closed else "tool call is not valid JSON"
        return [_invalid(_guess_name(text), raw, f"{why}: {exc}")]
    if isinstance(obj, list):
        if not obj:
            return [_invalid(None, raw, "empty list of tool calls")]
        return [_call_from_object(o, OPEN + json.dumps(o, ensure_ascii=False) + CLOSE, names) for o in obj]
    return [_call_from_object(obj, raw, names)]


def _close_prefixes() -> list[str]:
    """The non-empty proper prefixes of the closing tag, longest first."""
    return [CLOSE[:i] for i in range(len(CLOSE) - 1, 0, -1)]


def _guess_name(text: str) -> str | None:
    """The tool name of a call whose JSON is broken, when it can be read off (for error reports)."""
    key = text.find('"name"')
    if key < 0:
        return None
    rest = text[key + 6 :].lstrip()
    if not rest.startswith(":"):
        return None
    rest = rest[1:].lstrip()
    if not rest.startswith('"'):
        return None
    end = rest.find('"', 1)
    return rest[1:end] if end > 0 else None


def parse_bare_json(text: str, names: Collection[str] | None) -> list | None:
    """Llama-3 style calls from a whole output, or None when the output is not a tool call."""
    body = text.strip()
    tagged = body.startswith(PYTHON_TAG)
    if tagged:
        body = body[len(PYTHON_TAG) :].strip()
    objects: list[Any] = []
    decoder = json.JSONDecoder()
    pos = 0
    try:
        while pos < len(body):
            obj, pos = decoder.raw_decode(body, pos)
            objects.extend(obj if isinstance(obj, list) else [obj])
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
    except json.JSONDecodeError as exc:
        if tagged:
            return [_invalid(_guess_name(body), text.strip(), f"tool call is not valid JSON: {exc}")]
        return None
    if not objects:
        return [_invalid(None, text.strip(), "no tool call after <|python_tag|>")] if tagged else None
    if tagged:  # the tag says "this is a call": report what is wrong with it
        return [_call_from_object(o, PYTHON_TAG + json.dumps(o, ensure_ascii=False), names) for o in objects]
    calls = [_call_from_object(o, "", names) for o in objects]
    if all(c.get("type") == "tool_call" for c in calls):
        return calls
    return None  # JSON, but not (only) calls to bound tools: an answer


def _partial_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``tag``."""
    for j in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:j]):
            return j
    return 0


class ToolCallSplitter:
    """Splits streamed output into text and tool calls, holding back anything that may be markup.

    ``feed(delta)`` and ``finish()`` return events: ``("text", str)`` or ``("call", ToolCall |
    InvalidToolCall)``. Whitespace right before or between tool-call blocks is dropped.

    States: "start" (only whitespace so far: the output may still be bare JSON), "bare" (the output
    began with JSON or ``<|python_tag|>``: held until the end), "text", "call" (inside a block).
    """

    def __init__(self, names: Collection[str] | None = None, bare_json: bool = True):
        self.names = names  # bound tool names; None accepts any name
        self.bare_json = bare_json  # recognise Llama-3 bare JSON calls
        self.state = "start" if bare_json else "text"
        self.buf = ""
        self.after_call = False  # the last thing seen was a closed block

    def feed(self, delta: str) -> list[tuple[str, Any]]:
        self.buf += delta
        events: list[tuple[str, Any]] = []
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if head.startswith(("{", "[", PYTHON_TAG)):
                    self.state = "bare"
                elif head and not (len(head) < len(PYTHON_TAG) and PYTHON_TAG.startswith(head)):
                    self.state = "text"
                else:
                    return events  # only whitespace, or maybe the start of <|python_tag|>
            if self.state == "bare":
                return events
            if self.state == "text":
                if self.after_call:  # whitespace after a block is dropped
                    self.buf = self.buf.lstrip()
                    if not self.buf:
                        return events
                    self.after_call = False
                i = self.buf.find(OPEN)
                if i < 0:
                    keep = _partial_prefix(self.buf, OPEN)
                    # hold a possible partial tag, and whitespace that may precede a call
                    n = len(self.buf[: len(self.buf) - keep].rstrip())
                    self._text(events, self.buf[:n])
                    self.buf = self.buf[n:]
                    return events
                self._text(events, self.buf[:i].rstrip())
                self.buf, self.state = self.buf[i + len(OPEN) :], "call"
            if self.state == "call":
                j = self.buf.find(CLOSE)
                if j < 0:
                    return events
                events += [("call", c) for c in parse_block(self.buf[:j], self.names)]
                self.buf, self.state, self.after_call = self.buf[j + len(CLOSE) :], "text", True

    def finish(self) -> list[tuple[str, Any]]:
        events: list[tuple[str, Any]] = []
        if self.state == "bare":
            calls = parse_bare_json(self.buf, self.names)
            if calls is not None:
                return [("call", c) for c in calls]
            self._text(events, self.buf)
        elif self.state == "call":
            events += [("call", c) for c in parse_block(self.buf, self.names, closed=False)]
        elif self.after_call:
            self._text(events, self.buf.lstrip())
        else:
            self._text(events, self.buf)
        self.buf = ""
        return events

    @staticmethod
    def _text(events: list, text: str) -> None:
        if text:
            events.append(("text", text))


def collect(events: list[tuple[str, Any]], into: ParsedOutput) -> ParsedOutput:
    for kind, value in events:
        if kind == "text":
            into.content += value
        elif value.get("type") == "invalid_tool_call":
            into.invalid_tool_calls.append(value)
        else:
            into.tool_calls.append(value)
    return into


def parse_tool_calls(text: str, names: Collection[str] | None = None, bare_json: bool = True) -> ParsedOutput:
    """Content, tool calls and invalid tool calls of one whole model output."""
    splitter = ToolCallSplitter(names, bare_json)
    out = collect(splitter.feed(text), ParsedOutput(""))
    return collect(splitter.finish(), out)
