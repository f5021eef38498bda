"""Model output faults end to end: a reply with broken tool-call JSON, a call to a tool that is not
bound, or a call cut off by max_tokens comes back as ``invalid_tool_calls`` with ids (and the
reason in ``response_metadata["tool_call_errors"]``), never as an exception, on invoke and stream.

The real embedded model writes the reply, unconstrained (``constrained=False``), after a forced
start that holds the fault (the 135M model rarely writes a call on its own); the parser's table of
cases is ``tests/test_tool_parsing.py``.
"""

from __future__ import annotations

import pytest
from langchain_core.tools import tool

import agentspec
from langchain_agentspec import ChatSpecDecode

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_thread")]


@tool
def square(x: int) -> int:
    """Square an integer."""
    return x * x


class ForcedStart(ChatSpecDecode):
    """The reply starts with ``start``; the model decodes on from there."""

    start: str = ""

    def _prefill(self, messages, tools, tool_choice):
        return self.start


CASES = {
    "broken_json": (
        '<tool_call>\n{"name": "square", "arguments": {"x": }\n</tool_call>',
        64,
        "not valid JSON",
    ),
    "unknown_tool": (
        '<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>',
        64,
        "unknown tool",
    ),
    "cut_by_max_tokens": (
        '<tool_call>\n{"name": "square", "arguments": {"x": {"y": [[[1, 2',
        1,
        "unterminated",
    ),
}


@pytest.fixture(scope="module")
def pair():
    return agentspec.load_pair()


def _streamed(llm, prompt):
    chunks = list(llm.stream(prompt))
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    return full


@pytest.mark.parametrize("case", list(CASES))
def test_a_faulty_call_is_an_invalid_tool_call_with_an_id(pair, case):
    start, max_tokens, why = CASES[case]
    llm = ForcedStart(pair=pair, start=start, max_tokens=max_tokens, constrained=False).bind_tools([square])
    for reply in (llm.invoke("Square 12."), _streamed(llm, "Square 12.")):
        assert not reply.tool_calls, reply.tool_calls
        assert len(reply.invalid_tool_calls) == 1, reply
        bad = reply.invalid_tool_calls[0]
        assert bad["id"] and start.removeprefix("<tool_call>\n")[:20] in bad["args"]  # as written
        errors = reply.response_metadata["tool_call_errors"]
        assert why in errors[bad["id"]]
        assert "<tool_call>" not in reply.content
    if case == "cut_by_max_tokens":
        assert reply.response_metadata["finish_reason"] == "length"
