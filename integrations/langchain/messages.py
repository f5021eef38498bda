"""Rendering LangChain messages into prompt token ids with the model's own chat template.

Roles: system, user, assistant (``AIMessage``; its ``tool_calls`` with dict arguments) and tool
(``ToolMessage``, role "tool"). Two ways to show tools to the model:

- *native*: the template itself renders ``tools=`` and assistant ``tool_calls`` (Qwen2.5, Hermes,
  Llama 3.x, ...). We pass the OpenAI-format schemas and HF-format messages through unchanged.
- *fallback*, for templates that never mention ``tools`` (SmolLM2's plain ChatML is one): the
  schemas go into the system message in the Hermes / Qwen2.5 style (``FALLBACK_TOOLS_PROMPT``),
  asking for ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``; earlier calls are written
  back into the assistant turn in exactly that form, and tool results are sent as role "tool"
  wrapped in ``<tool_response>`` tags. The tool prompt is appended to the first system message,
  or becomes the system message when there is none.

Prefix property: the prompt of turn n (rendered with the generation prompt) is a token prefix of
the prompt of turn n+1 whenever the conversation only grew by the assistant's reply and later
messages, so the prefix cache can skip the whole earlier conversation. Templates make this true
by rendering each message independently; tokenising the whole text once keeps it true as long as
no token spans the end of the generation prompt, which is why assistant text is rendered without
leading whitespace (tested on SmolLM2's tokenizer).

``forced_prefix`` writes the start of a tool call into the assistant turn when ``tool_choice``
demands one, so a model that would rather answer in prose still produces a call.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from integrations.langchain.tool_parsing import CLOSE, OPEN

FALLBACK_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

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


@dataclass
class Prompt:
    text: str  # the rendered prompt, generation prompt and any forced prefix included
    ids: list[int]  # its token ids
    forced: str  # start of the reply written for the model (tool_choice or prefill), in text and ids
    tool_format: str  # how this model writes calls: "hermes" (<tool_call> tags) or "json" (Llama 3)
    native_tools: bool  # the template renders the tools itself


def template_source(tokenizer: Any, tools: bool) -> str:
    tmpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tmpl, dict):
        tmpl = tmpl.get("tool_use" if tools else "default") or next(iter(tmpl.values()), None)
    if not isinstance(tmpl, str):
        raise ValueError("the tokenizer has no chat template; ChatSpecDecode needs a chat model")
    return tmpl


def template_features(tokenizer: Any) -> tuple[bool, bool, str]:
    """(renders tools=, renders assistant tool_calls, call format) of a tokenizer's chat template."""
    src = template_source(tokenizer, tools=True)
    native = re.search(r"\btools\b", src) is not None
    calls = re.search(r"\btool_calls\b", src) is not None
    fmt = "json" if native and OPEN not in src and "parameters" in src else "hermes"
    return native, calls, fmt


def message_text(message: BaseMessage) -> str:
    """The text of a message; images, audio and files are refused (the models here read text), and
    so are unknown content blocks and text that is not valid Unicode (a lone surrogate)."""
    content = message.content
    if not isinstance(content, str):
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind in _NON_TEXT_BLOCKS:
                name = type(message).__name__
                raise ValueError(f"{name} has a {kind!r} block; ChatSpecDecode takes text only")
            if isinstance(block, dict) and kind != "text" and kind not in _SKIPPED_BLOCKS:
                raise ValueError(f"{type(message).__name__} has a content block of unknown type {kind!r}")
    text = content if isinstance(content, str) else message.text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{type(message).__name__} content is not valid Unicode: {exc.reason} "
            f"{text[exc.start]!r} at position {exc.start}"
        ) from None
    return text


def tool_call_text(name: str, args: dict) -> str:
    """A past call, written as the fallback prompt asks for it (the Hermes / Qwen2.5 form)."""
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def _template_call(call: dict) -> dict:
    """A LangChain tool call in the HF chat-template form (arguments stay a dict)."""
    function = {"name": call["name"], "arguments": call["args"]}
    return {"id": call.get("id"), "type": "function", "function": function}


