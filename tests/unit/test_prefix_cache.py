"""The cross-call prefix cache: same outputs as without it, budget kept, safe under threads."""

from __future__ import annotations

import random
import threading
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import agentspec
import agentspec.kv
from agentspec.cache import PrefixCache, RadixCache
from agentspec.cache.radix import segment_bytes
from agentspec.models import ModelPair

VOCAB = 64


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one torch thread (conftest)


@pytest.fixture(scope="module")
def models(tiny_llama, fake_tokenizer):
    return tiny_llama(0, max_positions=1024), tiny_llama(1, max_positions=1024), fake_tokenizer(VOCAB, 1)


def make_pair(models, budget=10**8) -> ModelPair:
    target, draft, tokenizer = models
    return ModelPair(
        target=target,
        draft=draft,
        tokenizer=tokenizer,
        key=("tiny-target", "tiny-draft"),
        prefix_cache=PrefixCache(budget),
    )


OPTS = dict(max_new_tokens=10, num_draft_tokens=3, eos_token_ids=frozenset())


def conversation(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(2, VOCAB) for _ in range(length)]


@pytest.mark.parametrize("drafter", ["model", "prompt_lookup", "none"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_cache_gives_same_output_as_no_cache(models, drafter, temperature):
    pair = make_pair(models)
    rng = random.Random(zlib.crc32(f"{drafter} {temperature}".encode()))  # hash() of a str varies per process
    base = conversation(rng, 40)
    first = agentspec.generate(pair, base, drafter, temperature=temperature, seed=1, **OPTS)
    answer = first.token_ids
    # name -> prompt; each is checked with and without the cache, in this order
    calls = [
        ("grown conversation", base + answer + conversation(rng, 7)),
        ("prefix ends mid-answer", base + answer[: len(answer) // 2]),
        ("strict prefix of a cached one", base[:25]),
        ("diverges at the first token", [(base[0] + 1) % (VOCAB - 2) + 2] + base[1:]),
        ("repeat of an earlier prompt", base),
        ("one-token prompt", base[:1]),
    ]
    for i, (name, prompt) in enumerate(calls):
        kw = dict(temperature=temperature, seed=10 + i, **OPTS)
        cached = agentspec.generate(pair, prompt, drafter, **kw)
        fresh = agentspec.generate(pair, prompt, drafter, prefix_cache=False, **kw)
        assert cached.token_ids == fresh.token_ids, f"{name}: {cached.token_ids=} {fresh.token_ids=}"
        assert fresh.stats.cached_tokens == 0
    pair.prefix_cache.tree.check()


def test_cache_read_counts_follow_the_tree(models):
    pair = make_pair(models)
    rng = random.Random(7)
    prompt = conversation(rng, 50)
    r1 = agentspec.generate(pair, prompt, "none", **OPTS)
    assert r1.stats.cached_tokens == 0 and r1.stats.prefill_tokens == 50
    # the cache holds the prompt and the verified answer except its last token (never fed)
    grown = prompt + r1.token_ids + conversation(rng, 5)
    r2 = agentspec.generate(pair, grown, "none", **OPTS)
    expected = len(prompt) + len(r1.token_ids) - 1
    assert r2.stats.cached_tokens == expected, f"{r2.stats.cached_tokens=} {expected=}"
    assert r2.stats.prefill_tokens == len(grown) - expected
    # a strict prefix restores all of it but its last token, which must be fed for its logits
    r3 = agentspec.generate(pair, prompt[:30], "none", **OPTS)
    assert r3.stats.cached_tokens == 29


def test_draft_and_target_restored_to_the_same_tokens(models):
    pair = make_pair(models)
    rng = random.Random(3)
    prompt = conversation(rng, 30)
    r1 = agentspec.generate(pair, prompt, "model", **OPTS)
    n, segs = pair.prefix_cache.tree.lookup(
        pair.prefix_cache.namespace(pair), prompt + r1.token_ids, ["target", "draft"]
    )
    assert n == len(prompt) + len(r1.token_ids) - 1
    assert segs["target"][0][0].shape[2] == segs["draft"][0][0].shape[2] == n
    # a call without the draft model reuses the target's entries alone
    r2 = agentspec.generate(pair, prompt + r1.token_ids, "prompt_lookup", **OPTS)
    assert r2.stats.cached_tokens == n


def test_a_draft_that_covers_less_does_not_hold_the_target_back(models):
    # a scheduled draft that sat out part of a call saves a shorter prefix than the target
    pair = make_pair(models)
    rng = random.Random(5)
    prompt = conversation(rng, 40)
    ns, tree = pair.prefix_cache.namespace(pair), pair.prefix_cache.tree
    first = agentspec.generate(pair, prompt, "none", **OPTS)  # the target's KV for prompt + output
    seen = prompt + first.token_ids
    draft_state = agentspec.kv.ModelState(models[1])
    draft_state.forward(seen[:15], keep=1)
    tree.insert(ns, seen[:15], "draft", [(layer.keys, layer.values) for layer in draft_state.cache.layers])
    states = pair.prefix_cache.restore(pair, seen, {"target": models[0], "draft": models[1]})
    assert len(states["target"].ids) == len(seen) - 1 and states["draft"].ids == seen[:15]
    for temperature in (0.0, 0.9):  # the draft feeds its gap when it drafts: outputs unchanged
        kw = dict(temperature=temperature, seed=3, **OPTS)
        cached = agentspec.generate(pair, seen, "model", **kw)
        fresh = agentspec.generate(pair, seen, "model", prefix_cache=False, **kw)
        assert cached.token_ids == fresh.token_ids
        assert cached.stats.cached_tokens == len(seen) - 1
    tree.check()


def test_budget_is_never_exceeded(models):
    budget = 200_000  # a 2-layer tiny model stores 1 KiB per token: room for ~200 tokens
    pair = make_pair(models, budget=budget)
    rng = random.Random(11)
    for i in range(200):
        prompt = conversation(rng, rng.randrange(5, 60))
        agentspec.generate(pair, prompt, "none", max_new_tokens=2, eos_token_ids=frozenset())
        measured = sum(
            k.numel() * k.element_size() + v.numel() * v.element_size()
            for node in pair.prefix_cache.tree._nodes()
            for seg in node.kv.values()
            for k, v in seg
        )
        assert measured <= budget, f"call {i}: {measured=} > {budget=}"
        assert measured == pair.prefix_cache.bytes_used
    assert pair.prefix_cache.tree.evictions > 0
    pair.prefix_cache.tree.check()


def test_abandoned_stream_leaves_cache_usable(models):
    pair = make_pair(models)
    rng = random.Random(5)
    prompt = conversation(rng, 40)
    it = agentspec.stream(pair, prompt, "model", max_new_tokens=30, num_draft_tokens=3)
    got = []
    for step in it:
        got += step.tokens
        if len(got) >= 3:
            break
    it.close()  # abandoned after 3+ tokens: the lock is released, what was verified is saved
    pair.prefix_cache.tree.check()
    cached = agentspec.generate(pair, prompt + got, "model", **OPTS)
    fresh = agentspec.generate(pair, prompt + got, "model", prefix_cache=False, **OPTS)
    assert cached.token_ids == fresh.token_ids
    assert cached.stats.cached_tokens >= len(prompt)


def test_failed_call_leaves_cache_consistent(models):
    pair = make_pair(models)
    prompt = conversation(random.Random(2), 20)
    with pytest.raises(ValueError, match="temperature"):
        agentspec.generate(pair, prompt, temperature=-1.0)
    with pytest.raises(ValueError, match="prompt"):
        agentspec.generate(pair, [VOCAB + 5])
    r = agentspec.generate(pair, prompt, **OPTS)
    assert r.token_ids == agentspec.generate(pair, prompt, prefix_cache=False, **OPTS).token_ids
    pair.prefix_cache.tree.check()


def test_threads_share_one_pair(models):
    pair = make_pair(models, budget=150_000)
    rng = random.Random(9)
    system = conversation(rng, 30)
    prompts = [system + conversation(rng, rng.randrange(1, 20)) for _ in range(40)]
    expected = [agentspec.generate(pair, p, "model", prefix_cache=False, **OPTS).token_ids for p in prompts]
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            for i in range(w, len(prompts), 8):  # 8 threads x 5 calls
                if i % 2:
                    results[i] = agentspec.generate(pair, prompts[i], "model", **OPTS).token_ids
                else:
                    steps = agentspec.stream(pair, prompts[i], "model", **OPTS)
                    results[i] = [t for s in steps for t in s.tokens]
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads), "deadlock"
    assert not errors, errors
    for i, exp in enumerate(expected):
        assert results[i] == exp, f"call {i}"
    assert pair.prefix_cache.bytes_used <= 150_000
    pair.prefix_cache.tree.check()


# --- the radix tree alone, against a simple reference model -------------------------------------


def fake_kv(ids: list[int], layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KV whose value at position i is ids[i]: a restored segment must spell the ids back."""
    x = torch.tensor(ids, dtype=torch.float32).view(1, 1, -1, 1)
    return [(x.clone(), -x.clone()) for _ in range(layers)]


seqs = st.lists(st.integers(0, 4), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["insert", "lookup"]), seqs), min_size=1, max_size=25))
def test_radix_tree_matches_reference(ops):
    tree = RadixCache(budget_bytes=10**9)  # no eviction: the reference keeps everything
    stored: list[list[int]] = []
    for op, ids in ops:
        if op == "insert":
            tree.insert("ns", ids, "target", fake_kv(ids))
            stored.append(ids)
        else:
            n, segs = tree.lookup("ns", ids, ["target"])
            best = (
                max(
                    (next((i for i, (a, b) in enumerate(zip(s, ids)) if a != b), min(len(s), len(ids))))
                    for s in stored
                )
                if stored
                else 0
            )
            assert n == best, f"{ids=} {n=} {best=} {stored=}"
            if n:
                assert segs["target"][0][0].flatten().tolist() == ids[:n]
        tree.check()


@settings(max_examples=100, deadline=None)
@given(st.lists(seqs, min_size=1, max_size=30), st.integers(0, 400))
def test_radix_tree_budget_and_eviction(inserts, budget):
    tree = RadixCache(budget_bytes=budget)
    for ids in inserts:
        tree.insert("ns", ids, "target", fake_kv(ids))
        assert tree.bytes_used <= budget, f"{tree.bytes_used=} {budget=}"
        tree.check()
        n, segs = tree.lookup("ns", ids, ["target"])
        if n:  # whatever survived eviction still spells the right ids
            assert segs["target"][0][0].flatten().tolist() == ids[:n]


class RescanningTree(RadixCache):
    """Eviction as it was before the heap: rescan every node for the least recently used leaf."""

    def _evict(self) -> None:
        while self.bytes_used > self.budget:
            leaves = [nd for nd in self._nodes() if not nd.children and nd.lock_ref == 0]
            if not leaves:
                break
            self._remove(min(leaves, key=lambda nd: nd.last_access))


def spelled(tree: RadixCache) -> list[tuple[int, ...]]:
    """Every node's full key from its root: what the tree holds, whatever its node objects."""
    out = []
    for nd in tree._nodes():
        key, up = nd.key, nd.parent
        while up is not None:
            key, up = up.key + key, up.parent
        out.append(key)
    return sorted(out)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["insert", "lookup"]), seqs), min_size=1, max_size=30),
    st.integers(0, 400),
)
def test_heap_eviction_evicts_what_a_rescan_evicts(ops, budget):
    heap, rescan = RadixCache(budget_bytes=budget), RescanningTree(budget_bytes=budget)
    for op, ids in ops:
        for tree in (heap, rescan):
            if op == "insert":
                tree.insert("ns", ids, "target", fake_kv(ids))
            else:
                tree.lookup("ns", ids, ["target"])
        assert spelled(heap) == spelled(rescan), f"{op=} {ids=}"
        assert heap.evictions == rescan.evictions and heap.bytes_used == rescan.bytes_used
        heap.check()


