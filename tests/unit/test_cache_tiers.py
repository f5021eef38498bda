"""The prefix cache's two tiers, the device one simulated by a CPU tier with its own budget: where
segments live, bytes per tier, LRU order, the invariants, and restores after a demotion."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import agentspec
import agentspec.cache
from agentspec.cache import PrefixCache, RadixCache, Tier, default_budget, default_host_budget
from agentspec.models import ModelPair

BYTES_PER_TOKEN = 16  # fake_kv: 2 layers x (K, V) x one float32 per position


def fake_kv(ids: list[int], layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KV whose value at position i is ids[i]: a restored segment must spell the ids back."""
    x = torch.tensor(ids, dtype=torch.float32).view(1, 1, -1, 1)
    return [(x.clone(), -x.clone()) for _ in range(layers)]


def two_tiers(device_tokens: int, host_tokens: int) -> RadixCache:
    return RadixCache(device_tokens * BYTES_PER_TOKEN, Tier("host", host_tokens * BYTES_PER_TOKEN))


def node_of(tree: RadixCache, ids: list[int], namespace="ns"):
    """The node whose path from the root spells ``ids`` exactly."""
    node, pos = tree.roots[namespace], 0
    while pos < len(ids):
        node = node.children[ids[pos]]
        pos += len(node.key)
    return node


A, B, C, D = [1] * 10, [2] * 10, [3] * 10, [4] * 10  # four prefixes sharing nothing, 160 bytes each


def test_within_budgets_allows_only_what_a_lookup_holds():
    """The budget invariant on a tree in use: over a tier's budget only by nodes a lookup holds
    (locked: never evicted), and not at all once they are released."""
    tree = two_tiers(device_tokens=20, host_tokens=0)
    for ids in (A, B):
        tree.insert("ns", ids, "target", fake_kv(ids))
    assert tree.within_budgets()
    with tree.lock:
        match = tree._match("ns", A, ["target"])  # A held, as within a lookup
        tree.device.budget = 5 * BYTES_PER_TOKEN  # less than A alone
        tree.insert("ns", C, "target", fake_kv(C))  # B and C go at its eviction; A cannot
        assert tree.device.bytes_used == 160 > tree.device.budget and node_of(tree, A).lock_ref
        assert tree.within_budgets()
        tree._release(match)  # its eviction drops A
    assert tree.within_budgets() and tree.device.bytes_used == 0
    tree.device.bytes_used += 1 + tree.device.budget  # a miscount: over, and nothing held
    assert not tree.within_budgets()


def test_device_evictions_move_to_the_host_in_lru_order():
    tree = two_tiers(device_tokens=20, host_tokens=10)
    for ids in (A, B):
        tree.insert("ns", ids, "target", fake_kv(ids))
    assert tree.device.bytes_used == 320 and tree.host.bytes_used == 0
    tree.insert("ns", C, "target", fake_kv(C))  # over the device budget: A, the oldest, moves
    assert [node_of(tree, s).tier.name for s in (A, B, C)] == ["host", "device", "device"]
    assert (tree.device.bytes_used, tree.host.bytes_used, tree.evictions) == (320, 160, 0)
    tree.check()
    tree.lookup("ns", B, ["target"])  # B is now newer than C
    tree.insert("ns", D, "target", fake_kv(D))  # C moves; the host is full: A, its oldest, goes
    assert [node_of(tree, s).tier.name for s in (B, C, D)] == ["device", "host", "device"]
    assert tree.roots["ns"].children.get(1) is None and tree.evictions == 1
    assert (tree.device.bytes_used, tree.host.bytes_used, tree.demotions) == (320, 160, 2)
    tree.check()


def test_a_hit_on_the_host_tier_loads_back_and_spells_the_same_kv():
    tree = two_tiers(device_tokens=20, host_tokens=40)
    for ids in (A, B, C):
        tree.insert("ns", ids, "target", fake_kv(ids))
    assert node_of(tree, A).tier is tree.host
    n, segs = tree.lookup("ns", A + [9], ["target"])
    assert n == 10 and segs["target"][0][0].flatten().tolist() == A
    assert node_of(tree, A).tier is tree.device and tree.load_backs == 1
    assert node_of(tree, B).tier is tree.host  # the least recently used made room for it
    assert tree.device.bytes_used <= tree.device.budget
    tree.check()