def to_template_messages(
    messages: Sequence[BaseMessage], *, native_calls: bool, wrap_tool_results: bool
) -> list[dict[str, Any]]:
    """HF chat-template dicts for LangChain messages."""
    out: list[dict[str, Any]] = []
    calls: set[str] = set()  # ids of the tool calls made so far: a ToolMessage must answer one
    for m in messages:
        if isinstance(m, SystemMessage):
            out.append({"role": "system", "content": message_text(m)})
        elif isinstance(m, HumanMessage):
            out.append({"role": "user", "content": message_text(m)})
        elif isinstance(m, AIMessage):
            # leading whitespace could merge with the generation prompt's last newline into one
            # token and break the prefix property; many templates trim assistant text anyway
            parts = [message_text(m).lstrip()]
            calls.update(c["id"] for c in (*m.tool_calls, *m.invalid_tool_calls) if c.get("id"))
            entry: dict[str, Any] = {"role": "assistant"}
            if m.tool_calls and native_calls:
                entry["tool_calls"] = [_template_call(c) for c in m.tool_calls]
            else:
                parts += [tool_call_text(c["name"], c["args"]) for c in m.tool_calls]
            # an invalid call's args hold the model's own markup: show the model what it wrote
            parts += [c["args"] for c in m.invalid_tool_calls if c.get("args")]
            entry["content"] = "\n".join(p for p in parts if p)
            out.append(entry)
        elif isinstance(m, (ToolMessage, FunctionMessage)):
            text = message_text(m)
            if wrap_tool_results:
                text = f"<tool_response>\n{text}\n</tool_response>"
            entry = {"role": "tool", "content": text}
            if isinstance(m, ToolMessage):
                if m.tool_call_id not in calls:  # as chat APIs do: a result must answer a call
                    raise ValueError(
                        f"ToolMessage answers tool call id {m.tool_call_id!r}, but no earlier AIMessage "
                        f"made a tool call with that id (calls so far: {sorted(calls)})"
                    )
                entry["tool_call_id"] = m.tool_call_id
            if m.name:
                entry["name"] = m.name
            out.append(entry)
        elif isinstance(m, ChatMessage):
            out.append({"role": m.role, "content": message_text(m)})
        else:
            raise ValueError(f"unsupported message type {type(m).__name__}")
    return out


def fallback_tools_prompt(tools: Sequence[dict]) -> str:
    return FALLBACK_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def forced_prefix(tool_format: str, tool_choice: Any, tools: Sequence[dict]) -> str:
    """Start of the assistant turn that forces a call when ``tool_choice`` demands one.

    "any" with several tools: the call up to the tool name, which the model picks. A named tool
    (or "any" with one tool): the call up to its first required argument's name, or the whole call
    when the tool takes no arguments. The text ends where the model's own tokens would begin
    (after ``":``), so the prompt tokenises as the model would have written it.
    """
    if not tools or tool_choice in (None, "auto", "none"):
        return ""
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    name = tool_choice if tool_choice in by_name else (next(iter(by_name)) if len(by_name) == 1 else None)
    tagged = tool_format != "json"
    start = f"{OPEN}\n" if tagged else ""
    if name is None:
        return start + '{"name": "'
    key = "arguments" if tagged else "parameters"
    head = start + f'{{"name": {json.dumps(name, ensure_ascii=False)}, "{key}":'
    schema = by_name[name].get("parameters") or {}
    props = list(schema.get("properties") or {})
    required = [p for p in props if p in (schema.get("required") or ())]
    if not props:
        return head + " {}}" + (f"\n{CLOSE}" if tagged else "")
    if required:
        return head + f" {{{json.dumps(required[0], ensure_ascii=False)}:"
    return head


def render(
    tokenizer: Any,
    messages: Sequence[BaseMessage],
    tools: Sequence[dict] | None = None,
    tool_choice: Any = None,
    prefill: str | None = None,
) -> Prompt:
    """Prompt text and ids for ``messages``, ending with the assistant's generation prompt.

    The reply is forced to start with ``prefill`` when given, else with what ``tool_choice``
    demands (``forced_prefix``).
    """
    tools = list(tools or [])
    native, native_calls, fmt = template_features(tokenizer)
    use_native = native and bool(tools)
    convo = to_template_messages(messages, native_calls=native and native_calls, wrap_tool_results=not native)
    if tools and not native:
        block = fallback_tools_prompt(tools)
        system = next((m for m in convo if m["role"] == "system"), None)
        if system is None:
            convo.insert(0, {"role": "system", "content": block})
        else:
            system["content"] = f"{system['content']}\n\n{block}" if system["content"] else block
    text = tokenizer.apply_chat_template(
        convo, tools=tools if use_native else None, add_generation_prompt=True, tokenize=False
    )
    forced = prefill if prefill is not None else forced_prefix(fmt, tool_choice, tools)
    text += forced
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return Prompt(text=text, ids=list(ids), forced=forced, tool_format=fmt, native_tools=use_native)
