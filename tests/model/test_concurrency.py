"""One ChatSpecDecode shared by many threads and tasks: every reply equals its sequential one.

On the real embedded pair, with a prefix cache small enough to evict under the load: 8 threads x
20 mixed calls (invoke, a full stream, a stream abandoned after two chunks; drafters auto,
suffix, prompt lookup, the draft model and none; prompts sharing a system prompt) and 50
concurrent ``ainvoke`` calls. Each reply is compared with the same request made alone, before,
on a plain (non-speculative, no-cache) instance; no call may hang, and the cache never holds
more than its budget. Calls share the pair's passes (its scheduler, docs/batching.md), so this
proves that calls decoded together never leak state from one call into another.
"""

from __future__ import annotations

import asyncio
import random
import threading

import pytest
from langchain_core.messages import HumanMessage, SystemMessage

import agentspec
from langchain_agentspec import ChatSpecDecode

pytestmark = pytest.mark.model  # torch's default threads: one call runs at a time anyway

BUDGET = 4 << 20  # about 90 tokens of target KV (46 kB a token): less than the prompts below need
SYSTEM = (
    "You are a concise assistant for a travel agency. Answer in one short sentence. "
    "Prices are in euros. The agency sells trains, flights and hotel rooms in Europe. "
    "Never invent a booking reference; ask the customer for it instead."
)
QUESTIONS = [
    "What is the capital of Portugal?",
    "Name a city in Italy with canals.",
    "Is a night train slower than a flight?",
    "What should I pack for Oslo in winter?",
    "Which is bigger, Lyon or Paris?",
]
DRAFTERS = ["auto", "suffix", "prompt_lookup", "model", "none"]
KINDS = ["invoke", "stream", "abandon"]


def _messages(q: int):
    return [SystemMessage(SYSTEM), HumanMessage(QUESTIONS[q])]


def _reply(llm, kind: str, q: int, drafter: str):
    """The reply's text."""
    if kind == "invoke":
        return llm.invoke(_messages(q), drafter=drafter).content
    chunks = llm.stream(_messages(q), drafter=drafter)
    text = ""
    for i, chunk in enumerate(chunks):
        text += chunk.content
        if kind == "abandon" and i == 1:
            chunks.close()
            break
    return text


@pytest.fixture(scope="module")
def pair():
    return agentspec.load_pair(prefix_cache_bytes=BUDGET)


@pytest.fixture(scope="module")
def expected(pair):
    """Each request alone on a plain instance: no draft, no cache (the sequential counterpart)."""
    plain = ChatSpecDecode(pair=pair, max_tokens=8, speculative=False, prefix_cache=False)
    return [_reply(plain, "invoke", q, "none") for q in range(len(QUESTIONS))]


def _check(expected, kind, q, got):
    if kind == "abandon":
        assert expected[q].startswith(got), (q, got, expected[q])
    else:
        assert got == expected[q], (kind, q)


def test_eight_threads_of_mixed_calls_match_their_sequential_replies(pair, expected):
    llm = ChatSpecDecode(pair=pair, max_tokens=8)
    failures: list[BaseException] = []
    done = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(20):
                kind, q, drafter = rng.choice(KINDS), rng.randrange(len(QUESTIONS)), rng.choice(DRAFTERS)
                _check(expected, kind, q, _reply(llm, kind, q, drafter))
                # under the tree's lock: read without it, bytes_used may catch another thread's
                # insert between adding its segments and evicting (4.42 MB once, on an AMD EPYC)
                assert pair.prefix_cache.tree.within_budgets()
                done.append(kind)
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not [t for t in threads if t.is_alive()], "a thread is stuck (deadlock?)"
    if failures:
        raise failures[0]
    assert len(done) == 160 and set(done) == set(KINDS)
    assert pair.prefix_cache.tree.evictions > 0  # the budget was binding
    pair.prefix_cache.tree.check()
    assert pair.prefix_cache.bytes_used <= BUDGET


def test_fifty_concurrent_ainvoke_calls_match(pair, expected):
    llm = ChatSpecDecode(pair=pair, max_tokens=8)
    requests = [(i % len(QUESTIONS), DRAFTERS[i % len(DRAFTERS)]) for i in range(50)]

    async def main():
        calls = [llm.ainvoke(_messages(q), drafter=d) for q, d in requests]
        return await asyncio.wait_for(asyncio.gather(*calls), timeout=600)

    replies = asyncio.run(main())
    for (q, _), msg in zip(requests, replies, strict=True):
        _check(expected, "invoke", q, msg.content)
    pair.prefix_cache.tree.check()
    assert pair.prefix_cache.bytes_used <= BUDGET
