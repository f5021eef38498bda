"""One count per reply: the same reply reports the same usage in every mode.

Speculative or plain, with each drafter, with the prefix cache or without, invoked or streamed: the
reply is the same (greedy, lossless), so its ``usage_metadata`` must be too. A verify pass may
accept tokens past the point where the reply ends (a forced call's closing tag, then the
end-of-turn token the grammar forces after it), which a plain pass would never have computed; they
are not part of the reply, nor of the state saved for the next call, whose ``cache_read`` is
compared as well (a second call on top of the first reply).
"""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel, Field

import agentspec
from langchain_agentspec import ChatSpecDecode

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_thread")]

OWN_CACHE = 256 << 20  # bytes: a fresh prefix cache per instance, so no mode reads another's prompts
# (speculative, drafter, prefix_cache, jump_forward, streamed): the plain baseline first
MODES = [
    (False, "none", False, False, False),
    (False, "none", OWN_CACHE, False, True),
    (False, "none", OWN_CACHE, True, False),
    (True, "auto", OWN_CACHE, True, False),
    (True, "auto", False, True, True),
    (True, "model", OWN_CACHE, True, True),
    (True, "prompt_lookup", OWN_CACHE, True, False),
]
SYSTEM = SystemMessage("You are a concise assistant. Use the tools when asked.")


@tool
def square(x: int) -> int:
    """Square an integer."""
    return x * x


class Capital(BaseModel):
    """A country and its capital city."""

    country: str = Field(description="the country")
    capital: str = Field(description="its capital city")


@pytest.fixture(scope="module")
def smol_pair():
    return agentspec.load_pair()


def _reply(runnable, messages, streamed: bool) -> AIMessage:
    if not streamed:
        return runnable.invoke(messages)
    chunks = list(runnable.stream(messages))
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    return full


def _two_calls(pair, mode, kind: str) -> list[tuple[str, dict]]:
    """Both calls of one conversation in ``mode``: (what the reply says, its usage)."""
    speculative, drafter, cache, jump, streamed = mode
    llm = ChatSpecDecode(
        pair=pair, speculative=speculative, drafter=drafter, prefix_cache=cache, jump_forward=jump
    )
    if kind == "tool_call":
        runnable = llm.bind_tools([square], tool_choice="square", max_tokens=40)
        first = [SYSTEM, HumanMessage("What is 12 squared?")]
    elif kind == "structured":
        runnable = llm.bind(
            max_tokens=40,
            response_format={"type": "json_schema", "json_schema": {"schema": Capital.model_json_schema()}},
        )
        first = [SYSTEM, HumanMessage("Give the capital of France as JSON.")]
    else:
        runnable = llm.bind(max_tokens=12)
        first = [SYSTEM, HumanMessage("Name three colours.")]
    out = []
    messages = first
    for _ in range(2):
        reply = _reply(runnable, messages, streamed)
        said = repr((reply.content, [(c["name"], c["args"]) for c in reply.tool_calls]))
        out.append((said, reply.usage_metadata))
        # the second call: the first reply, then an answer to it (a tool result, or the user)
        follow = ToolMessage("144", tool_call_id=reply.tool_calls[0]["id"]) if reply.tool_calls else None
        messages = [*first, reply, follow or HumanMessage("And one more?")]
    return out


@pytest.mark.parametrize("kind", ["tool_call", "structured", "text"])
def test_usage_is_the_same_in_every_mode(smol_pair, kind):
    runs = {mode: _two_calls(smol_pair, mode, kind) for mode in MODES}
    base = runs[MODES[0]]
    assert base[0][1]["output_tokens"] > 0, base
    for mode, calls in runs.items():
        for i, ((said, usage), (base_said, base_usage)) in enumerate(zip(calls, base)):
            assert said == base_said, f"{kind} call {i + 1}: {mode=} {said=} {base_said=}"
            counts = {k: usage[k] for k in ("input_tokens", "output_tokens", "total_tokens")}
            base_counts = {k: base_usage[k] for k in counts}
            assert counts == base_counts, f"{kind} call {i + 1}: {mode=} {counts=} {base_counts=}"
    # with a cache, the second call reads what the first saved: the same in every mode that has one,
    # but for the tokens a grammar appends without a target pass (jump-forward) at the end of a
    # reply: the pass that would have computed their predecessors' KV is the one it saves
    reads = {mode: [u["input_token_details"]["cache_read"] for _, u in calls] for mode, calls in runs.items()}
    for jump in (False, True):
        cached = {mode: r for mode, r in reads.items() if mode[2] and mode[3] == jump}
        assert len(set(map(tuple, cached.values()))) == 1, f"{kind}: {cached=}"
        assert next(iter(cached.values()))[1] > 0, f"{kind}: the second call read nothing back: {cached=}"
    assert all(r == [0, 0] for mode, r in reads.items() if not mode[2]), f"{kind}: {reads=}"
