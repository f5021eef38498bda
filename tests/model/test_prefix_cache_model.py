"""The prefix cache on the real embedded model: a 6-call agent conversation, cache on and off."""

from __future__ import annotations

import pytest

import agentspec
from agentspec.bench.conversation import messages_for_call, prompt_ids
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
