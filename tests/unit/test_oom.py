"""Out of memory: a target pass that fails with a (simulated) device OOM is retried after freeing the
prefix cache, and the reply is the one the call gives without the fault; a fault that persists ends
in ``DeviceOutOfMemory`` after ``OOM_ATTEMPTS`` tries, and the next call is correct.

The fault is injected in the target's final norm (raising ``torch.OutOfMemoryError`` as CUDA's
allocator does), at a chosen pass, so prefill and verify passes are both covered.
"""

from __future__ import annotations

import pytest
import torch

import agentspec
from agentspec import memory
from agentspec.cache import PrefixCache
from agentspec.kv import ModelState
from agentspec.memory import DeviceOutOfMemory, forward_retrying, is_oom
from agentspec.models import ModelPair

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = [3, 17, 5, 42, 9, 11, 7, 3, 17, 5]


@pytest.fixture(autouse=True)
def no_wait(monkeypatch):
    monkeypatch.setattr(memory, "wait_exponential", lambda **_: lambda _state: 0.0)


def faulty(monkeypatch, model, fail_at: set[int]):
    """Make ``model``'s passes raise an OOM on the passes numbered in ``fail_at`` (0-based), at the
    final norm, which every forward (the lean one, transformers') calls once a pass after its layers
    have written their keys and values: a failed pass leaves them for the roll-back to undo."""
    norm = model.model.norm
    real = norm.forward
    calls = []

    def forward(x):
        calls.append(x.shape[1])
        if len(calls) - 1 in fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return real(x)

    monkeypatch.setattr(norm, "forward", forward)
    return calls


def test_is_oom():
    assert is_oom(torch.OutOfMemoryError("x"))
    assert is_oom(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert is_oom(
        RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory")
    )
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("out of memory"))  # only allocator errors
    assert isinstance(
        DeviceOutOfMemory("x"), torch.OutOfMemoryError
    )  # callers catching torch's still catch it


def test_forward_retrying_recomputes_the_same_logits(monkeypatch, target):
    state = ModelState(target)
    state.forward([3, 17, 5, 42], keep=1)
    expected = ModelState(target)
    want = expected.forward([3, 17, 5, 42, 9, 11], keep=2)

    calls = faulty(monkeypatch, target, {0})
    freed = []
    got = forward_retrying(state, [9, 11], 2, free=lambda: freed.append(1))
    assert calls == [2, 2]  # the failed pass, then that pass again (the state was rolled back to before it)
    assert freed == [1]
    assert state.ids == [3, 17, 5, 42, 9, 11]
    torch.testing.assert_close(got, want)


def test_a_retried_pass_returns_the_new_tokens_hidden_states(monkeypatch, target):
    """An EAGLE head reads the pass's hidden states: after a retry, still those of the new tokens."""
    state = ModelState(target)
    state.forward([3, 17, 5, 42], keep=1)
    want_logits, want_hidden = ModelState(target).forward([3, 17, 5, 42, 9, 11], keep=2, features=(-1,))
    faulty(monkeypatch, target, {0})
    logits, hidden = forward_retrying(state, [9, 11], 2, features=(-1,))
    torch.testing.assert_close(logits, want_logits)
    torch.testing.assert_close(hidden, want_hidden[-2:])


def test_forward_retrying_gives_up_with_a_clear_error(monkeypatch, target):
    state = ModelState(target)
    calls = faulty(monkeypatch, target, set(range(100)))
    freed = []
    with pytest.raises(DeviceOutOfMemory, match=r"3 attempts, the prefix cache freed.*shorter prompt"):
        forward_retrying(state, [3, 17, 5], 1, free=lambda: freed.append(1))
    assert len(calls) == memory.OOM_ATTEMPTS and len(freed) == memory.OOM_ATTEMPTS - 1
    assert state.ids == [] and state.cache.get_seq_length() == 0  # clean, usable


