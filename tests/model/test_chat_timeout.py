"""``ChatSpecDecode(timeout=...)`` on the real embedded pair: a call that waits too long for the model,
or decodes too long, raises ``agentspec.DecodeTimeout`` (a ``TimeoutError``), its span records the
error, and the next call gives the reply an untimed instance gives.

No timing thresholds: the wait is against a lock another thread holds until told to let go, and
the decode's deadline is 0 s (the first pass always runs, and the reply needs many more).
"""

from __future__ import annotations

import asyncio
import threading

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

import agentspec
from agentspec.telemetry import attributes as A
from langchain_agentspec import ChatSpecDecode

pytestmark = [pytest.mark.model, pytest.mark.usefixtures("one_thread")]

PROMPT = "List three uses of a paper clip, one per line."
MAX_TOKENS = 40  # more than one pass can verify (at most a drafter's cap + 1 tokens)


@pytest.fixture(scope="module")
def pair():
    return agentspec.load_pair()


@pytest.fixture(scope="module")
def reference(pair):
    """The untimed instance's reply."""
    return ChatSpecDecode(pair=pair, max_tokens=MAX_TOKENS).invoke(PROMPT).content


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter, provider
    provider.shutdown()


def _lock_is_free(lock) -> bool:
    """Whether another thread can take the pair's lock now (this thread could re-enter a leaked one)."""
    free = []

    def take() -> None:
        got = lock.acquire(timeout=60)  # an async call's worker thread may still be finishing
        free.append(got)
        if got:
            lock.release()

    t = threading.Thread(target=take)
    t.start()
    t.join()
    return free == [True]


def _held(lock):
    """A thread holding ``lock`` (it has it when this returns) until the returned event is set."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait()

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    return t, release


def test_invoke_times_out_decoding_then_the_next_call_is_the_untimed_reply(pair, reference, spans):
    exporter, provider = spans
    llm = ChatSpecDecode(pair=pair, max_tokens=MAX_TOKENS, timeout=0, tracer_provider=provider)
    with pytest.raises(TimeoutError, match=r"timed out decoding after 0 s") as err:
        llm.invoke(PROMPT)
    assert type(err.value) is agentspec.DecodeTimeout
    (span,) = exporter.get_finished_spans()
    assert span.attributes[A.ERROR_TYPE] == "DecodeTimeout"
    assert span.status.status_code == StatusCode.ERROR
    assert _lock_is_free(pair.lock)
    pair.prefix_cache.tree.check()
    assert llm.invoke(PROMPT, timeout=None).content == reference  # the per-call override: no limit
    with pytest.raises(agentspec.DecodeTimeout):
        ChatSpecDecode(pair=pair, max_tokens=MAX_TOKENS).invoke(PROMPT, timeout=0)  # and the other way
    assert ChatSpecDecode(pair=pair, max_tokens=MAX_TOKENS, timeout=600).invoke(PROMPT).content == reference


def test_invoke_times_out_waiting_for_a_held_model(pair, reference):
    llm = ChatSpecDecode(pair=pair, max_tokens=MAX_TOKENS, timeout=0.05)
    holder, release = _held(pair.lock)
    try:
        with pytest.raises(agentspec.DecodeTimeout, match="waiting for the model: another call holds it"):
            llm.invoke(PROMPT)
    finally:
        release.set()
        holder.join()
    assert llm.invoke(PROMPT, timeout=None).content == reference


def test_astream_times_out_waiting_and_decoding_then_the_next_call_is_the_untimed_reply(pair, reference):
    waiting = ChatSpecDecode(pair=pair, max_tokens=MAX_TOKENS, timeout=0.05)
    decoding = ChatSpecDecode(pair=pair, max_tokens=MAX_TOKENS, timeout=0)

    async def collect(llm, **kwargs) -> str:
        return "".join([chunk.content async for chunk in llm.astream(PROMPT, **kwargs)])

    async def main() -> tuple[list[str], str]:
        holder, release = _held(pair.lock)
        try:
            with pytest.raises(agentspec.DecodeTimeout, match="waiting for the model"):
                await collect(waiting)
        finally:
            release.set()
            holder.join()
        texts = []  # what the timed-out stream showed before its error
        with pytest.raises(TimeoutError, match="decoding"):
            async for chunk in decoding.astream(PROMPT):
                texts.append(chunk.content)
        return texts, await collect(decoding, timeout=None)

    shown, after = asyncio.run(main())
    assert reference.startswith("".join(shown)) and len("".join(shown)) < len(reference)
    assert after == reference
    assert _lock_is_free(pair.lock)
    pair.prefix_cache.tree.check()
