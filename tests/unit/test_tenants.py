"""What a pair keeps per namespace, in one store under a byte budget (``agentspec.drafters.tenants``).

The store as bookkeeping first (least recently used dropped first, the budget, the pinned default
namespace, threads), then the size estimate held to tracemalloc's count, then on tiny pairs: a
drafter's own failure rests it in its namespace only, an out-of-memory one for the whole pair; and
10,000 namespaces of one-token calls leave resident memory where 1,000 left it.
"""

from __future__ import annotations

import gc
import os
import random
import threading
import tracemalloc

import pytest
from conftest import noisy_copy

import agentspec
from agentspec.cache import PrefixCache
from agentspec.drafters.hybrid import DraftMemory
from agentspec.drafters.tenants import Tenant, TenantStore, estimate
from agentspec.models import ModelPair

pytestmark = pytest.mark.usefixtures("one_thread")

FRESH = estimate("a", Tenant(DraftMemory()))  # a one-letter namespace with nothing learned yet


def filled(store: TenantStore, namespace: str | None, tokens: int) -> None:
    """Give ``namespace`` an earlier output of ``tokens`` tokens, as a call's suffix drafter would."""
    memory = store.memory(namespace).store
    memory.append(memory.open(), list(range(tokens)))


def test_the_least_recently_used_namespace_goes_first():
    store = TenantStore(max_bytes=3 * FRESH)
    for ns in "abc":
        store.memory(ns)
    store.allow("a", "auto")  # any touch makes a namespace the most recently used
    assert store.namespaces() == ["b", "c", "a"]
    store.memory("d")  # a fourth: one over budget, and "b" is the oldest
    assert store.namespaces() == ["c", "a", "d"] and store.dropped == 1
    assert store.bytes == 3 * FRESH
    kept = store.memory("a")
    assert store.memory("a") is kept  # still held: the same memory
    store.memory("b")  # back, afresh: "c" goes
    assert store.namespaces() == ["d", "a", "b"] and store.dropped == 2


def test_the_budget_holds_as_memories_grow():
    store = TenantStore(max_bytes=20 * FRESH)
    for i in range(10):
        store.memory(f"{i}")
    assert store.dropped == 0
    # ~11 fresh tenants' worth, counted at its next touch (a call's end); then the oldest others go
    filled(store, "0", 100)
    assert store.bytes == 10 * FRESH  # not yet re-estimated
    store.record("0", "auto", failed=False)
    assert store.bytes <= store.max_bytes and "0" in store.namespaces()
    gone = store.dropped  # the oldest first, and no more than the budget needs
    assert gone >= 1 and store.namespaces() == [f"{i}" for i in range(1 + gone, 10)] + ["0"]
    assert store.bytes + FRESH > store.max_bytes
    held = [estimate(ns, store._tenants[ns]) for ns in store.namespaces()]
    assert store.bytes == sum(held), f"{store.bytes=} {held=}"
    assert store.drop("0") and not store.drop("0")
    assert store.bytes == (9 - gone) * FRESH


def test_the_default_namespace_is_never_dropped_nor_the_one_in_use():
    store = TenantStore(max_bytes=2 * FRESH)
    default = store.memory(None)
    for ns in "abcdef":
        store.memory(ns)
    assert store.namespaces() == [None, "f"]  # the default, oldest of all, is kept
    assert store.memory(None) is default
    filled(store, "g", 1000)  # alone over the budget: held while in use, the others but the default go
    store.memory("g")
    assert store.namespaces() == [None, "g"] and store.bytes > store.max_bytes


def test_threads_share_one_store():
    store = TenantStore(max_bytes=40 * FRESH)
    namespaces = [f"n{i}" for i in range(60)]
    errors: list[BaseException] = []
    start = threading.Barrier(4)
    first: list[DraftMemory] = []

    def work(seed: int) -> None:
        try:
            start.wait()
            first.append(store.memory("shared"))  # four threads ask for a new namespace at once
            start.wait()  # and all have it before any touches another
            rnd = random.Random(seed)
            for _ in range(2000):
                ns = rnd.choice(namespaces)
                op = rnd.randrange(4)
                if op == 0:
                    store.drop(ns)
                elif op == 1:
                    store.record(ns, "model", failed=rnd.random() < 0.5, oom=rnd.random() < 0.1)
                elif op == 2:
                    store.allow(ns, "model")
                else:
                    memory = store.memory(ns)
                    memory.store.append(memory.store.open(), [seed, 1, 2])
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors
    assert len(first) == 4 and all(m is first[0] for m in first), "one memory per namespace"
    held = sum(t.nbytes for t in store._tenants.values())
    assert store.bytes == held, f"{store.bytes=} {held=}"
    assert store.bytes <= store.max_bytes


