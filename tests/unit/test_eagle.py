"""EAGLE heads (``agentspec.drafters.eagle``): the state kept in step with the target, lossless decoding.

A random tiny target and an untrained head: acceptance does not matter here, only that every
path (features fed in batches, drafts chained on the head's own outputs, roll-back, positions
without a feature, the prefix cache, a failing head) leaves the output the target's.
"""

from __future__ import annotations

import pytest
import torch
from heads import new_block_head, new_eagle3

import agentspec
from agentspec import ModelPair
from agentspec.bench.together import start_together
from agentspec.distill.data import Example
from agentspec.distill.eagle import collate_eagle, eagle_loss
from agentspec.distill.student import build_eagle
from agentspec.drafters import ModelDrafter
from agentspec.drafters.block import BlockState
from agentspec.drafters.eagle import EagleState, is_eagle
from agentspec.lean import LeanForward
from agentspec.packed import DraftRound
from agentspec.steps import Steps, run_alone

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def etarget(tiny_llama):
    return tiny_llama(3, vocab_size=64, hidden=32, layers=2, max_positions=512, logit_scale=4.0)


@pytest.fixture(scope="module")
def head(etarget):
    torch.manual_seed(0)
    return build_eagle(etarget, 1).eval()


@pytest.fixture()
def epair(etarget, head, fake_tokenizer):
    from agentspec.cache import PrefixCache

    cache = PrefixCache(64 << 20)
    return ModelPair(
        target=etarget, draft=head, tokenizer=fake_tokenizer(64), name="tiny-eagle", prefix_cache=cache
    )


def features(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]


def test_head_is_recognised_and_shares_the_targets_tensors(head, etarget):
    assert is_eagle(head) and not is_eagle(etarget)
    assert head.embed is etarget.get_input_embeddings()
    assert head.get_output_embeddings() is etarget.get_output_embeddings()
    # the shared modules are not the head's own: neither stored nor trained
    assert not any("embed" in k and k.startswith("embed") for k in head.state_dict())
    assert all(p.data_ptr() != etarget.lm_head.weight.data_ptr() for p in head.parameters())


@pytest.mark.parametrize("run", ["its own modules", "the pair's forward"])
def test_state_matches_a_full_pass_and_rolls_back_drafted_entries(head, etarget, epair, run):
    """Entries fed in pieces (features in batches, chained drafts, roll-back) equal one full pass of
    the head's own modules, also through the pair's forward of the head (its decoder layer's lean
    forward, its fc and the shared LM head as the pair's products)."""
    ids = [5, 9, 2, 33, 7, 41, 12, 8, 19, 3]
    f = features(etarget, ids)
    ref = head.hidden(torch.cat([torch.zeros(1, 32), f[:-1]])[None], torch.tensor([ids]))[0]
    assert isinstance(epair.draft_head.decoder, LeanForward)
    state = EagleState(head, epair.draft_head if run == "the pair's forward" else None)
    state.observe(0, f[:6])
    rows = state.forward(ids[:7], keep=1)  # x_0..x_6 read f_-1 (zero) .. f_5: all real
    assert state.real == 7 and len(state.ids) == 7 and state.cache.get_seq_length() == 7
    assert torch.allclose(rows[-1], head.head(ref[6]), atol=1e-5)
    # drafting: x_7 has no verified feature f_6 yet, so it is fed the head's own output
    state.forward([ids[7]], keep=1)
    assert state.real == 7 and len(state.ids) == 8
    # verified now: sync rolls the drafted entry back, the real feature replaces it
    state.observe(6, f[6:9])
    pending = state.sync(ids[:9])
    assert pending == ids[7:9] and state.cache.get_seq_length() == 7
    rows = state.forward(pending + ids[9:], keep=3)
    assert torch.allclose(rows, head.head(ref[7:10]), atol=1e-5)
    state.check()


