"""LangChain messages in the OpenAI format that ``agentspec.chat`` renders.

System, human, AI (``tool_calls`` with dict arguments become OpenAI calls with JSON-string
arguments; ``invalid_tool_calls`` travel as ``agentspec.chat`` takes them, so the model sees what it
wrote), tool (``tool_call_id``) and function messages; a ``ChatMessage``'s role goes to the template
as it is. Content blocks are checked here, where their LangChain names are known: images, audio
and files are refused (the models here read text), another provider's reasoning and tool-call
blocks are skipped, and any other block type is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from langchain_agentspec import _engine

if TYPE_CHECKING:
    from agentspec.chat import Prompt

__all__ = ["render", "to_openai_messages", "tool_call_text"]

_NON_TEXT_BLOCKS = {"image", "image_url", "audio", "input_audio", "file", "video"}
# blocks that carry no text for the prompt: tool calls (kept in ``AIMessage.tool_calls``) and
# another provider's reasoning; skipped. Any other block type is refused by name.
_SKIPPED_BLOCKS = {
    "tool_use",
    "tool_call",
    "tool_call_chunk",
    "invalid_tool_call",
    "server_tool_call",
    "server_tool_result",
    "reasoning",
    "thinking",
    "redacted_thinking",
}


def message_text(message: BaseMessage) -> str:
    """The text of a message; images, audio, files and unknown content blocks are refused."""
    if not isinstance(message.content, str):
        for block in message.content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in _NON_TEXT_BLOCKS:
                name = type(message).__name__
                raise ValueError(f"{name} has a {kind!r} block; ChatSpecDecode takes text only")
            if isinstance(block, dict) and kind != "text" and kind not in _SKIPPED_BLOCKS:
                raise ValueError(f"{type(message).__name__} has a content block of unknown type {kind!r}")
    return message.text


def _openai_call(call: dict) -> dict:
    function = {"name": call["name"], "arguments": json.dumps(call["args"], ensure_ascii=False)}
    return {"id": call.get("id"), "type": "function", "function": function}


def _openai_invalid_call(call: dict) -> dict:
    function = {"name": call.get("name"), "arguments": call.get("args")}
    return {"id": call.get("id"), "type": "function", "function": function, "error": call.get("error")}


def _assistant(message: AIMessage) -> dict[str, Any]:
    entry: dict[str, Any] = {"role": "assistant", "content": message_text(message)}
    if message.tool_calls:
        entry["tool_calls"] = [_openai_call(c) for c in message.tool_calls]
    if message.invalid_tool_calls:
        entry["invalid_tool_calls"] = [_openai_invalid_call(c) for c in message.invalid_tool_calls]
    return entry


def _one(message: BaseMessage) -> dict[str, Any]:
    if isinstance(message, SystemMessage):
        return {"role": "system", "content": message_text(message)}
    if isinstance(message, HumanMessage):
        return {"role": "user", "content": message_text(message)}
    if isinstance(message, AIMessage):
        return _assistant(message)
    if isinstance(message, ChatMessage):
        return {"role": message.role, "content": message_text(message)}
    if isinstance(message, ToolMessage):
        entry = {"role": "tool", "content": message_text(message), "tool_call_id": message.tool_call_id}
    elif isinstance(message, FunctionMessage):
        entry = {"role": "function", "content": message_text(message)}
    else:
        raise ValueError(f"unsupported message type {type(message).__name__}")
    if message.name:
        entry["name"] = message.name
    return entry


def to_openai_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """OpenAI-format dicts for LangChain messages (``agentspec.chat``'s input)."""
    return [_one(m) for m in messages]


def render(
    tokenizer: Any,
    messages: Sequence[BaseMessage],
    tools: Sequence[dict] | None = None,
    tool_choice: str | None = None,
    prefill: str | None = None,
) -> Prompt:
    """Prompt text and ids for LangChain ``messages`` (``agentspec.chat.render`` on their OpenAI form)."""
    return _engine.engine().chat.render(tokenizer, to_openai_messages(messages), tools, tool_choice, prefill)


def tool_call_text(name: str, args: dict) -> str:
    """A call as the model writes it (``agentspec.chat.tool_call_text``): scripted ``_prefill`` hooks
    (tests, constrained starts) write past calls with it."""
    return _engine.engine().chat.tool_call_text(name, args)
