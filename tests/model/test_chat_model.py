"""ChatSpecDecode on the real embedded model (SmolLM2-135M-Instruct), with small max_tokens.

The equivalence test is the important one: greedy ChatSpecDecode text (speculative, prompt-lookup
drafts) equals the target's plain ``generate`` on the same rendered prompt.
"""

from __future__ import annotations

import asyncio

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool

import agentspec
from agentspec.chat import tool_call_text
from langchain_agentspec import ChatSpecDecode
from langchain_agentspec.messages import render

# one torch thread (conftest's one_thread): batch-1 decoding of a 135M model gains little from a
# second thread, and on a busy 2-core machine two threads spin against each other (10x slower)
pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_thread")]

COPY_TASK = [
    SystemMessage("You repeat text exactly."),
    HumanMessage("Repeat: the quick brown fox jumps over the lazy dog, the quick brown fox jumps."),
]


@pytest.fixture(scope="module")
def smol_pair():
    return agentspec.load_pair()


@tool
def square(x: int) -> int:
    """Square an integer."""
    return x * x


@tool
def word_length(word: str) -> int:
    """Count the letters in a word."""
    return len(word)


def _without_ids(message) -> dict:
    """The parts of a reply that must not depend on the path that made it (invoke or stream, sync
    or async, cold or restored from the prefix cache): all but ids, timings, cache reads and draft
    counts (drafting learns from earlier calls: the same reply may take other passes)."""
    strip = lambda calls: [{k: v for k, v in c.items() if k not in ("id", "error")} for c in calls]  # noqa: E731
    drop = ("id", "stats", "latency", "output_version")  # ids, and timings of the path's own passes
    meta = {k: v for k, v in message.response_metadata.items() if k not in drop}
    if "speculative" in meta:
        meta["speculative"] = {"drafter": meta["speculative"]["drafter"]}
    meta.pop("tool_call_errors", None)  # keyed by call id
    usage = {k: v for k, v in message.usage_metadata.items() if k != "input_token_details"}
    return {
        "content": message.content,
        "tool_calls": strip(message.tool_calls),
        "invalid_tool_calls": strip(message.invalid_tool_calls),
        "usage": usage,
        "meta": meta,
    }


def _streamed(runnable, messages) -> AIMessageChunk:
    chunks = list(runnable.stream(messages))
    assert chunks[-1].chunk_position == "last", chunks[-1]
    assert all(c.chunk_position is None for c in chunks[:-1])
    assert all(c.usage_metadata is None for c in chunks[:-1]), "only the last chunk carries usage"
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    return full


def test_greedy_equals_plain_target_generate(smol_pair):
    llm = ChatSpecDecode(pair=smol_pair, max_tokens=24)  # defaults: auto drafts (suffix trees), prefix cache
    reply = llm.invoke(COPY_TASK)
    ids = render(smol_pair.tokenizer, COPY_TASK).ids
    plain = agentspec.generate(smol_pair, ids, max_new_tokens=24, speculative=False, prefix_cache=False)
    assert reply.content == plain.text, f"{reply.content=} {plain.text=}"
    spec = reply.response_metadata["speculative"]
    assert spec["drafter"] == "auto" and spec["accepted_tokens"] > 0, spec  # drafts were used


def test_invoke_and_stream_give_equal_messages(smol_pair):
    llm = ChatSpecDecode(pair=smol_pair, max_tokens=16)
    invoked = llm.invoke(COPY_TASK)
    streamed = _streamed(llm, COPY_TASK)
    assert _without_ids(invoked) == _without_ids(streamed)
    # with a forced tool call: the same tool calls (or invalid calls) on both paths
    bound = llm.bind_tools([square, word_length], tool_choice="square")
    question = [HumanMessage("What is 7 squared?")]
    invoked, streamed = bound.invoke(question), _streamed(bound, question)
    assert invoked.tool_calls or invoked.invalid_tool_calls, invoked
    assert _without_ids(invoked) == _without_ids(streamed)
    for c in [*invoked.tool_calls, *invoked.invalid_tool_calls]:
        assert c["id"] and c["name"] == "square", c


def test_async_paths_match_sync(smol_pair):
    llm = ChatSpecDecode(pair=smol_pair, max_tokens=8)

    async def both():
        invoked = await llm.ainvoke("Say hi.")
        chunks = [c async for c in llm.astream("Say hi.")]
        return invoked, chunks

    invoked, chunks = asyncio.run(both())
    full = chunks[0]
    for c in chunks[1:]:
        full += c
    assert _without_ids(invoked) == _without_ids(full) == _without_ids(llm.invoke("Say hi."))