def test_positions_without_a_feature_get_no_entry(head, etarget):
    """A restored prefix: the head starts at the first position whose previous feature it saw."""
    ids = list(range(3, 23))
    f = features(etarget, ids)
    state = EagleState(head)
    assert len(state.forward(ids[:12], keep=1)) == 0 and state.ids == []  # no feature yet: deferred
    state.observe(11, f[11:15])  # a prefix of 11 restored, the first pass fed positions 11..14
    rows = state.forward(state.sync(ids[:16]), keep=1)  # x_0..x_11: no entry; x_12..x_15 read f_11..f_14
    assert (state.base, state.cache.get_seq_length(), len(state.ids)) == (12, 4, 16) and len(rows) == 1
    assert len(state.forward([ids[16]], keep=1)) == 1  # past the verified positions: chained
    assert (state.real, state.cache.get_seq_length()) == (16, 5)
    # a gap in the features restarts the head's attention where they resume
    state.observe(18, f[18:19])
    assert state.sync(ids[:20]) == ids[16:20]
    assert len(state.forward(ids[16:20], keep=1)) == 1
    assert (state.base, state.cache.get_seq_length()) == (19, 1)


@pytest.mark.parametrize("drafter", ["model", "model_scheduled", "auto"])
def test_greedy_decoding_with_an_eagle_head_is_lossless(epair, drafter):
    for prompt in ([1, 5, 9, 2, 33, 7], [4, 4, 4, 8, 8, 8, 15, 16, 23, 42] * 3):
        plain = agentspec.generate(epair, prompt, speculative=False, max_new_tokens=40, prefix_cache=False)
        spec = agentspec.generate(epair, prompt, drafter=drafter, max_new_tokens=40, prefix_cache=False)
        assert spec.token_ids == plain.token_ids, drafter
        if drafter == "model":
            assert spec.stats.draft_tokens > 0  # the head drafted (from the second pass on)


def test_prefix_cache_restores_the_target_and_the_head_starts_after_it(epair):
    prompt = [7, 3, 11, 2, 9, 30, 31, 5, 8, 13] * 4
    plain = agentspec.generate(epair, prompt, speculative=False, max_new_tokens=30, prefix_cache=False)
    cold = agentspec.generate(epair, prompt, drafter="model", max_new_tokens=30)
    warm = agentspec.generate(epair, prompt, drafter="model", max_new_tokens=30)
    assert cold.token_ids == warm.token_ids == plain.token_ids
    assert warm.stats.cached_tokens > 0 and warm.stats.draft_tokens > 0


def test_drafter_tracks_the_target_features_through_decode(epair):
    drafter = ModelDrafter(epair.draft, vocab_size=64)
    assert drafter.feature_layers == (-1,) and drafter.kv_state() is None
    agentspec.generate(epair, [1, 2, 3, 4, 5], drafter=drafter, max_new_tokens=12, prefix_cache=False)
    state = drafter.state
    assert state.real >= 10 and state.feat_end >= 16  # 5 prompt + 12 new - the pending last token


@pytest.fixture(scope="module")
def head3(etarget):
    """An untrained EAGLE-3 head over the target's first two layers (the speculators format's)."""
    torch.manual_seed(1)
    return new_eagle3(etarget, [0, 1]).eval()


def drive(state: EagleState, width: int, prompt: list[int], drafts: list[int], seed: int) -> Steps[list]:
    """A call's first draft on a head's state, in steps: the verified prompt fed beside its (random)
    features, then ``drafts`` chained one by one; the logits of each step."""
    feats = torch.randn(len(prompt), width, generator=torch.Generator().manual_seed(seed))
    state.observe(0, feats[:-1])
    out = [(yield from state.forward_steps(prompt, keep=1))]
    for token in drafts:
        out.append((yield from state.forward_steps([token], keep=1)))
    return out


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_feeds_of_calls_drafting_at_once_run_as_one_pass_of_the_head(kind, head, head3, epair):
    """Three calls' head states drafting in one round (as the scheduler drafts): each step of the
    three is one pass of the head, and each state's logits are what it computes alone."""
    model, run = (head, epair.draft_head) if kind == "eagle" else (head3, head3)
    assert run.packs
    width = 32 * len(model.feature_layers)
    calls = [([5, 9, 2, 33, 7, 41, 12, 8], [3, 60, 17]), ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [8, 9, 7]),
             ([7, 7, 30], [30, 30, 2])]  # fmt: skip
    alone = [run_alone(drive(EagleState(model, run), width, p, d, seed=i)) for i, (p, d) in enumerate(calls)]
    drafting = DraftRound()
    plans = [drive(EagleState(model, run), width, p, d, seed=i) for i, (p, d) in enumerate(calls)]
    together = drafting.run(plans, [None] * len(calls))
    # each call's steps (an EAGLE-1 head feeds x_0 beside a zero row first: 5, else 4) in one pass each
    assert drafting.steps == len(calls) * drafting.passes
    assert drafting.passes == (5 if kind == "eagle" else 4)
    for want, got in zip(alone, together):
        assert len(got) == len(want)
        for w, g in zip(want, got):
            assert w.shape == g.shape and torch.allclose(w, g, atol=1e-5)