def test_a_path_is_device_nodes_then_host_nodes():
    tree = two_tiers(device_tokens=15, host_tokens=40)
    tree.insert("ns", A, "target", fake_kv(A))
    tree.insert("ns", A + B, "target", fake_kv(A + B))  # A's child: the path is A, B (20 tokens)
    # over budget: only B (no device child) may move; A stays, since its child moved first
    assert node_of(tree, A).tier is tree.device and node_of(tree, A + B).tier is tree.host
    tree.check()
    tree.insert("ns", C, "target", fake_kv(C))  # now A too must go (C is newer), and B stays below it
    assert node_of(tree, A).tier is tree.host and node_of(tree, A + B).tier is tree.host
    n, segs = tree.lookup("ns", A + B, ["target"])  # both come back, top down
    assert n == 20 and segs["target"][1][1].flatten().tolist() == [-x for x in A + B]
    tree.check()


def test_no_host_tier_drops_as_before():
    tree = RadixCache(20 * BYTES_PER_TOKEN)  # host budget 0: eviction drops, nothing is moved
    for ids in (A, B, C):
        tree.insert("ns", ids, "target", fake_kv(ids))
    assert tree.evictions == 1 and tree.demotions == 0 and tree.host.bytes_used == 0
    tree.check()


def test_evict_all_empties_both_tiers():
    tree = two_tiers(device_tokens=20, host_tokens=40)
    for ids in (A, B, C, D):
        tree.insert("ns", ids, "target", fake_kv(ids))
    tree.evict_all()
    assert tree.device.bytes_used == tree.host.bytes_used == 0 and len(tree) == 0
    assert tree.device.budget == 320 and tree.host.budget == 640
    tree.check()


def test_default_budgets_are_capped_on_every_device(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert 0 < default_budget(cpu) <= agentspec.cache.DEVICE_CAP
    assert default_host_budget(cpu) == 0  # a CPU's device tier is host memory already
    # an H200's free memory: 20% of it is far over the cap
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (130 << 30, 141 << 30))
    assert default_budget(cuda) == agentspec.cache.DEVICE_CAP
    assert 0 < default_host_budget(cuda) <= agentspec.cache.HOST_CAP


def test_a_tier_takes_tensors_on_its_device_as_they_are():
    x = torch.zeros(1, 1, 3, 1)
    assert Tier("host", 1).take([(x, x)])[0][0] is x  # no copy within one device
    meta = Tier("device", 1, device=torch.device("meta"))
    assert meta.holds(torch.empty(1, device="meta")) and not meta.holds(x)
    assert meta.take([(x, x)])[0][0].device.type == "meta"


def test_prefix_cache_budgets_and_overrides():
    cache = PrefixCache(1000, host_bytes=500)
    assert (cache.budget_bytes, cache.tree.host.budget, cache.tree.host.pinned) == (1000, 500, False)
    assert PrefixCache(device="cpu").tree.host.budget == 0
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pinned memory needs CUDA"):
            Tier("host", 1, pinned=True)


seqs = st.lists(st.integers(0, 4), min_size=1, max_size=12)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["insert", "lookup"]), seqs), min_size=1, max_size=30),
    st.integers(0, 25),
    st.integers(0, 25),
)
def test_two_tiers_keep_their_budgets_and_invariants(ops, device_tokens, host_tokens):
    tree = two_tiers(device_tokens, host_tokens)
    for op, ids in ops:
        if op == "insert":
            tree.insert("ns", ids, "target", fake_kv(ids))
        else:
            n, segs = tree.lookup("ns", ids, ["target"])
            if n:  # whatever survived still spells the right ids, and is on the device now
                assert segs["target"][0][0].flatten().tolist() == ids[:n]
        assert tree.device.bytes_used <= tree.device.budget, f"{tree.device.bytes_used=}"
        assert tree.host.bytes_used <= tree.host.budget, f"{tree.host.bytes_used=}"
        tree.check()


def test_threads_moving_nodes_between_tiers_keep_the_tree_whole():
    tree = two_tiers(device_tokens=30, host_tokens=60)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(200):
                ids = [rng.randrange(0, 3) for _ in range(rng.randrange(1, 12))]
                if rng.random() < 0.5:
                    tree.insert("ns", ids, "target", fake_kv(ids))
                else:
                    n, segs = tree.lookup("ns", ids, ["target"])
                    if n:  # a concurrent demotion never hands out another prefix's values
                        assert segs["target"][0][0].flatten().tolist() == ids[:n]
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert tree.demotions > 0 and tree.load_backs > 0 and tree.evictions > 0
    assert tree.device.bytes_used <= tree.device.budget and tree.host.bytes_used <= tree.host.budget
    tree.check()


