"""Finding tool calls in model output: pure functions over text, no model, no tokenizer.

The distribution agentspec-toolcalls, standard library only: the engine (``agentspec.chat``) reads its
replies with it, and so does the LangChain integration's remote path, which runs without the engine
(``import agentspec`` imports torch). One parser, so a call reads the same in process and remote.

Formats recognised (vLLM's hermes and llama3_json parsers and SGLang's detectors are the references):

- Hermes / Qwen2.5: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one or several
  blocks, usually with newlines inside the tags.
- SmolLM2: a JSON list of such objects inside the same tags.
- Llama 3.x: bare JSON ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``) as the whole
  output, optionally after ``<|python_tag|>``, possibly a list or several objects joined by ``;``.

Calls come out in the OpenAI format, ``{"id": "call_...", "type": "function", "function": {"name":
..., "arguments": "<JSON object>"}}``. An invalid call has the same shape, with the model's raw text
for the call *with* its opening tag (``<tool_call>...``) as ``arguments`` (``name`` None when it
cannot be read off) and ``error`` saying why. Raw text that starts with ``<`` cannot parse as JSON,
so a client that re-parses streamed arguments leniently (LangChain does) never turns it back into a
valid call.

Rules. Every call gets an id. A tagged block that does not parse, lacks a name, has non-object
arguments or names a tool that was not bound becomes an invalid call, never an exception; an
unterminated block at the end of the output (cut by max_tokens, possibly inside the closing tag)
is accepted if its JSON is complete, else invalid.
Bare JSON (no tag) is only a tool call when every object in it is a well-formed call to a bound
tool; anything else is an answer that happens to be JSON and stays text.

``ToolCallSplitter`` is the incremental form used while streaming: it releases text as soon as it
cannot be the start of a tool call and returns each call once its block closes. ``parse_reply``
runs it over a whole output, so the two can never disagree.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from typing import Any, NamedTuple

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"

# An event of the splitter: ("text", str), ("call", call) or ("invalid", call), calls as above.
Event = tuple[str, Any]


class Reply(NamedTuple):
    content: str  # text outside tool-call markup
    tool_calls: list[dict]  # OpenAI-format calls
    invalid_tool_calls: list[dict]  # the same shape, raw text as arguments, plus "error"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def new_response_id() -> str:
    """An id for one reply (OpenAI's ``chatcmpl-`` form): its ``gen_ai.response.id``."""
    return f"chatcmpl-{uuid.uuid4().hex}"


def _call(name: str, args: dict) -> Event:
    function = {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
    return "call", {"id": new_call_id(), "type": "function", "function": function}


def _invalid(name: Any, raw: str, error: str) -> Event:
    function = {"name": name if isinstance(name, str) else None, "arguments": raw}
    return "invalid", {"id": new_call_id(), "type": "function", "function": function, "error": error}


def _call_from_object(obj: Any, raw: str, names: Collection[str] | None) -> Event:
    """One call from a decoded JSON object; ``raw`` is what an invalid call reports as its arguments."""
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
    return _call(name, args)


def parse_block(inner: str, names: Collection[str] | None, closed: bool = True) -> list[Event]:
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


def parse_bare_json(text: str, names: Collection[str] | None) -> list[Event] | None:
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
    if all(kind == "call" for kind, _ in calls):
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

    ``feed(delta)`` and ``finish()`` return events (``Event``). Whitespace right before or between
    tool-call blocks is dropped.

    States: "start" (only whitespace so far: the output may still be bare JSON), "bare" (the output
    began with JSON or ``<|python_tag|>``: held until the end), "text", "call" (inside a block).
    """

    def __init__(self, names: Collection[str] | None = None, bare_json: bool = True):
        self.names = names  # bound tool names; None accepts any name
        self.bare_json = bare_json  # recognise Llama-3 bare JSON calls
        self.state = "start" if bare_json else "text"
        self.buf = ""
        self.after_call = False  # the last thing seen was a closed block

    def feed(self, delta: str) -> list[Event]:
        self.buf += delta
        events: list[Event] = []
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
                    if OPEN.startswith(self.buf):  # nothing yet, or maybe the next block's tag
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
                events += parse_block(self.buf[:j], self.names)
                self.buf, self.state, self.after_call = self.buf[j + len(CLOSE) :], "text", True

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self.state == "bare":
            calls = parse_bare_json(self.buf, self.names)
            if calls is not None:
                return calls
            self._text(events, self.buf)
        elif self.state == "call":
            events += parse_block(self.buf, self.names, closed=False)
        elif self.after_call:
            rest = self.buf.lstrip()
            # a reply cut (by its token cap) inside the next call's opening tag: the tag prefix names no
            # tool and holds no arguments, so there is no call to report, and it is markup, not content
            # (the finish reason "length" tells the caller the reply was cut)
            if not OPEN.startswith(rest):
                self._text(events, rest)
        else:
            self._text(events, self.buf)
        self.buf = ""
        return events

    @staticmethod
    def _text(events: list, text: str) -> None:
        if text:
            events.append(("text", text))


def parse_reply(text: str, names: Collection[str] | None = None, bare_json: bool = True) -> Reply:
    """Content, tool calls and invalid tool calls of one whole model output.

    ``names``: the tools the request bound (a call to any other is invalid); None accepts any name.
    """
    splitter = ToolCallSplitter(names, bare_json)
    reply = Reply("", [], [])
    content = []
    for kind, value in [*splitter.feed(text), *splitter.finish()]:
        if kind == "text":
            content.append(value)
        else:
            (reply.tool_calls if kind == "call" else reply.invalid_tool_calls).append(value)
    return reply._replace(content="".join(content))