@pytest.fixture(scope="module")
def block_heads(etarget):
    """Untrained DFlash and DSpark heads (the speculators format's), the DSpark one with a Markov bias."""
    torch.manual_seed(2)
    heads = {
        "dflash": new_block_head(etarget, "dflash", [0, 1], block_size=3, mask_token_id=4),
        "dspark": new_block_head(etarget, "dspark", [1], block_size=4, mask_token_id=4),
    }
    with torch.no_grad():
        for p in heads["dspark"].markov_head.parameters():
            p.normal_(0, 0.5)
    return {name: h.eval() for name, h in heads.items()}


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_blocks_of_several_calls_in_one_forward_equal_each_alone(kind, block_heads):
    """A block head's blocks for three contexts in one forward: each block's hidden states are the
    ones it computes alone, and every context is left as it was (the blocks are not context)."""
    model = block_heads[kind]
    width = 32 * len(model.feature_layers)
    states = [BlockState(model) for _ in range(3)]
    for n, state in zip((9, 4, 15), states):
        state.observe(0, torch.randn(n, width, generator=torch.Generator().manual_seed(n)))
    anchors, caches = [5, 17, 60], [state.cache for state in states]
    alone = [model.block(a, c) for a, c in zip(anchors, caches)]
    together = model.blocks(anchors, caches)
    assert [c.get_seq_length() for c in caches] == [9, 4, 15]
    for want, got in zip(alone, together):
        assert got.shape == want.shape == (model.block_size, 32) and torch.allclose(want, got, atol=1e-5)


@pytest.mark.parametrize("kind", ["eagle", "eagle3", "dflash", "dspark"])
def test_calls_drafting_with_a_head_at_once_equal_plain_decoding(
    kind, etarget, head, head3, block_heads, fake_tokenizer
):
    """Four calls drafting with a head on one pair, started together: the scheduler packs the head's
    steps across them (fewer passes than steps), and every reply is the target's own greedy one."""
    draft = {"eagle": head, "eagle3": head3, **block_heads}[kind]
    pair = ModelPair(target=etarget, draft=draft, tokenizer=fake_tokenizer(64))
    prompts = [[1, 5, 9, 2, 33, 7], [4, 4, 4, 8, 8, 8, 15, 16, 23, 42] * 2, [7, 3, 11, 2, 9], [2, 2, 5, 60]]
    plain = [
        agentspec.generate(pair, p, speculative=False, max_new_tokens=24, prefix_cache=False) for p in prompts
    ]
    stats = pair.scheduler.stats
    results = start_together(
        pair,
        [lambda p=p: agentspec.generate(pair, p, drafter="model", max_new_tokens=24, prefix_cache=False)
         for p in prompts],
    )  # fmt: skip
    for want, got in zip(plain, results):
        assert not isinstance(got, Exception), got
        assert got.token_ids == want.token_ids and got.stats.draft_failures == 0
    assert sum(r.stats.draft_tokens for r in results) > 0
    assert 0 < stats.draft_passes < stats.draft_steps, (stats.draft_passes, stats.draft_steps)