def test_a_namespace_emptied_leaves_no_root():
    tree = RadixCache(budget_bytes=10**9)
    tree.insert("a", [1, 2, 3], "target", fake_kv([1, 2, 3]))
    tree.insert("a", [1, 2, 4], "target", fake_kv([1, 2, 4]))
    tree.insert("b", [5, 6], "target", fake_kv([5, 6]))
    tree.insert("c", [], "target", [])  # nothing to hold: no root made
    assert set(tree.roots) == {"a", "b"}
    tree.device.budget = tree.bytes_used  # one token more: the least recently used, "a"'s [3], goes
    tree.insert("b", [5, 6, 7], "target", fake_kv([5, 6, 7]))
    assert set(tree.roots) == {"a", "b"} and tree.lookup("a", [1, 2, 4], ["target"])[0] == 3
    tree.check()
    tree.device.budget = segment_bytes(fake_kv([5, 6, 7]))  # room for "b" alone: "a" is evicted whole
    tree.insert("b", [5, 6, 7], "target", fake_kv([5, 6, 7]))
    assert set(tree.roots) == {"b"}
    tree.check()
    tree.drop("b")
    assert tree.roots == {} and tree.bytes_used == 0
    tree.check()


def test_dropping_a_namespace_keeps_what_a_restore_holds():
    tree = RadixCache(budget_bytes=10**9)
    tree.insert("a", [1, 2, 3], "target", fake_kv([1, 2, 3]))
    tree.insert("a", [1, 2, 4], "target", fake_kv([1, 2, 4]))
    match = tree._match("a", [1, 2, 3], ["target"])  # a restore in progress holds [1, 2, 3]
    tree.drop("a")
    assert len(tree) == 2 and "a" in tree.roots  # [1, 2] and [3] are held; [4] went
    tree._release(match)
    tree.check()
    tree.drop("a")
    assert tree.roots == {}
    tree.check()


