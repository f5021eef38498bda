"""The prefix cache on the real embedded model: a 6-call agent conversation, cache on and off."""

from __future__ import annotations

import pytest

import agentspec
from agentspec.bench.conversation import (
    OPENAI_TOOLS,
    bound_messages_for_call,
    messages_for_call,
    prompt_ids,
    tool_choice_for_call,
)
from agentspec.chat import parse_reply
from agentspec.chat.request import prepare
from agentspec.kv import common_prefix_len

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def pair():
    return agentspec.load_pair(prefix_cache_bytes=2 << 30)


def test_agent_conversation_same_with_and_without_cache(pair):
    answers: list[str] = []
    saved: list[list[int]] = []  # what the tree holds after each call: prompt + output minus last
    for n in range(6):
        ids = prompt_ids(pair.tokenizer, messages_for_call(n, answers))
        if n == 0:
            assert len(ids) > 1000, "the conversation must sit on a 1,000+ token prefix"
        on = agentspec.generate(pair, ids, max_new_tokens=16)
        off = agentspec.generate(pair, ids, max_new_tokens=16, prefix_cache=False)
        assert on.token_ids == off.token_ids, f"call {n}: {on.text=} {off.text=}"
        expected = max((common_prefix_len(s, ids[:-1]) for s in saved), default=0)
        assert on.stats.cached_tokens == expected, f"call {n}: {on.stats.cached_tokens=} {expected=}"
        assert on.stats.prefill_tokens == len(ids) - expected
        if n > 0:
            assert expected > 1000, f"call {n} restored only {expected} tokens"
        saved.append(ids + on.token_ids[:-1])
        answers.append(on.text)
    pair.prefix_cache.tree.check()


def test_tool_binding_conversation_same_with_and_without_cache(pair):
    # tools bound, replies under their grammar, calls parsed and answered: the prompt is re-rendered
    # from parsed messages each call, and the cache still restores most of it
    replies: list[dict] = []
    for n in range(4):
        msgs = bound_messages_for_call(n, replies)
        req = prepare(pair.tokenizer, msgs, OPENAI_TOOLS, tool_choice_for_call(n))
        ids = req.prompt.ids
        out = {}
        for cache in (True, False):
            out[cache] = agentspec.generate(
                pair, ids, prefix_cache=cache, grammar=req.constraint(pair), max_new_tokens=40
            )
        assert out[True].token_ids == out[False].token_ids, f"call {n}: {out[True].text=} {out[False].text=}"
        if n > 0:
            restored = out[True].stats.cached_tokens
            assert restored > 0.8 * len(ids), f"call {n}: {restored=} {len(ids)=}"
        reply = parse_reply(req.prompt.forced + out[True].text, req.tool_names)
        msg = {"role": "assistant", "content": reply.content, "tool_calls": reply.tool_calls}
        replies.append(msg | {"invalid_tool_calls": reply.invalid_tool_calls})
    pair.prefix_cache.tree.check()
