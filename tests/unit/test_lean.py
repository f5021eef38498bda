"""``agentspec.lean``: the lean forward of agentspec's passes computes transformers' own numbers.

Its passes (a prompt, one-row steps, verify passes over a cache, packed passes of several sequences,
with the layer features a head reads) give the logits transformers' forward gives for the same
tokens; the model itself is left as transformers built it (its forward, its modules' types, deepcopy,
save_pretrained); a family it does not reproduce runs transformers' forward.
"""

from __future__ import annotations

import copy
from functools import partial

import pytest
import torch
from conftest import needs_bf16

import agentspec
from agentspec import lean, linears
from agentspec.attention import use_grouped_sdpa
from agentspec.forward import PlainForward
from agentspec.kv import ModelState, PassIds
from agentspec.models import ModelPair
from agentspec.packed import forward_packed

VOCAB = 97


def family_model(tiny_llama, tiny_qwen, family: str, seed: int = 3):
    return tiny_llama(seed, vocab_size=VOCAB) if family == "llama" else tiny_qwen(family, seed, VOCAB)


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def models(request, tiny_llama, tiny_qwen):
    """(the model a pair's lean forward reads, an untouched copy for transformers' numbers, the lean
    forward)."""
    model = family_model(tiny_llama, tiny_qwen, request.param)
    untouched = copy.deepcopy(model)
    pair = ModelPair(target=model, tokenizer=None)
    assert isinstance(pair.target_forward, lean.LeanForward) and pair.target_forward.model is model
    return model, untouched, pair.target_forward


def reference(model, ids: list[int]) -> torch.Tensor:
    """Logits of every position of ``ids``, one transformers forward (no cache)."""
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


def test_its_passes_give_transformers_logits(models):
    model, untouched, lean_forward = models
    ids = [5, 17, 42, 8, 91, 3, 3, 60, 11, 29, 7, 2, 77]
    ref = reference(untouched, ids)
    state = ModelState(lean_forward)
    got = [state.forward(ids[:6], 6), state.forward(ids[6:7], 1), state.forward(ids[7:12], 5)]
    state.truncate(9)  # a rejected draft rolled back, then the pass after it
    got += [state.forward(ids[9:13], 4)]
    expected = [ref[:6], ref[6:7], ref[7:12], ref[9:13]]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_a_packed_pass_gives_each_sequence_its_own_logits(models):
    model, untouched, lean_forward = models
    seqs = [[5, 17, 42, 8, 91, 3], [60, 11], [29, 7, 2, 77, 1, 4, 4, 9]]
    states = [ModelState(lean_forward) for _ in seqs]
    states[0].forward(seqs[0][:3], 1)  # one sequence with a cache, the others from empty
    news = [PassIds(seqs[0][3:]), PassIds(seqs[1]), PassIds(seqs[2])]
    outs = forward_packed(states, news, [3, 1, 8])
    for seq, out, keep in zip(seqs, outs, [3, 1, 8], strict=True):
        torch.testing.assert_close(out, reference(untouched, seq)[-keep:], rtol=1e-5, atol=1e-5)
    assert [len(s.ids) for s in states] == [len(s) for s in seqs]