# --- restores after a demotion, on a real (tiny) model -------------------------------------------

VOCAB = 64
OPTS = dict(max_new_tokens=10, num_draft_tokens=3, eos_token_ids=frozenset())
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models(tiny_llama, fake_tokenizer):
    return tiny_llama(0, max_positions=1024), tiny_llama(1, max_positions=1024), fake_tokenizer(VOCAB, 1)


def tiered_pair(models, device_bytes: int, host_bytes: int) -> ModelPair:
    target, draft, tokenizer = models
    cache = PrefixCache(device_bytes, host_bytes=host_bytes)
    return ModelPair(target=target, draft=draft, tokenizer=tokenizer, key=("t", "d"), prefix_cache=cache)


@pytest.mark.parametrize("drafter", ["model", "none"])
def test_restore_after_demotion_is_bit_identical_and_lossless(models, drafter):
    rng = random.Random(23)
    first, second = ([rng.randrange(2, VOCAB) for _ in range(60)] for _ in range(2))
    pair = tiered_pair(models, device_bytes=10**8, host_bytes=10**8)
    tree, ns = pair.prefix_cache.tree, pair.prefix_cache.namespace(pair)
    out = agentspec.generate(pair, first, drafter, **OPTS)
    held = first + out.token_ids[:-1]
    tree.device.budget = tree.device.bytes_used * 3 // 2  # room for one conversation, not two
    _, before = tree.lookup(ns, held, ["target"])
    kept = [(k.clone(), v.clone()) for k, v in before["target"]]
    agentspec.generate(pair, second, drafter, **OPTS)  # the first conversation moves to the host
    assert node_of(tree, held, ns).tier is tree.host and pair.prefix_cache.host_bytes_used > 0
    tree.check()
    _, after = tree.lookup(ns, held, ["target"])  # back on the device, the same bits
    assert all(
        torch.equal(a, b)
        for (ka, va), (kb, vb) in zip(kept, after["target"])
        for a, b in ((ka, kb), (va, vb))
    )
    grown = held + [rng.randrange(2, VOCAB) for _ in range(5)]
    cached = agentspec.generate(pair, grown, drafter, **OPTS)
    fresh = agentspec.generate(pair, grown, drafter, prefix_cache=False, **OPTS)
    assert cached.token_ids == fresh.token_ids, f"{cached.token_ids=} {fresh.token_ids=}"
    assert cached.stats.cached_tokens == len(held)
    tree.check()


def test_a_restore_adopts_the_trees_tensors_and_never_writes_them(models):
    # one node covers the prefix: the restored cache holds the tree's own tensors (views), and
    # decoding past them, with rollbacks of rejected drafts, leaves them as they were
    pair = tiered_pair(models, device_bytes=10**8, host_bytes=0)
    tree, ns = pair.prefix_cache.tree, pair.prefix_cache.namespace(pair)
    prompt = [random.Random(29).randrange(2, VOCAB) for _ in range(50)]
    target = agentspec.kv.ModelState(models[0])
    target.forward(prompt, keep=1)
    pair.prefix_cache.save(pair, {"target": target})
    (node,) = tree.roots[ns].children.values()
    own = [(k, v) for k, v in node.kv["target"]]
    kept = [(k.clone(), v.clone()) for k, v in own]
    states = pair.prefix_cache.restore(pair, prompt + [3], {"target": models[0]})
    layer = states["target"].cache.layers[0]
    assert layer.keys.data_ptr() == own[0][0].data_ptr(), "the restore copied the prefix"
    del states, layer
    out = agentspec.generate(pair, prompt + [3], "model", **OPTS)  # drafts, rejects, rolls back
    assert out.stats.cached_tokens == len(prompt)
    assert out.stats.draft_tokens > out.stats.accepted_tokens, "no draft was rejected: no rollback ran"
    for (k, v), (k0, v0) in zip(own, kept):
        assert torch.equal(k, k0) and torch.equal(v, v0), "a restored call wrote into the tree's tensors"
    tree.check()
