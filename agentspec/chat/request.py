"""One chat request, prepared for the decoding loop, and its reply parsed back.

``prepare`` takes what an OpenAI-compatible chat request carries (messages, ``tools``,
``tool_choice``, ``response_format``) and gives the prompt ids, the grammar of the whole reply and
the forced start of the reply; ``ReplyParser`` turns the streamed text back into content and
OpenAI-format tool calls. The LangChain chat model and the server both call these two.

What the grammar allows:

- tool_choice "required" / "any" or a named tool: the reply is tool calls (to that tool), arguments
  valid under each tool's schema.
- tool_choice None/"auto": the model may answer instead; a ``<tool_call>`` it opens must be valid.
  With a ``response_format`` too (LangChain's ``create_agent`` binds both), the answer is a JSON
  value valid under that schema.
- ``response_format`` alone: the reply is that JSON value.
- tool_choice "none": the tools stay in the prompt (the same prefix as the calls around it), but
  decoding stops where a call would start.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentspec import grammar as G
from agentspec.chat.prompt import Prompt, render
from agentspec.config import GenerationConfig
from agentspec.decode import ContextLengthExceeded, context_room
from agentspec.models import ModelPair
from agentspec_toolcalls import CLOSE, OPEN, Event, ToolCallSplitter

log = logging.getLogger(__name__)


def checked_tool_name(tool: Any, index: int) -> str:
    """The name of an OpenAI-format tool, or a ValueError saying what is wrong with it."""
    function = tool.get("function") if isinstance(tool, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or not name:
        raise ValueError(f"tool {index} has no name (a non-empty string): {str(tool)[:120]}")
    return name


def checked_tools(tools: Sequence[dict]) -> list[dict]:
    """OpenAI-format tools, one per name: a call names its tool, so the first definition of a name wins
    (LangChain's own conformance tests bind a pydantic model and its JSON schema together)."""
    kept: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        kept.setdefault(checked_tool_name(tool, i), tool)
    if len(kept) < len(tools):
        names = [t["function"]["name"] for t in tools]
        repeated = sorted({n for n in names if names.count(n) > 1})
        log.warning("tools: %s bound more than once; the first definition is kept", repeated)
    return list(kept.values())


def normalise_tool_choice(tool_choice: Any, names: Sequence[str]) -> str | None:
    """None/"auto" (the model decides), "none", "any" (some tool; also "required"/True), or a name.

    Takes OpenAI's forms ("auto", "none", "required", ``{"type": "function", "function": {"name":
    ...}}``) and LangChain's ("any", a bare name, True/False).
    """
    if isinstance(tool_choice, dict):  # OpenAI form {"type": "function", "function": {"name": ...}}
        tool_choice = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    if tool_choice is None or tool_choice == "auto" or tool_choice is False:
        return None
    if tool_choice is True or tool_choice in ("any", "required"):
        if not names:
            raise ValueError(f"tool_choice={tool_choice!r} needs at least one tool")
        return "any"
    if tool_choice == "none":
        return "none"
    if isinstance(tool_choice, str) and tool_choice in names:
        return tool_choice
    raise ValueError(
        f"tool_choice: expected None, 'auto', 'none', 'any', 'required' or one of the bound tool "
        f"names {list(names)}, got {tool_choice!r}"
    )


def response_schema(response_format: dict | None) -> dict | None:
    """The JSON schema a ``response_format`` asks for (None: no constraint on the answer).

    ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}``, ``{"type":
    "json_object"}``, ``{"type": "text"}``, or a bare JSON schema.
    """
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError('response_format {"type": "json_schema"} needs json_schema.schema, a dict')
        return schema
    if kind == "json_object":
        return {"type": "object"}
    if kind == "text":
        return None
    if isinstance(response_format, dict) and (
        "properties" in response_format or kind == "object" or "$schema" in response_format
    ):
        return response_format  # a bare JSON schema
    raise ValueError(
        f"response_format: expected {{'type': 'json_schema' | 'json_object' | 'text', ...}}, a JSON "
        f"schema, a pydantic model or a TypedDict, got {response_format!r}"
    )


def output_grammar(
    tools: Sequence[dict], tool_choice: str | None, answer: dict | None, tool_format: str, single: bool
) -> G.Grammar | None:
    """The grammar of the whole reply, or None when the reply is free text.

    ``tools``: the tools the reply may call (empty: none may be called); ``tool_choice``
    normalised by ``normalise_tool_choice`` ("any", a name, or None for auto); ``answer``: the
    JSON schema of an answer that is not a call.
    """
    if tools:
        if tool_choice is None:
            return G.tool_calls(tools, "auto", tool_format=tool_format, single=single, answer=answer)
        chosen = [t for t in tools if t["function"]["name"] == tool_choice] or list(tools)
        return G.tool_calls(chosen, "any", tool_format=tool_format, single=single)
    if answer is not None:
        return G.json_schema(answer)
    return None


@dataclass(frozen=True)
class PreparedRequest:
    """What the decoding loop runs for one chat request, and what its reply is parsed with."""

    prompt: Prompt  # text and ids, the forced start of the reply, the model's call format
    grammar: G.Grammar | None  # what the whole reply may be; None: free text (or unconstrained)
    tool_names: frozenset[str] | None  # the tools a reply may call; None: no tool-call parsing
    single: bool  # one call wanted (a named tool, or parallel_tool_calls=False): stop after it
    stop: tuple[str, ...]  # stop strings the request adds to the caller's
    # the request as given (OpenAI format), for telemetry's opt-in content capture: read, never copied
    messages: Sequence[dict] = ()
    tools: Sequence[dict] = ()  # as checked_tools returned them
    answer: dict | None = None  # the JSON schema response_format asks for (None: free text)

    @property
    def output_type(self) -> str:
        """What the client asked for (``gen_ai.output.type``): "json" under a response_format, else "text"."""
        return "json" if self.answer is not None else "text"

    def constraint(self, pair: ModelPair) -> G.Constraint | None:
        """The grammar compiled for ``pair``, past the forced start of the reply."""
        if self.grammar is None:
            return None
        constraint = G.Constraint.for_pair(pair, self.grammar)
        if self.prompt.forced and not constraint.accept_text(self.prompt.forced):
            raise ValueError(f"the forced start of the reply does not fit {self.grammar.description}")
        return constraint

    def fitted(self, pair: ModelPair, config: GenerationConfig) -> GenerationConfig:
        """``config`` for this request on ``pair``: its stop strings added, its length cut to the room
        the prompt leaves in the context window (``ContextLengthExceeded`` where it leaves none)."""
        room = context_room(pair, len(self.prompt.ids))
        if room < 1:
            raise ContextLengthExceeded(len(self.prompt.ids), pair.max_context, "messages")
        # one wanted call: the reply ends at its closing tag, in the core, so every mode keeps the
        # same tokens (a verify pass may accept the end-of-turn token after the tag, a plain pass
        # would not have made it) and the usage, the span and the saved prefix agree on them
        single = (CLOSE,) if self.single else ()
        return dataclasses.replace(
            config,
            stop=config.stop + self.stop + single,
            max_new_tokens=min(config.max_new_tokens, room),
        )


def prepare(
    tokenizer: Any,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    tool_choice: Any = None,
    response_format: dict | None = None,
    *,
    parallel_tool_calls: bool = True,
    constrained: bool = True,
    prefill: str | None = None,
) -> PreparedRequest:
    """A chat request (OpenAI format) prepared for ``agentspec.stream`` on a pair with ``tokenizer``.

    ``constrained``: build the grammar of the reply (a call's start is then forced by the grammar,
    not written into the prompt); False leaves the reply free and only parses it. ``prefill``: text
    the reply is forced to start with, in place of what ``tool_choice`` demands.
    """
    tools = checked_tools(tools or [])
    choice = normalise_tool_choice(tool_choice, [t["function"]["name"] for t in tools])
    answer = response_schema(response_format)
    names = frozenset(t["function"]["name"] for t in tools) if tools and choice != "none" else None
    # a named tool (or "any" with one tool: the prompt already names it) is one call
    named = names is not None and (choice in names or (choice == "any" and len(names) == 1))
    single = names is not None and (not parallel_tool_calls or named)
    if constrained and prefill is None:
        prefill = ""  # the grammar itself forces what tool_choice demands
    prompt = render(tokenizer, messages, tools, choice, prefill)
    grammar = (
        output_grammar(tools if names else [], choice, answer, prompt.tool_format, single)
        if constrained
        else None
    )
    stop = (OPEN,) if choice == "none" else ()
    return PreparedRequest(prompt, grammar, names, single, stop, messages, tools, answer)


@dataclass(frozen=True)
class ChatCall:
    """One chat request prepared for one pair: what ``agentspec.chat.run`` decodes."""

    pair: ModelPair
    request: PreparedRequest  # prompt ids, the reply's grammar and forced start, its tools
    config: GenerationConfig  # the caller's options with the request's stop strings and room applied
    grammar: G.Constraint | None  # the reply's grammar compiled for the pair (None: free text)


# ``prepare``'s arguments with the pair and config it is fitted to: the one entry point of the chat
# model and the server (``prepare`` alone stays for callers without a pair: distillation, tests)
def prepare_call(
    pair: ModelPair,
    messages: Sequence[dict],
    config: GenerationConfig,
    tools: Sequence[dict] | None = None,
    tool_choice: Any = None,
    response_format: dict | None = None,
    *,
    parallel_tool_calls: bool = True,
    constrained: bool = True,
    prefill: str | None = None,
) -> ChatCall:
    """A chat request (OpenAI format) prepared for ``pair``: rendered (``prepare``), fitted to the
    context (``ContextLengthExceeded`` where the prompt leaves no room for a reply) and its grammar
    compiled. What is wrong with the request is a ValueError (or TypeError) naming it."""
    request = prepare(
        pair.tokenizer,
        messages,
        tools,
        tool_choice,
        response_format,
        parallel_tool_calls=parallel_tool_calls,
        constrained=constrained,
        prefill=prefill,
    )
    return ChatCall(pair, request, request.fitted(pair, config), request.constraint(pair))


class ReplyParser:
    """The reply to a prepared request, parsed as it streams into ``Event``s.

    The forced start of the reply is parsed with the model's first text. With ``single``, calls
    after the first are dropped and ``complete`` turns true once the one wanted call is out, so
    decoding can stop there.
    """

    def __init__(self, request: PreparedRequest):
        names = request.tool_names
        self._splitter = ToolCallSplitter(names) if names is not None else None
        self._single = request.single
        self._pending = self._splitter.feed(request.prompt.forced) if self._splitter is not None else []
        self.calls = 0  # calls (valid or not) released so far

    @property
    def complete(self) -> bool:
        return self._single and self.calls > 0

    def feed(self, text: str) -> list[Event]:
        if self._splitter is None:
            return [("text", text)] if text else []
        events, self._pending = self._pending + self._splitter.feed(text), []
        return self._released(events)

    def finish(self) -> list[Event]:
        return self._released(self._splitter.finish()) if self._splitter is not None else []

    def _released(self, events: list[Event]) -> list[Event]:
        out = []
        for kind, value in events:
            if kind != "text":
                if self.complete:
                    continue
                self.calls += 1
            out.append((kind, value))
        return out
