"""``agentspec.decode.prefill``: a prompt's state put in the prefix cache once, for the calls after it
(the server's n choices of one request): they restore it instead of computing it, and decode exactly
what they would have without it."""

from __future__ import annotations

import threading

import pytest

import agentspec
from agentspec.cache import PrefixCache
from agentspec.decode import prefill

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [5, 9, 2, 7, 7, 1, 3, 3, 8, 4] * 6


def test_the_calls_after_a_prefill_restore_the_prompt(pair):
    cold = agentspec.generate(pair, PROMPT, "model", False, max_new_tokens=12)
    cache = PrefixCache(16 << 20)
    assert prefill(pair, PROMPT, cache) == (0, len(PROMPT) - 1)
    assert prefill(pair, PROMPT, cache) == (len(PROMPT) - 1, 0)  # nothing left to compute
    for seed in range(3):
        r = agentspec.generate(pair, PROMPT, "model", cache, max_new_tokens=12, temperature=0.9, seed=seed)
        assert r.stats.cached_tokens == len(PROMPT) - 1 and r.stats.prefill_tokens == 1
    warm = agentspec.generate(pair, PROMPT, "model", cache, max_new_tokens=12)
    assert warm.token_ids == cold.token_ids


def test_without_a_cache_nothing_is_computed(pair):
    assert prefill(pair, PROMPT, False) == (0, 0)


def test_a_prefill_beside_a_decoding_call_goes_in_chunks(pair):
    """With a call decoding, the prompt is fed a chunk at a time between its passes; the call's
    output is what it is alone."""
    alone = agentspec.generate(pair, PROMPT[:12], "none", False, max_new_tokens=40)
    cache = PrefixCache(16 << 20)
    chunk, pair.scheduler.prefill_chunk = pair.scheduler.prefill_chunk, 8
    try:
        steps = agentspec.stream(pair, PROMPT[:12], "none", False, max_new_tokens=40)
        first = next(steps)  # the call is running
        done = threading.Event()
        worker = threading.Thread(target=lambda: (prefill(pair, PROMPT, cache), done.set()))
        worker.start()
        rest = [first, *steps]
        worker.join(timeout=60)
    finally:
        pair.scheduler.prefill_chunk = chunk
    assert done.is_set()
    assert [t for s in rest for t in s.tokens] == alone.token_ids
    assert (
        agentspec.generate(pair, PROMPT, "none", cache, max_new_tokens=2).stats.cached_tokens
        == len(PROMPT) - 1
    )
