"""``StaticState``: a preallocated KV cache with ``ModelState``'s interface, rolled back by its length."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import agentspec
from agentspec.attention import use_grouped_sdpa
from agentspec.bench.syncs import HostSyncs
from agentspec.drafters.model import ModelDrafter
from agentspec.kv import ModelState
from agentspec.models import ModelPair
from agentspec.static_kv import CapacityError, StaticState

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


def tiny_qwen2(**window) -> Qwen2ForCausalLM:
    """A random Qwen2 (biased q/k/v projections, grouped heads) beside conftest's Llama."""
    torch.manual_seed(3)
    config = Qwen2Config(
        **window,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.fixture(params=["llama", "qwen2"])
def model(request, target):
    return target if request.param == "llama" else tiny_qwen2()


def lengths(state: StaticState) -> list[int]:
    """Each layer's length as transformers reads it (a device tensor: read here, in tests, only)."""
    return [int(layer.cumulative_length) for layer in state.cache.layers]


def both(a: ModelState, b: StaticState, new_ids: list[int], keep: int) -> None:
    """Feed both the same ids; their logits and ids must agree."""
    la, lb = a.forward(new_ids, keep), b.forward(new_ids, keep)
    assert la.shape == lb.shape == (keep, VOCAB)
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    assert a.ids == b.ids and b.length == len(b.ids) and lengths(b) == [b.length] * len(lengths(b))


def test_logits_match_through_roll_backs_and_re_feeds(model):
    seq = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(0)).tolist()
    a, b = ModelState(model), StaticState(model, capacity=64)
    both(a, b, seq[:30], keep=30)  # prefill, every row
    both(a, b, seq[30:35], keep=5)  # a verify-shaped pass
    for s in (a, b):
        s.truncate(32)  # two rejected
    both(a, b, seq[32:33], keep=1)  # one-token steps after the roll-back
    both(a, b, seq[33:34], keep=1)
    other = seq[:25] + [7, 8, 9]
    assert a.sync(other) == b.sync(other) == [7, 8, 9]  # back to the common prefix of 25
    both(a, b, [7, 8, 9], keep=3)
    b.truncate(40)  # past its length: nothing to roll back
    assert b.length == 28
    for s in (a, b):
        s.reset()
    both(a, b, seq[40:50], keep=2)  # reused from empty: old rows are overwritten, never read


def test_passes_and_roll_backs_read_no_device_values(target):
    """The length lives on the host: nothing here would wait for a GPU (transformers' mask builder
    reads a static cache's length tensor unless the layers give it the host's)."""
    s = StaticState(target, capacity=64)
    s.forward(list(range(10)), keep=1)
    segments = [(layer.keys[:, :, :10].clone(), layer.values[:, :, :10].clone()) for layer in s.cache.layers]
    with HostSyncs() as syncs:
        for i in range(4):
            s.forward([i, i + 1, i + 2], keep=3)  # a verify-shaped pass
            s.truncate(11 + i)
            s.forward([i], keep=1)
            s.sync(s.ids[:-1] + [63])
        s.load(segments, list(range(10)))
        s.reset()
    assert syncs.count == 0, syncs.where


def test_hidden_states_match(target):
    a, b = ModelState(target), StaticState(target, capacity=32)
    a.forward([1, 2, 3], keep=1)
    b.forward([1, 2, 3], keep=1)
    (la, ha), (lb, hb) = a.forward([4, 5], keep=2, features=(-1,)), b.forward([4, 5], keep=2, features=(-1,))
    assert ha.shape == hb.shape == (2, target.config.hidden_size)
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hb, ha, rtol=1e-5, atol=1e-5)


