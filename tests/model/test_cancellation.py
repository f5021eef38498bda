"""Calls abandoned midway leave the model and the prefix cache ready for the next call.

On the real embedded pair (target and distilled draft): a stream closed after two chunks, an
``ainvoke`` task cancelled while it decodes, and a callback handler that raises from
``on_llm_new_token`` (``raise_error=True``, so LangChain propagates it). After each, the same
prompt gives the reply it gave before any of them, the prefix tree's invariants hold
(``RadixCache.check``), and the pair's lock is free.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from langchain_core.callbacks import BaseCallbackHandler

import agentspec
from langchain_agentspec import ChatSpecDecode

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_thread")]

PROMPT = "List three uses of a paper clip, one per line."


@pytest.fixture(scope="module")
def llm():
    return ChatSpecDecode(pair=agentspec.load_pair(), max_tokens=24)


@pytest.fixture(scope="module")
def reference(llm):
    return llm.invoke(PROMPT).content


def _ready(llm, reference):
    llm.pair.prefix_cache.tree.check()
    free = llm.pair.lock.acquire(timeout=60)  # a worker thread may still be finishing its pass
    assert free, "the pair's lock was not released"
    llm.pair.lock.release()
    assert llm.invoke(PROMPT).content == reference
    llm.pair.prefix_cache.tree.check()


def test_a_stream_closed_after_two_chunks(llm, reference):
    it = llm.stream(PROMPT)
    next(it), next(it)
    it.close()
    _ready(llm, reference)


def test_an_ainvoke_cancelled_while_it_decodes(llm, reference):
    started = threading.Event()

    class Started(BaseCallbackHandler):
        def on_llm_new_token(self, token, **kwargs):
            started.set()

    async def main():
        task = asyncio.create_task(llm.ainvoke(PROMPT, config={"callbacks": [Started()]}))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await llm.ainvoke(PROMPT)

    assert asyncio.run(main()).content == reference
    _ready(llm, reference)


def test_a_callback_that_raises(llm, reference):
    class Raises(BaseCallbackHandler):
        raise_error = True

        def __init__(self):
            self.tokens = 0

        def on_llm_new_token(self, token, **kwargs):
            self.tokens += 1
            if self.tokens == 2:
                raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        for _ in llm.stream(PROMPT, config={"callbacks": [Raises()]}):
            pass
    _ready(llm, reference)


@pytest.mark.parametrize("how", ["ainvoke", "astream"])
def test_a_cancelled_call_stops_decoding_within_one_pass(llm, reference, how):
    """Once the cancelled task has ended, the pair runs at most one more pass for it (the one in
    progress), though its reply had hundreds of tokens left."""
    long = ChatSpecDecode(pair=llm.pair, max_tokens=400)
    stats = llm.pair.scheduler.stats
    started = threading.Event()

    class Started(BaseCallbackHandler):
        def on_llm_new_token(self, token, **kwargs):
            started.set()

    async def consume():
        async for _ in long.astream(PROMPT, config={"callbacks": [Started()]}):
            pass

    async def main() -> tuple[int, int]:
        before = stats.passes
        call = long.ainvoke(PROMPT, config={"callbacks": [Started()]}) if how == "ainvoke" else consume()
        task = asyncio.create_task(call)
        while not started.is_set():
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return before, stats.passes

    before, at_cancel = asyncio.run(main())
    assert at_cancel - before < 80, "the reply was not cut short: 400 tokens take 80 passes or more"
    free = llm.pair.lock.acquire(timeout=60)
    assert free, "the pair's lock was not released"
    llm.pair.lock.release()
    assert stats.passes - at_cancel <= 1, f"{stats.passes - at_cancel} passes after the cancellation"
    _ready(llm, reference)