def test_a_failure_rests_the_drafter_in_its_namespace_an_oom_in_every_one():
    store = TenantStore()
    store.shared.threshold = 2
    for _ in range(3):  # DraftHealth's default threshold: three calls in a row
        store.record("a", "model", failed=True)
    assert not store.allow("a", "model")  # resting in "a"
    assert store.allow("b", "model") and store.allow(None, "model") and store.allow("a", "suffix")
    for _ in range(2):
        store.record("b", "model", failed=True, oom=True)
    assert not store.allow("c", "model") and not store.allow(None, "model")  # the pair's draft model
    assert store.allow("c", "suffix")


def test_the_estimate_follows_tracemalloc():
    """A namespace with a full day's outputs: within 25% of what tracemalloc counts it holds."""
    rnd = random.Random(0)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store = TenantStore()
        memory = store.memory("tenant-7")
        for _ in range(150):  # outputs of 20 to 400 tokens, each a new int as a pass's .tolist() makes
            out = [rnd.randrange(5000) for _ in range(rnd.randrange(20, 400))]
            memory.store.append(memory.store.open(), out)
            memory.suffix_calibration.observe([rnd.random() for _ in range(4)], 2, [rnd.randrange(4)] * 4)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    store.record("tenant-7", "auto", failed=False)
    assert 0.75 * held <= store.bytes <= 1.25 * held, f"{store.bytes=} {held=}"


# --- on tiny pairs --------------------------------------------------------------------------------


class Boom(RuntimeError):
    pass


@pytest.mark.parametrize(
    ("message", "everywhere"), [("a shape mismatch", False), ("CUDA out of memory (simulated)", True)]
)
def test_a_drafters_own_failure_stays_in_its_namespace(target, tokenizer, message, everywhere):
    broken = noisy_copy(target, seed=1, noise=0.07)

    def forward(*args, **kwargs):
        raise Boom(message)

    broken.forward = forward
    pair = ModelPair(target=target, draft=broken, tokenizer=tokenizer, name="tiny-broken-draft")
    prompt = [3, 17, 5, 42, 9, 11, 7]
    opts = dict(max_new_tokens=4, prefix_cache=False, drafter="model")

    def call(namespace):
        stats = agentspec.generate(pair, prompt, namespace=namespace, **opts).stats
        return stats.draft_failures, stats.draft_cooldown

    assert [call("a") for _ in range(3)] == [(1, None)] * 3  # three in a row: "a" rests the drafter
    assert call("a") == (0, "model")
    # another namespace: its draft model is the same one, so an out-of-memory rests it there too
    assert call("b") == ((0, "model") if everywhere else (1, None))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads resident memory from /proc")
def test_ten_thousand_namespaces_leave_memory_flat(target, tokenizer):
    """Issue 27: one-token replies under 10,000 distinct namespaces (a server's salts), each saved to
    the prefix cache and given a drafting memory: resident memory after them is within 5% of what it
    was after the first 1,000, once the store and the cache are full."""
    cache = PrefixCache(budget_bytes=1 << 20)
    pair = ModelPair(target=target, tokenizer=tokenizer, name="tiny-tenants", prefix_cache=cache)
    pair.tenants.max_bytes = 256 << 10  # ~100 tenants of one short call: full long before 1,000

    def calls(start: int, stop: int) -> None:
        for i in range(start, stop):
            prompt = [1 + (i + j) % 60 for j in range(12)]
            for _ in agentspec.stream(pair, prompt, namespace=f"salt-{i}", max_new_tokens=1):
                pass

    calls(0, 1000)
    gc.collect()
    after_1k = rss_bytes()
    calls(1000, 10_000)
    gc.collect()
    after_10k = rss_bytes()
    assert after_10k <= 1.05 * after_1k, f"{after_1k=} {after_10k=}"
    assert pair.tenants.bytes <= pair.tenants.max_bytes and pair.tenants.dropped > 9000
    tree = cache.tree
    assert len(tree.roots) < 1000, len(tree.roots)  # emptied namespaces left no root behind
    tree.check()