def test_load_copies_segments_into_the_buffers(model):
    seq = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    a = ModelState(model)
    a.forward(seq[:20], keep=1)
    segments = [(layer.keys[:, :, :20].clone(), layer.values[:, :, :20].clone()) for layer in a.cache.layers]
    b = StaticState(model, capacity=48)
    b.load(segments, seq[:20])
    assert b.ids == seq[:20] and lengths(b) == [20] * len(segments)
    for k, _ in segments:
        k.zero_()  # the state owns copies: what the prefix cache does with its tensors is its own affair
    both(a, b, seq[20:24], keep=4)
    for s in (a, b):
        s.truncate(10)
    both(a, b, seq[10:12], keep=1)
    reloaded = StaticState(model, capacity=48)  # over a state that already fed: the buffers are reused
    reloaded.forward(seq[:3], keep=1)
    reloaded.load([(layer.keys[:, :, :12], layer.values[:, :, :12]) for layer in b.cache.layers], b.ids)
    both(a, reloaded, seq[12:15], keep=3)


def test_a_feed_past_capacity_raises_and_leaves_the_state_whole(target):
    s = StaticState(target, capacity=8)
    s.forward([1, 2, 3, 4, 5, 6], keep=1)
    with pytest.raises(CapacityError, match="capacity of 8"):
        s.forward([7, 8, 9], keep=1)
    assert s.ids == [1, 2, 3, 4, 5, 6] and s.length == 6
    s.forward([7, 8], keep=1)  # exactly full
    with pytest.raises(CapacityError):
        s.load([(layer.keys, layer.values) for layer in s.cache.layers], list(range(9)))
    assert StaticState(target).capacity == target.config.max_position_embeddings  # default: the context