def test_namespaces_never_read_each_others_entries(models):
    pair = make_pair(models)
    cache, target = pair.prefix_cache, models[0]
    prompt = conversation(random.Random(13), 30)
    for tenant in ("a", "b"):  # both save the same prompt
        state = agentspec.kv.ModelState(target)
        state.forward(prompt, keep=1)
        assert not cache.restore(pair, prompt + [2], {"target": target}, namespace=tenant)["target"].ids
        cache.save(pair, {"target": state}, namespace=tenant)
        assert cache.restore(pair, prompt + [2], {"target": target}, namespace=tenant)["target"].ids == prompt
    assert not cache.restore(pair, prompt + [2], {"target": target})["target"].ids  # the default one
    one = cache.bytes_used // 2
    assert one and cache.bytes_used == 2 * one  # one budget: both tenants' copies count
    cache.tree.check()


@pytest.mark.parametrize("drafter", ["none", "auto"])
def test_a_call_reads_only_its_own_namespace(models, drafter):
    pair = make_pair(models)
    prompt = conversation(random.Random(17), 40)
    first = agentspec.generate(pair, prompt, drafter, namespace="tenant-a", **OPTS)
    other = agentspec.generate(pair, prompt, drafter, namespace="tenant-b", **OPTS)
    again = agentspec.generate(pair, prompt, drafter, namespace="tenant-a", **OPTS)
    shared = agentspec.generate(pair, prompt, drafter, **OPTS)  # the default namespace: a fourth
    assert first.token_ids == other.token_ids == again.token_ids == shared.token_ids
    assert first.stats.cached_tokens == other.stats.cached_tokens == shared.stats.cached_tokens == 0
    assert again.stats.cached_tokens == len(prompt) - 1, again.stats
