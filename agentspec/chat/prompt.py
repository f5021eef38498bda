"""Rendering OpenAI-format chat messages into prompt token ids with the model's own chat template.

Messages are dicts as the OpenAI chat API takes them: ``{"role": "system" | "user", "content":
...}``, ``{"role": "assistant", "content": ..., "tool_calls": [{"id", "type": "function",
"function": {"name", "arguments": "<JSON object>"}}]}`` and ``{"role": "tool", "tool_call_id": ...,
"content": ...}``; content is a string, None, or a list of ``{"type": "text", "text": ...}`` parts
(the models here read text). The legacy ``{"role": "function", "name": ...}`` is a tool result
answering no id; any other role goes to the template as it is. One extension: an assistant message
may carry ``invalid_tool_calls`` as ``parse_reply`` returns them; their raw text is shown to the
model as it wrote it, and tool messages may answer their ids.

Two ways to show tools to the model:

- *native*: the template itself renders ``tools=`` and assistant ``tool_calls`` (Qwen2.5, Hermes,
  Llama 3.x, ...). We pass the OpenAI-format schemas and HF-format messages (arguments as an
  object) through.
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

from agentspec_toolcalls import CLOSE, OPEN

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


@dataclass
class Prompt:
    text: str  # the rendered prompt, generation prompt and any forced prefix included
    ids: list[int]  # its token ids
    forced: str  # start of the reply written for the model (tool_choice or prefill), in text and ids
    tool_format: str  # how this model writes calls: "hermes" (<tool_call> tags) or "json" (Llama 3)
    native_tools: bool  # the template renders the tools itself


def template_source(tokenizer: Any) -> str:
    """The chat template's text (of a tokenizer with several, the one for tool use)."""
    tmpl = tokenizer.chat_template
    if isinstance(tmpl, dict):
        tmpl = tmpl.get("tool_use") or next(iter(tmpl.values()), None)
    if not isinstance(tmpl, str):
        raise ValueError("the tokenizer has no chat template; a chat request needs a chat model")
    return tmpl


def template_features(tokenizer: Any) -> tuple[bool, bool, str]:
    """(renders tools=, renders assistant tool_calls, call format) of a tokenizer's chat template."""
    src = template_source(tokenizer)
    native = re.search(r"\btools\b", src) is not None
    calls = re.search(r"\btool_calls\b", src) is not None
    fmt = "json" if native and OPEN not in src and "parameters" in src else "hermes"
    return native, calls, fmt


def content_text(message: dict, index: int) -> str:
    """The text of message ``index``: a string, None, or text parts; anything else is refused, and so
    is text that is not valid Unicode (a lone surrogate)."""
    content = message.get("content")
    where = f"message {index} ({message['role']})"
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text":
                raise ValueError(f"{where} has a content part of type {kind!r}; only text parts are taken")
        text = "".join(part["text"] for part in content)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{where}: content is not valid Unicode: {exc.reason} {text[exc.start]!r} at position {exc.start}"
        ) from None
    return text


def tool_call_text(name: str, args: dict) -> str:
    """A past call, written as the fallback prompt asks for it (the Hermes / Qwen2.5 form)."""
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def _template_call(call: dict, index: int) -> dict:
    """An OpenAI-format call in the HF chat-template form: arguments as an object, not a string."""
    function = call["function"]
    arguments = function.get("arguments") or "{}"
    try:
        args = json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"message {index}: tool call {call.get('id')!r} arguments are not JSON: {exc}"
        ) from None
    if not isinstance(args, dict):
        raise ValueError(f"message {index}: tool call {call.get('id')!r} arguments are not a JSON object")
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": function["name"], "arguments": args},
    }


def _assistant_entry(message: dict, index: int, native_calls: bool, calls: set[str]) -> dict:
    # leading whitespace could merge with the generation prompt's last newline into one token and
    # break the prefix property; many templates trim assistant text anyway
    parts = [content_text(message, index).lstrip()]
    tool_calls = [_template_call(c, index) for c in message.get("tool_calls") or ()]
    invalid = message.get("invalid_tool_calls") or ()
    calls.update(c["id"] for c in (*tool_calls, *invalid) if c.get("id"))
    entry: dict[str, Any] = {"role": "assistant"}
    if tool_calls and native_calls:
        entry["tool_calls"] = tool_calls
    else:
        parts += [tool_call_text(c["function"]["name"], c["function"]["arguments"]) for c in tool_calls]
    # an invalid call's arguments hold the model's own markup: show the model what it wrote
    parts += [c["function"]["arguments"] for c in invalid if c["function"].get("arguments")]
    entry["content"] = "\n".join(p for p in parts if p)
    return entry


def _tool_entry(message: dict, index: int, wrap: bool, calls: set[str]) -> dict:
    text = content_text(message, index)
    if wrap:
        text = f"<tool_response>\n{text}\n</tool_response>"
    entry = {"role": "tool", "content": text}
    if message["role"] == "tool":
        call_id = message.get("tool_call_id")
        if call_id not in calls:  # as chat APIs do: a result must answer a call
            raise ValueError(
                f"message {index} (tool) answers tool call id {call_id!r}, but no earlier assistant message "
                f"made a tool call with that id (calls so far: {sorted(calls)})"
            )
        entry["tool_call_id"] = call_id
    if message.get("name"):
        entry["name"] = message["name"]
    return entry


def to_template_messages(
    messages: Sequence[dict], *, native_calls: bool, wrap_tool_results: bool
) -> list[dict[str, Any]]:
    """HF chat-template dicts for OpenAI-format messages (checked on the way)."""
    out: list[dict[str, Any]] = []
    calls: set[str] = set()  # ids of the tool calls made so far: a tool message must answer one
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i}: expected a dict with a 'role' string, got {str(m)[:120]}")
        if m["role"] == "assistant":
            out.append(_assistant_entry(m, i, native_calls, calls))
        elif m["role"] in ("tool", "function"):
            out.append(_tool_entry(m, i, wrap_tool_results, calls))
        else:
            out.append({"role": m["role"], "content": content_text(m, i)})
    return out


def fallback_tools_prompt(tools: Sequence[dict]) -> str:
    return FALLBACK_TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def forced_prefix(tool_format: str, tool_choice: str | None, tools: Sequence[dict]) -> str:
    """Start of the assistant turn that forces a call when ``tool_choice`` demands one.

    ``tool_choice`` as ``normalise_tool_choice`` gives it. "any" with several tools: the call up
    to the tool name, which the model picks. A named tool (or "any" with one tool): the call up to
    its first required argument's name, or the whole call when the tool takes no arguments. The
    text ends where the model's own tokens would begin (after ``":``), so the prompt tokenises as
    the model would have written it.
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
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    tool_choice: str | None = None,
    prefill: str | None = None,
) -> Prompt:
    """Prompt text and ids for OpenAI-format ``messages``, ending with the assistant's generation prompt.

    The reply is forced to start with ``prefill`` when given, else with what ``tool_choice``
    (normalised: None, "none", "any" or a tool's name) demands (``forced_prefix``).
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