def test_models_with_windowed_layers_are_refused():
    windowed = tiny_qwen2(use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(ValueError, match="full-attention layers only"):
        StaticState(windowed, capacity=32)


def test_a_failed_pass_is_rolled_back(target, monkeypatch):
    s = StaticState(target, capacity=32)
    s.forward([1, 2, 3], keep=1)
    layer = target.model.layers[1]
    with monkeypatch.context() as m:  # the second layer fails after the first has written its rows
        m.setattr(layer, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
        with pytest.raises(RuntimeError, match="boom"):
            s.forward([4, 5], keep=1)
    assert s.ids == [1, 2, 3] and lengths(s) == [3, 3]  # as before the pass: a retry feeds only its ids
    fresh = ModelState(target)
    fresh.forward([1, 2, 3], keep=1)
    both(fresh, s, [4, 5, 6], keep=3)


def drafter_with_static_state(pair: ModelPair, compiled: bool = False) -> ModelDrafter:
    drafter = ModelDrafter(pair.draft, VOCAB)
    drafter.state = StaticState(pair.draft, capacity=64, compiled=compiled)
    return drafter


def test_greedy_decoding_with_a_static_draft_state_is_unchanged(pair, hf_greedy):
    # without the prefix cache: its restore hands the drafter a ModelState (wired in decode, not here)
    for prompt in ([1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 11, 40, 2], list(range(20))):
        drafter = drafter_with_static_state(pair)
        result = agentspec.generate(
            pair, prompt, drafter=drafter, prefix_cache=False, max_new_tokens=16, num_draft_tokens=4
        )
        assert result.token_ids == hf_greedy(pair.target, prompt, 16), f"{prompt=}"
        assert result.stats.accepted_tokens > 0  # the draft's tokens were used, not only the target's
        assert type(drafter.state) is StaticState and drafter.state.length > 0


@pytest.mark.parametrize("drafter", ["model", "model_scheduled", "auto"])
def test_a_pair_with_a_static_draft_cache_reuses_it_across_cached_calls(
    target, draft, tokenizer, hf_greedy, monkeypatch, drafter
):
    """``draft_cache="static"``: every call drafts in the pair's one StaticState, and a prefix-cache
    restore copies the draft's cached prefix into its buffers (cross-call reuse survives)."""
    from agentspec.cache import PrefixCache

    pair = ModelPair(
        target,
        tokenizer,
        draft=draft,
        name="tiny-static",
        prefix_cache=PrefixCache(1 << 26),
        draft_cache="static",
    )
    state = pair.draft_state()
    assert type(state) is StaticState and pair.draft_state() is state
    loaded = []
    load = state.load
    monkeypatch.setattr(state, "load", lambda segs, ids: (loaded.append(len(ids)), load(segs, ids)))
    prompt = [5, 9, 11, 40, 2, 7, 7, 3]
    first = agentspec.generate(pair, prompt, drafter=drafter, max_new_tokens=16)
    assert first.token_ids == hf_greedy(target, prompt, 16)
    follow = prompt + first.token_ids + [4, 6]
    second = agentspec.generate(pair, follow, drafter=drafter, max_new_tokens=16)
    assert second.token_ids == hf_greedy(target, follow, 16)
    assert second.stats.cached_tokens > len(prompt)  # the target restored the first call's state
    assert loaded and loaded[-1] > len(prompt)  # and so did the static draft, into its buffers
    with pytest.raises(ValueError, match="draft_cache"):
        ModelPair(target, tokenizer, draft=draft, draft_cache="paged")


def test_the_compiled_step_matches_the_eager_one(hf_greedy, pair):
    """Compiling takes seconds on a tiny model (minutes per shape for a real one on a CPU).

    The draft runs ``agentspec_sdpa``: under ``torch.compile`` its one-token step folds the query
    groups too (transformers' own ``pack_gqa`` stands down when compiling).
    """
    seq = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    model = copy.deepcopy(pair.draft)
    assert use_grouped_sdpa(model)
    pair = ModelPair(target=pair.target, draft=model, tokenizer=pair.tokenizer, name="tiny-static")
    eager, compiled = StaticState(model, capacity=64), StaticState(model, capacity=64, compiled=True)
    for s in (eager, compiled):
        s.forward(seq[:10], keep=1)  # prefill: eager in both
    for i in range(10, 16):
        torch.testing.assert_close(
            compiled.forward([seq[i]], 1), eager.forward([seq[i]], 1), rtol=1e-5, atol=1e-5
        )
    for s in (eager, compiled):
        s.truncate(12)  # the compiled step reads the moved length from the same buffers
    for i in range(12, 15):
        torch.testing.assert_close(
            compiled.forward([seq[i]], 1), eager.forward([seq[i]], 1), rtol=1e-5, atol=1e-5
        )
    assert lengths(compiled) == [15, 15] and compiled._step is not None
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]
    drafter = drafter_with_static_state(pair, compiled=True)
    result = agentspec.generate(pair, prompt, drafter=drafter, prefix_cache=False, max_new_tokens=16)
    assert result.token_ids == hf_greedy(pair.target, prompt, 16)
    assert drafter.state.compiled and result.stats.accepted_tokens > 0


def test_a_compiled_verify_pass_pads_to_its_width(pair):
    """The target's verify pass compiled at width k + 1: shorter feeds are padded, then rolled back."""
    model = pair.target
    seq = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(4)).tolist()
    a, b = ModelState(model), StaticState(model, capacity=48, compiled=True, width=4)
    both(a, b, seq[:20], keep=1)  # wider than 4: eager
    at = 20
    for n in (4, 1, 3, 2):  # every feed of up to 4 tokens runs the one compiled graph
        both(a, b, seq[at : at + n], keep=n)
        at += n
    assert b._step is not None and lengths(b) == [at, at]
    for s in (a, b):
        s.truncate(25)
    both(a, b, seq[25:27], keep=2)


def test_a_padded_feed_that_does_not_fit_runs_eager(target):
    s = StaticState(target, capacity=10, compiled=True, width=4)
    s.forward(list(range(8)), keep=1)
    s.forward([8], keep=1)  # 9 + 3 padded rows would pass the capacity: eager, unpadded
    assert s._step is None and s.length == 9