def test_the_final_norm_features_come_with_the_logits(models):
    """An EAGLE head drafts from the target's final-norm output: the lean pass hands it as
    transformers' forward does (``output_hidden_states``' last entry)."""
    model, untouched, lean_forward = models
    ids = [5, 17, 42, 8, 91, 3]
    logits, hidden = ModelState(lean_forward).forward(ids, 2, features=(-1,))
    with torch.inference_mode():
        out = untouched(torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(hidden, out.hidden_states[-1][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, out.logits[0, -2:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("forward", ["lean", "transformers"])
def test_any_layers_features_come_from_the_same_pass(models, forward):
    """The features of the layers asked for (transformers' ``output_hidden_states`` numbering: a
    layer's input, the last the final norm's output, negative from the end) come with the logits of
    one pass, solo and packed, through the lean forward and transformers' alike."""
    model, untouched, lean_forward = models
    run = lean_forward if forward == "lean" else PlainForward(untouched, packs=use_grouped_sdpa(untouched))
    ids = [5, 17, 42, 8, 91, 3]
    with torch.inference_mode():
        ref = untouched(torch.tensor([ids]), output_hidden_states=True).hidden_states
        state = ModelState(run)
        state.forward(ids[:2], 1)
        out = run(torch.tensor([ids[2:]]), 1, cache=state.cache, features=(0, 1, 2, -1))
    for got, index in zip(out.features, (0, 1, 2, -1), strict=True):
        torch.testing.assert_close(got, ref[index][0, 2:], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="feature layer 3 out of range"):
        run(torch.tensor([ids[:1]]), 1, cache=ModelState(run).cache, features=(3,))


def test_the_model_is_left_as_transformers_built_it(models, tmp_path):
    """After a pair is built on it: no module has a ``forward`` of its own or another type, and the
    model deep-copies, saves and computes transformers' numbers."""
    model, untouched, lean_forward = models
    assert not [name for name, m in model.named_modules() if "forward" in vars(m)]
    assert [type(m) for m in model.modules()] == [type(m) for m in untouched.modules()]
    twin = copy.deepcopy(model)
    x = torch.tensor([[3, 17, 42, 5, 9]])
    with torch.inference_mode():
        torch.testing.assert_close(twin(x).logits, untouched(x).logits, rtol=1e-5, atol=1e-5)


def test_other_callers_keep_transformers_forward(models):
    """Outside an agentspec pass (``generate()``, a user's call) the model is transformers' own, its
    fused weights still its parameters (views: the same values, one copy)."""
    model, untouched, lean_forward = models
    x = torch.tensor([[3, 17, 42, 5, 9]])
    with torch.inference_mode():
        got = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8)
        ref = untouched.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=8)
    assert got.tolist() == ref.tolist()
    for name, p in untouched.state_dict().items():
        assert torch.equal(model.state_dict()[name], p), name
    layer = model.model.layers[0]
    fused = lean_forward.layers[0].gate_up
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == fused.weight.untyped_storage().data_ptr()


def test_a_family_it_does_not_reproduce_keeps_transformers_forward(tiny_llama, tiny_qwen):
    sliding = tiny_qwen("qwen2", 0, VOCAB, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    sliding3 = tiny_qwen("qwen3", 0, VOCAB, use_sliding_window=True, sliding_window=4, max_window_layers=0)
    gelu = tiny_llama(0)
    gelu.config.hidden_act = "gelu"
    for model in (sliding, sliding3, gelu):
        assert not lean.supported(model)
        pair = ModelPair(target=model, tokenizer=None)
        assert isinstance(pair.target_forward, PlainForward) and "forward" not in vars(model)


def test_a_failed_pass_leaves_the_state_usable(models):
    """An error inside a layer (out of memory, a fault) rolls the cache back; the next pass is right."""
    model, untouched, lean_forward = models
    ids = [5, 17, 42, 8, 91, 3, 60]
    state = ModelState(lean_forward)
    state.forward(ids[:4], 1)
    layer = lean_forward.layers[1]
    good = layer.gate_up_product
    layer.gate_up_product = lambda x: (_ for _ in ()).throw(RuntimeError("injected"))
    with pytest.raises(RuntimeError, match="injected"):
        state.forward(ids[4:6], 2)
    layer.gate_up_product = good
    assert len(state.ids) == 4 and state.cache.get_seq_length() == 4
    torch.testing.assert_close(state.forward(ids[4:], 3), reference(untouched, ids)[4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_packed_linears_are_called_directly_with_their_forwards_bits(
    tiny_llama, tiny_qwen, monkeypatch, family
):
    """Where a pass's linears are packed (float32, every weight here), the lean forward calls each one's
    kernel directly (``linears.PassLinears.product``), with the bits ``PackedWeight``'s own call gives,
    at one row and at several (the kernel folds the leading dimensions that ``PackedWeight`` flattens)."""
    monkeypatch.setattr(linears, "MIN_PACKED_FLOAT32_BYTES", 0)
    pair = ModelPair(target=family_model(tiny_llama, tiny_qwen, family), tokenizer=None)
    lean_forward = pair.target_forward
    layer = lean_forward.layers[0]
    products = [layer.qkv_product, layer.o_product, layer.gate_up_product, layer.down_product]
    assert all(p.func is linears._packed_linear for p in [*products, lean_forward.lm_head_product])
    ids = [5, 17, 42, 8, 91, 3, 60, 11]
    state = ModelState(lean_forward)
    state.forward(ids[:3], 1)
    direct = [state.forward(ids[3:4], 1), state.forward(ids[4:], 4)]
    state.truncate(3)
    lean_forward.bind(lambda linear: partial(pair.pass_linears.packed(linear), bias=linear.bias))
    through = [state.forward(ids[3:4], 1), state.forward(ids[4:], 4)]
    assert all(torch.equal(a, b) for a, b in zip(direct, through, strict=True))


@needs_bf16
@pytest.mark.parametrize("prompt_len", [20, 40])
def test_a_bfloat16_prompt_pass_past_the_invariant_rows_carries_no_draft(tiny_llama, tokenizer, prompt_len):
    """In bfloat16 on a CPU a pass's rows are a one-row pass's only up to ``attention.invariant_rows``:
    a longer prompt goes alone, as plain decoding feeds it, and drafting starts at the next pass; a
    prompt within them takes its draft along. Either way the reply is plain decoding's, token for token."""
    import agentspec

    model = tiny_llama(4).to(torch.bfloat16)
    pair = ModelPair(target=model, tokenizer=tokenizer)
    limit = pair.invariant_rows
    assert limit is not None and 20 < limit < 40
    ids = ([5, 17, 42, 8, 31, 3, 60, 11] * 5)[:prompt_len]  # repeats: prompt lookup drafts from it
    plain = agentspec.generate(pair, ids, max_new_tokens=12, speculative=False, prefix_cache=False)
    before = len(pair.scheduler.stats.recent)
    got = agentspec.generate(pair, ids, drafter="prompt_lookup", max_new_tokens=12, prefix_cache=False)
    first_rows = list(pair.scheduler.stats.recent)[before][1]
    assert got.token_ids == plain.token_ids
    assert first_rows == prompt_len if prompt_len > limit else first_rows > prompt_len


def test_lean_forward_false_keeps_transformers_forward(tiny_llama):
    model = tiny_llama(0)
    pair = ModelPair(target=model, tokenizer=None, lean_forward=False)
    assert isinstance(pair.target_forward, PlainForward) and "forward" not in vars(model)
    q = model.model.layers[0].self_attn.q_proj
    assert q.weight.untyped_storage().nbytes() == q.weight.numel() * q.weight.element_size()  # not fused


def test_a_model_with_fused_weights_saves_and_reloads(models, tmp_path):
    """The model's parameters are views of the fused weights: ``save_pretrained`` still writes each
    as its own tensor, and the saved model loads with transformers' own numbers."""
    model, untouched, _ = models
    model.save_pretrained(tmp_path)
    reloaded = type(model).from_pretrained(tmp_path)
    for name, p in untouched.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], p), name


@needs_bf16
@pytest.mark.parametrize("blocked", [True, False])
def test_bfloat16_pass_rows_carry_one_row_steps_bits(tiny_llama, monkeypatch, blocked):
    """In bfloat16 on a CPU every row of a verify pass, solo or packed with another sequence, is a
    one-row step's bits, across a key block's end: blocked (one SDPA call a layer,
    ``attention.blocked_attention``) where this CPU's kernel keeps them, else row by row."""
    if not blocked:
        monkeypatch.setattr(lean, "blocked_fits", lambda *shape: False)
    model = tiny_llama(4, vocab_size=VOCAB, hidden=64).to(torch.bfloat16)
    lean_forward = ModelPair(target=model, tokenizer=None).target_forward
    if blocked and lean_forward.blocked_rows is None:
        pytest.skip("this CPU's SDPA sums a row otherwise in a call of more rows (attention.blocked_fits)")
    assert lean_forward.blocked_rows == (linears.INVARIANT_ROWS if blocked else None)
    calls = []
    monkeypatch.setattr(lean, "blocked_attention", lambda *a: calls.append(a[0].shape[2]) or attend(*a))
    ids = [(7 * i) % 90 + 3 for i in range(520)]
    prompt, rows = ids[:508], ids[508:]  # rows 508..519: the key block ends at 512

    def from_prompt() -> ModelState:
        state = ModelState(lean_forward)
        state.forward(prompt, 1)
        return state

    steps = from_prompt()
    expected = torch.cat([steps.forward([t], 1) for t in rows])
    torch.testing.assert_close(expected.float(), reference(model, ids)[508:].float(), rtol=0.1, atol=0.1)
    assert torch.equal(from_prompt().forward(rows, len(rows)), expected)
    other = ModelState(lean_forward)
    other.forward(prompt[:40], 1)
    solo, packed = forward_packed([from_prompt(), other], [PassIds(rows), PassIds([5])], [len(rows), 1])
    assert torch.equal(solo, expected)
    layers = len(
        lean_forward.layers
    )  # each pass calls it once a layer: the 12 steps, 2 verify passes, 1 other step
    assert (calls.count(1), calls.count(len(rows))) == ((13 * layers, 2 * layers) if blocked else (0, 0))


attend = lean.blocked_attention


def test_bfloat16_packed_one_row_steps_are_solo_steps_bits_in_transformers_forward(tiny_llama):
    """Without the lean forward (transformers' forward, ``PackedPass.attend``), a sequence's one-row
    step packed with others attends as its solo step does (folded in bfloat16 on a CPU): the same bits."""
    model = tiny_llama(4, vocab_size=VOCAB, hidden=64).to(torch.bfloat16)
    assert use_grouped_sdpa(model)  # as load_model switches it: what the packed pass feeds
    plain = ModelPair(target=model, tokenizer=None, lean_forward=False).target_forward
    assert isinstance(plain, PlainForward) and plain.packs
    ids = [(7 * i) % 90 + 3 for i in range(30)]

    def from_prompt(n: int) -> ModelState:
        state = ModelState(plain)
        state.forward(ids[:n], 1)
        return state

    solo = from_prompt(20).forward(ids[20:21], 1)
    packed, _ = forward_packed(
        [from_prompt(20), from_prompt(9)], [PassIds(ids[20:21]), PassIds(ids[9:12])], [1, 3]
    )
    with torch.inference_mode():
        ref = model(torch.tensor([ids[:21]])).logits[0, -1:]
    torch.testing.assert_close(solo.float(), ref.float(), rtol=0.05, atol=0.05)
    assert torch.equal(packed, solo)


def test_its_layer_norm_way_is_rms_norm_to_a_last_bit():
    """``lean.rms_norm`` over ``[x, -x]`` (a CPU in bfloat16) is torch.rms_norm but for one bfloat16
    step in a few rows; without the doubled weight it is torch.rms_norm itself."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 16, 576, generator=gen) * 7).to(torch.bfloat16)
    weight = (torch.rand(576, generator=gen) + 0.5).to(torch.bfloat16)
    expected = torch.rms_norm(x, (576,), weight, 1e-5)
    got = lean.rms_norm(x, weight, 1e-5, torch.cat((weight, weight)))
    assert torch.equal(lean.rms_norm(x, weight, 1e-5, None), expected)
    rows_off = (got != expected).any(-1).float().mean().item()
    assert rows_off < 0.05, rows_off
    steps = (got.float() - expected.float()).abs() / expected.float().abs().clamp_min(1e-30)
    assert steps.max().item() <= 2**-7, steps.max().item()  # one bfloat16 step at most
    for row in range(0, 16, 5):  # a row's bits are its own, whatever else is in the call
        one = lean.rms_norm(x[:1, row : row + 1], weight, 1e-5, torch.cat((weight, weight)))
        assert torch.equal(one, got[:1, row : row + 1])


@pytest.mark.parametrize("k", [1, 3, 8])
def test_a_qwen3_pair_speculates_transformers_greedy_tokens(tiny_qwen, perturbed, fake_tokenizer, k):
    """Speculative decoding on a Qwen3 pair (a draft model that mostly agrees), greedy, through the
    lean forward: token for token what transformers' ``generate()`` gives the target alone, with drafts
    accepted and rejected along the way."""
    target = tiny_qwen("qwen3", 5, VOCAB)
    draft = perturbed(target, seed=1, noise=0.3)
    pair = ModelPair(target=target, draft=draft, tokenizer=fake_tokenizer(VOCAB), name="tiny-qwen3")
    assert isinstance(pair.target_forward, lean.LeanForward)
    accepted = rejected = 0
    for prompt in ([5, 17, 42, 8, 91, 3], [60, 11, 60, 11, 60], [29, 7, 2, 77, 1, 4, 4, 9, 13, 21]):
        x = torch.tensor([prompt])
        with torch.inference_mode():
            ref = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=16,
                                  min_new_tokens=16)[0, len(prompt) :].tolist()  # fmt: skip
        result = agentspec.generate(pair, prompt, drafter="model", max_new_tokens=16, num_draft_tokens=k)
        assert result.token_ids == ref, f"{prompt=}"
        accepted += result.stats.accepted_tokens
        rejected += result.stats.draft_tokens - result.stats.accepted_tokens
    assert accepted > 0 and rejected > 0, f"{accepted=} {rejected=}"