def test_metadata(smol_pair):
    llm = ChatSpecDecode(pair=smol_pair, max_tokens=6)
    reply = llm.invoke("Hello")
    usage = reply.usage_metadata
    assert usage["input_tokens"] > 0
    assert usage["output_tokens"] == reply.response_metadata["stats"]["output_tokens"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    assert usage["input_token_details"]["cache_read"] == reply.response_metadata["stats"]["cached_tokens"]
    meta = reply.response_metadata
    assert meta["model_name"] == "SmolLM2-135M-Instruct"
    assert meta["finish_reason"] in ("stop", "length")
    assert set(meta["speculative"]) == {
        "drafter",
        "draft_tokens",
        "accepted_tokens",
        "verify_steps",
        "acceptance_rate",
        "mean_acceptance_length",
        "acceptance_histogram",
        "accepted_per_position",
        "drafted_per_position",
        "source_steps",
        "source_draft_tokens",
        "source_accepted_tokens",
        "draft_failures",
        "draft_cooldown",
    }
    spec = meta["speculative"]
    assert spec["draft_failures"] == 0 and spec["draft_cooldown"] is None
    assert sum(spec["source_steps"].values()) == spec["verify_steps"]
    assert sum(spec["source_accepted_tokens"].values()) == spec["accepted_tokens"]
    # speculative=False: the same loop without drafts
    base = ChatSpecDecode(pair=smol_pair, max_tokens=6, speculative=False).invoke("Hello")
    assert base.response_metadata["speculative"]["draft_tokens"] == 0
    # the same prompt again: all of it but its last token (fed to give the first logits) is read back
    assert base.usage_metadata["input_token_details"]["cache_read"] == usage["input_tokens"] - 1
    assert base.content == reply.content


def test_stop_and_per_call_options(smol_pair):
    llm = ChatSpecDecode(pair=smol_pair, max_tokens=24)
    reply = llm.invoke(COPY_TASK, stop=["fox"])
    assert "fox" not in reply.content and reply.response_metadata["finish_reason"] == "stop"
    short = llm.invoke(COPY_TASK, max_tokens=3)
    assert short.usage_metadata["output_tokens"] <= 3 and short.response_metadata["finish_reason"] == "length"
    with pytest.raises(TypeError, match="max_new_tokens"):
        llm.invoke("hi", max_new_tokens=3)


def test_markup_never_streams_as_text(smol_pair):
    bound = ChatSpecDecode(pair=smol_pair, max_tokens=20).bind_tools([square, word_length], tool_choice="any")
    texts = [c.content for c in bound.stream("How long is the word 'banana'?")]
    assert "<tool_call>" not in "".join(texts) and "</tool_call>" not in "".join(texts), texts


class ScriptedChat(ChatSpecDecode):
    """Writes a scripted call into the reply (the 135M model cannot fill tool arguments yet).

    Tool choice is scripted per model call: the call with index i (counting earlier AI messages)
    starts its reply with the complete ``script[i]`` call; the model then decodes on from there,
    and everything else (rendering, parsing, chunks, tool execution, the answer) is the real path.
    """

    script: list = []

    def _prefill(self, messages, tools, tool_choice):
        i = sum(isinstance(m, AIMessage) for m in messages)
        if i < len(self.script):
            return tool_call_text(*self.script[i])
        return None


def test_agent_loop_with_two_tools(smol_pair):
    from langchain.agents import create_agent

    script = [("square", {"x": 12}), ("word_length", {"word": "banana"})]
    llm = ScriptedChat(pair=smol_pair, max_tokens=12, script=script)
    agent = create_agent(llm, tools=[square, word_length])
    out = agent.invoke({"messages": [HumanMessage("What is 12 squared, and how many letters has 'banana'?")]})
    messages = out["messages"]
    kinds = [type(m).__name__ for m in messages]
    assert kinds == ["HumanMessage", *["AIMessage", "ToolMessage"] * 2, "AIMessage"], kinds
    tool_results = [m for m in messages if isinstance(m, ToolMessage)]
    assert [m.content for m in tool_results] == ["144", "6"]  # the real Python tools ran on parsed args
    call_ids = [messages[i].tool_calls[0]["id"] for i in (1, 3)]
    assert [m.tool_call_id for m in tool_results] == call_ids
    answer = messages[-1]
    assert not answer.tool_calls and answer.response_metadata["finish_reason"] in ("stop", "length")


def test_prefix_cache_reads_the_earlier_turn(smol_pair):
    llm = ChatSpecDecode(pair=smol_pair, max_tokens=6)
    turn1 = [SystemMessage("You are a concise assistant for a bakery. " * 4), HumanMessage("Hi!")]
    first = llm.invoke(turn1)
    turn2 = [*turn1, first, HumanMessage("What do you sell?")]
    second = llm.invoke(turn2)
    # turn 1's prompt is a token prefix of turn 2's, so all of it comes back from the cache
    assert second.usage_metadata["input_token_details"]["cache_read"] >= first.usage_metadata["input_tokens"]
    cold = ChatSpecDecode(pair=smol_pair, max_tokens=6, prefix_cache=False).invoke(turn2)
    assert cold.usage_metadata["input_token_details"]["cache_read"] == 0
    assert cold.content == second.content  # reuse changes the cost, never the answer
