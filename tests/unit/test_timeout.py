"""``GenerationConfig.timeout``: a call that waits too long for the pair, or decodes too long, raises
``DecodeTimeout`` and leaves the pair, its lock and its prefix cache ready for the next call.

No timing thresholds: the wait is against a lock another thread holds until told to let go, and
the decode's deadline is 0 s (it passes during the first pass, which always runs; the check comes
before the second) against generations of many passes.
"""

from __future__ import annotations

import threading

import pytest

import agentspec
from agentspec import DecodeTimeout, GenerationConfig, ModelPair
from agentspec.cache import PrefixCache

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (conftest)

PROMPT = [5, 9, 11, 3, 5, 9, 11, 3, 7, 2, 40, 41]
N_NEW = 24  # far more tokens than one pass of 3 draft tokens can verify
OPTS = dict(max_new_tokens=N_NEW, num_draft_tokens=3, eos_token_ids=frozenset())


@pytest.fixture
def fresh(target, draft, tokenizer) -> ModelPair:
    """The conftest models in a pair of their own: its own lock and an empty prefix cache."""
    cache = PrefixCache(10**8)
    return ModelPair(target=target, draft=draft, tokenizer=tokenizer, key=("tiny",), prefix_cache=cache)


def _lock_is_free(lock: threading.RLock) -> bool:
    """Whether another thread can take ``lock`` (this thread could re-enter an RLock it leaked), within
    the turn the engine's thread may still be finishing (it takes the lock to end)."""
    free = []

    def take() -> None:
        got = lock.acquire(timeout=10)
        free.append(got)
        if got:
            lock.release()

    t = threading.Thread(target=take)
    t.start()
    t.join()
    return free == [True]


def _holder(lock: threading.RLock):
    """A thread that holds ``lock`` until the returned event is set (it has it when this returns)."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            held.set()
            release.wait()

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    return t, release


@pytest.mark.parametrize("timeout", [0, 0.05])
def test_a_held_lock_times_out_waiting_then_the_next_call_is_plain(fresh, hf_greedy, target, timeout):
    holder, release = _holder(fresh.lock)
    try:
        with pytest.raises(DecodeTimeout, match=r"waiting for the model: another call holds it") as err:
            agentspec.generate(fresh, PROMPT, "model", timeout=timeout, **OPTS)
        assert isinstance(err.value, TimeoutError)
        assert f"{timeout:g} s" in str(err.value)
        assert len(fresh.prefix_cache.tree) == 0  # nothing ran, nothing was saved
    finally:
        release.set()
        holder.join()
    assert _lock_is_free(fresh.lock)
    result = agentspec.generate(fresh, PROMPT, "model", timeout=600, **OPTS)
    assert result.token_ids == hf_greedy(target, PROMPT, N_NEW), f"{result.token_ids=}"


@pytest.mark.parametrize("drafter", ["model", "model_scheduled", "auto", "prompt_lookup", "none"])
def test_a_deadline_mid_decode_saves_the_verified_part_and_the_next_call_is_plain(
    fresh, hf_greedy, target, drafter
):
    reference = hf_greedy(target, PROMPT, N_NEW)
    steps = agentspec.stream(fresh, PROMPT, drafter, timeout=0, **OPTS)
    first = next(steps)  # the first pass always runs
    assert first.finish_reason is None and first.tokens == reference[: len(first.tokens)]
    with pytest.raises(DecodeTimeout, match=r"timed out decoding after 0 s") as err:
        next(steps)
    n = len(first.tokens)
    assert f"({n} output {'token' if n == 1 else 'tokens'} verified by then)" in str(err.value)
    assert _lock_is_free(fresh.lock)
    # as for a closed stream: the verified sequence minus its pending last token, for every model
    # the call used (a draft model caught up to the target's tokens)
    tree = fresh.prefix_cache.tree
    tree.check()
    verified = PROMPT + first.tokens[:-1]
    models = ["target"] if drafter in ("prompt_lookup", "none") else ["target", "draft"]
    found = tree.lookup_each(fresh.prefix_cache.namespace(fresh), PROMPT + reference, models)
    assert {name: n for name, (n, _) in found.items()} == dict.fromkeys(models, len(verified))
    # the next calls, untimed, give the plain output: the same prompt, and the conversation grown
    again = agentspec.generate(fresh, PROMPT, drafter, **OPTS)
    assert again.token_ids == reference, f"{again.token_ids=} {reference=}"
    grown = PROMPT + reference[:10]
    resumed = agentspec.generate(fresh, grown, drafter, **OPTS)
    assert resumed.token_ids == hf_greedy(target, grown, N_NEW)
    tree.check()


def test_a_sampled_call_after_a_timeout_draws_what_an_untimed_call_draws(fresh):
    options = dict(OPTS, temperature=0.9, seed=3)
    steps = agentspec.stream(fresh, PROMPT, "model", timeout=0, **options)
    next(steps)
    with pytest.raises(DecodeTimeout):
        next(steps)
    after = agentspec.generate(fresh, PROMPT, "model", **options)
    untimed = agentspec.generate(fresh, PROMPT, "model", prefix_cache=False, **options)
    assert after.token_ids == untimed.token_ids, f"{after.token_ids=} {untimed.token_ids=}"


def test_a_call_that_finishes_in_its_first_pass_returns_however_late(fresh, hf_greedy, target):
    result = agentspec.generate(fresh, PROMPT, "none", timeout=0, **dict(OPTS, max_new_tokens=1))
    assert result.finish_reason == "length" and result.token_ids == hf_greedy(target, PROMPT, 1)


@pytest.mark.parametrize(
    ("timeout", "error"),
    [(-1, ValueError), (float("inf"), ValueError), (float("nan"), ValueError)]
    + [("5", TypeError), (True, TypeError)],
)
def test_bad_timeouts_are_refused(timeout, error):
    with pytest.raises(error, match="timeout"):
        GenerationConfig(timeout=timeout)


def test_time_to_first_token_is_counted_once_from_the_calls_start(fresh):
    """One count, on one clock: the record's ``ttft_s`` is the stats' own, and both start when the call
    did, its wait for the pair included (another thread holds the lock until the call waits to join)."""
    held, waiting = threading.Event(), fresh.scheduler.stats.waiting
    results = []

    def call() -> None:
        run = agentspec.decode.run(fresh, PROMPT, None, False, speculative=False, **OPTS)
        for _ in run:
            pass
        results.append(run.close())

    with fresh.lock:
        worker = threading.Thread(target=call)
        worker.start()
        for _ in range(2000):  # the call waits to join (bounded)
            if fresh.scheduler.stats.waiting > waiting:
                break
            held.wait(0.005)
        held.wait(0.2)  # the call's wait for the pair: part of its time to first token
    worker.join(timeout=120)
    (record,) = results
    assert record.ttft_s == record.stats.time_to_first_token_s >= 0.2, record.ttft_s
    assert record.ttft_s <= record.decode_s
