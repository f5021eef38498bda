"""Tool calls in model output as LangChain ``ToolCall`` / ``InvalidToolCall`` dicts.

The parsing is ``agentspec_toolcalls`` (formats, rules, streaming), the engine's parser in a
distribution of its own, so it needs no engine; this module only turns its OpenAI-format calls into
LangChain's: a valid call's JSON arguments become ``args``, an invalid call keeps the model's raw text
(with its opening tag) as ``args``, which LangChain's lenient re-parsing of streamed chunks cannot
turn back into a valid call.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from langchain_core.messages import InvalidToolCall, ToolCall
from langchain_core.messages.tool import invalid_tool_call, tool_call

import agentspec_toolcalls
from agentspec_toolcalls import Event


@dataclass
class ParsedOutput:
    content: str  # text outside tool-call markup
    tool_calls: list[ToolCall] = field(default_factory=list)
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)


def to_langchain_call(kind: str, call: dict) -> ToolCall | InvalidToolCall:
    """An ``agentspec_toolcalls`` call event ("call" or "invalid") as LangChain's dict."""
    function = call["function"]
    if kind == "invalid":
        return invalid_tool_call(
            name=function["name"], args=function["arguments"], id=call["id"], error=call["error"]
        )
    return tool_call(name=function["name"], args=json.loads(function["arguments"]), id=call["id"])


def _langchain_events(events: list[Event]) -> list[tuple[str, Any]]:
    return [
        (kind, value) if kind == "text" else ("call", to_langchain_call(kind, value))
        for kind, value in events
    ]


class ToolCallSplitter:
    """``agentspec_toolcalls.ToolCallSplitter`` with LangChain calls: ``feed(delta)`` and ``finish()``
    return ``("text", str)`` or ``("call", ToolCall | InvalidToolCall)`` events."""

    def __init__(self, names: Collection[str] | None = None, bare_json: bool = True):
        self._core = agentspec_toolcalls.ToolCallSplitter(names, bare_json)

    def feed(self, delta: str) -> list[tuple[str, Any]]:
        return _langchain_events(self._core.feed(delta))

    def finish(self) -> list[tuple[str, Any]]:
        return _langchain_events(self._core.finish())


def collect(events: list[tuple[str, Any]], into: ParsedOutput) -> ParsedOutput:
    for kind, value in events:
        if kind == "text":
            into.content += value
        elif value["type"] == "invalid_tool_call":
            into.invalid_tool_calls.append(value)
        else:
            into.tool_calls.append(value)
    return into


def parse_tool_calls(text: str, names: Collection[str] | None = None, bare_json: bool = True) -> ParsedOutput:
    """Content, tool calls and invalid tool calls of one whole model output."""
    reply = agentspec_toolcalls.parse_reply(text, names, bare_json)
    return ParsedOutput(
        reply.content,
        [to_langchain_call("call", c) for c in reply.tool_calls],
        [to_langchain_call("invalid", c) for c in reply.invalid_tool_calls],
    )