def test_other_errors_are_not_retried(monkeypatch, target):
    real = target.forward
    calls = []

    def forward(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("shape mismatch")

    monkeypatch.setattr(target, "forward", forward)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        forward_retrying(ModelState(target), [3, 17], 1)
    assert calls == [1]
    monkeypatch.setattr(target, "forward", real)


def _pair(target, draft, tokenizer, name):
    return ModelPair(
        target=target, draft=draft, tokenizer=tokenizer, name=name, prefix_cache=PrefixCache(64 << 20)
    )


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("fail_at", [0, 3], ids=["prefill", "verify"])
def test_an_oom_pass_is_retried_and_the_reply_does_not_change(
    monkeypatch, target, draft, tokenizer, temperature, fail_at
):
    opts = dict(max_new_tokens=16, temperature=temperature, seed=7, drafter="model")
    clean = _pair(target, draft, tokenizer, "tiny-clean")
    agentspec.generate(clean, PROMPT, **opts)  # fills the cache; the next call reuses it
    want = agentspec.generate(clean, PROMPT + [42], **opts)

    pair = _pair(target, draft, tokenizer, "tiny-oom")
    agentspec.generate(pair, PROMPT, **opts)
    assert pair.prefix_cache.bytes_used > 0
    calls = faulty(monkeypatch, target, {fail_at})
    got = agentspec.generate(pair, PROMPT + [42], **opts)
    assert got.token_ids == want.token_ids and got.text == want.text
    assert len(calls) >= fail_at + 2  # the failed pass was run again
    assert got.stats.draft_failures == 0
    # both calls restored the first call's prompt (the longest a prompt one token longer can reuse);
    # an OOM in the prefill frees the cache's tree, not the state already restored from it
    assert got.stats.cached_tokens == want.stats.cached_tokens == len(PROMPT)
    pair.prefix_cache.tree.check()


def test_a_persistent_oom_raises_and_the_next_call_is_correct(monkeypatch, target, draft, tokenizer):
    opts = dict(max_new_tokens=16, drafter="model")
    pair = _pair(target, draft, tokenizer, "tiny-oom-persistent")
    want = agentspec.generate(pair, PROMPT, **opts).token_ids
    real = target.model.norm.forward
    faulty(monkeypatch, target, set(range(2, 100)))
    clear, cleared = pair.prefix_cache.clear, []
    monkeypatch.setattr(pair.prefix_cache, "clear", lambda: (cleared.append(1), clear()))
    with pytest.raises(DeviceOutOfMemory):
        agentspec.generate(pair, PROMPT + [42], **opts)
    assert len(cleared) == memory.OOM_ATTEMPTS - 1  # freed before each retry
    # what the call verified before the failing pass was rolled back to, saved: a whole tree
    pair.prefix_cache.tree.check()
    monkeypatch.setattr(target.model.norm, "forward", real)  # the fault gone
    assert pair.lock.acquire(blocking=False)
    pair.lock.release()
    assert agentspec.generate(pair, PROMPT, **opts).token_ids == want


def test_a_draft_oom_falls_back_to_the_target(monkeypatch, target, draft, tokenizer):
    opts = dict(max_new_tokens=16, drafter="model", prefix_cache=False)
    pair = _pair(target, draft, tokenizer, "tiny-draft-oom")
    plain = agentspec.generate(pair, PROMPT, speculative=False, **opts).token_ids
    faulty(monkeypatch, draft, {1})
    got = agentspec.generate(pair, PROMPT, **opts)
    assert got.token_ids == plain
    assert got.stats.draft_failures == 1


@pytest.mark.parametrize("method", ["restore", "save"])
def test_an_oom_copying_the_prefix_cache_clears_it_and_the_reply_stands(
    monkeypatch, target, draft, tokenizer, method
):
    opts = dict(max_new_tokens=16, drafter="model")
    pair = _pair(target, draft, tokenizer, f"tiny-cache-oom-{method}")
    want = agentspec.generate(pair, PROMPT, **opts).token_ids
    assert pair.prefix_cache.bytes_used > 0

    def fail(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(pair.prefix_cache, method, fail)
    got = agentspec.generate(pair, PROMPT, **opts)
    assert got.token_ids == want
    if method == "restore":  # cleared, prefilled in full, then saved again
        assert got.stats.cached_tokens == 0 and pair.prefix_cache.bytes_used > 0
    else:
        assert got.stats.cached_tokens > 0 and pair.prefix_cache.bytes_used == 0
    monkeypatch.undo()
    assert agentspec.generate(pair, PROMPT, **opts).token_ids == want
    assert pair.prefix_cache.bytes_used > 0