def test_a_failing_head_falls_back_to_the_target(epair, monkeypatch):
    plain = agentspec.generate(
        epair, [3, 1, 4, 1, 5], speculative=False, max_new_tokens=16, prefix_cache=False
    )

    def broken(*args, **kwargs):
        raise RuntimeError("head exploded")

    monkeypatch.setattr(EagleState, "observe", broken)
    spec = agentspec.generate(epair, [3, 1, 4, 1, 5], drafter="model", max_new_tokens=16, prefix_cache=False)
    assert spec.token_ids == plain.token_ids and spec.stats.draft_failures == 1


def test_collate_and_loss_follow_the_heads_indexing():
    f = torch.arange(12, dtype=torch.float16).view(4, 3)
    e = Example(torch.tensor([5, 6, 7, 8]), start=2, first=1, topk_ids=torch.zeros(3, 1),
                topk_logp=torch.zeros(3, 1), kind="chat", greedy=True, features=f)  # fmt: skip
    b = collate_eagle([e], pad_id=0, prompt_weight=0.5)
    assert torch.equal(b.inputs[0, 0], torch.zeros(3)) and torch.equal(b.inputs[0, 1:], f[:3].float())
    assert torch.equal(b.targets[0], f.float())
    # h_p predicts token p + 1: p = 0 a prompt token (0.5), p >= 1 the response; p = 3 predicts nothing
    assert b.weights[0].tolist() == [0.5, 1.0, 1.0, 1.0]
    assert b.response[0].tolist() == [False, True, True, False]
    rows = torch.randn(5, 3)
    target = torch.randn(4, 3)
    w = torch.ones(4)
    zero_reg = eagle_loss(target, target, rows, w, scale=1.0, cls_weight=0.0)
    assert zero_reg.item() == pytest.approx(0.0, abs=1e-7)
    # cross-entropy part at h = f: the entropy of softmax(W f)
    p = torch.softmax(target @ rows.T, -1)
    want = -(p * p.log()).sum(-1).mean()
    assert eagle_loss(target, target, rows, w, 1.0, 1.0).item() == pytest.approx(want.item(), rel=1e-5)


def test_the_chained_training_pass_is_what_drafting_computes(head, etarget):
    """Unrolled training (eagle_unroll=2) scores the second draft token exactly as EagleState drafts it."""
    from transformers import DynamicCache

    from agentspec.distill.eagle import chained_hidden

    ids = [5, 9, 2, 33, 7, 41, 12, 8, 19, 3]
    f = features(etarget, ids)
    e = Example(torch.tensor(ids), start=3, first=1, topk_ids=torch.zeros(9, 1), topk_logp=torch.zeros(9, 1),
                kind="chat", greedy=True, features=f.half().float())  # fmt: skip
    b = collate_eagle([e, Example(**{**e.__dict__, "ids": e.ids[:7], "features": e.features[:7]})], 0, 1.0)
    with torch.no_grad():
        cache = DynamicCache(config=head.decoder.config)
        first = head.hidden(b.inputs, b.ids, cache=cache, attention_mask=b.attention_mask)
        chained = chained_hidden(head, first, b.ids, b.attention_mask, cache)
    for p in (2, 4, 9):
        state = EagleState(head)
        state.observe(0, e.features[: p - 1])
        state.forward(ids[:p], keep=1)  # entries 0..p-1 read the target's features
        assert state.real == p
        rows = state.forward([ids[p]], keep=1)  # entry p: the head's own output at p - 1
        assert torch.allclose(rows[-1], head.head(chained[0, p]), atol=1e-4), p
        if p < 7:  # the padded row of the batch gives the same
            assert torch.allclose(chained[1, p], chained[0, p], atol=1e-4), p


def test_unfed_features_are_bounded_by_dropping_the_oldest_passes(head):
    from agentspec.drafters.eagle import MAX_PENDING_FEATURES

    state = EagleState(head)
    for pos in range(0, MAX_PENDING_FEATURES + 500, 2):  # a benched head: passes of 2 verified rows
        state.observe(pos, torch.zeros(2, 32))
    assert state.feat_end == MAX_PENDING_FEATURES + 500
    assert state.feat_end - state.feat_pos == MAX_PENDING_FEATURES
    assert sum(len(f) for f in state._feats) == MAX_PENDING_FEATURES
