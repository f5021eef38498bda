"""``agentspec_sdpa``: transformers' sdpa attention, with query groups folded into rows over a mask."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import agentspec
from agentspec import attention, kv
from agentspec.attention import NAME, fold_groups, grouped_sdpa_forward, use_grouped_sdpa
from agentspec.models import ModelPair

pytestmark = pytest.mark.usefixtures("one_thread")


def switched(model):
    twin = copy.deepcopy(model)
    assert use_grouped_sdpa(twin) and twin.config._attn_implementation == NAME
    return twin


def test_a_verify_pass_gives_the_same_logits(target):
    twin = switched(target)
    assert twin.config.num_key_value_heads < twin.config.num_attention_heads  # grouped heads
    prompt, new = torch.randint(0, 64, (1, 30)), torch.randint(0, 64, (1, 5))
    with torch.no_grad():
        out = []
        for model in (target, twin):
            cache = DynamicCache(config=model.config)
            model(prompt, cache=cache, use_cache=True)
            out.append(model(new, cache=cache, use_cache=True).logits)
    torch.testing.assert_close(out[0], out[1], rtol=1e-5, atol=1e-5)


def test_padded_batches_match(target):
    twin = switched(target)
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding
    with torch.no_grad():
        a, b = (m(ids, attention_mask=mask).logits for m in (target, twin))
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[1, 4:], b[1, 4:], rtol=1e-5, atol=1e-5)


def test_speculative_output_is_unchanged(target, draft, tokenizer, hf_greedy):
    pair = ModelPair(target=switched(target), draft=switched(draft), tokenizer=tokenizer, name="tiny-gqa")
    for prompt in ([1, 2, 3, 1, 2, 3, 1, 2], [5, 9, 11, 40, 2]):
        result = agentspec.generate(pair, prompt, "model", max_new_tokens=12, num_draft_tokens=4)
        assert result.token_ids == hf_greedy(target, prompt, 12)


def test_the_fold_runs_only_where_it_applies(target, monkeypatch):
    seen = []  # (query heads, enable_gqa) of each kernel call
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **k: seen.append((a[0].shape[1], k.get("enable_gqa", False))) or torch.zeros_like(a[0]),
    )
    twin = switched(target)
    module = twin.model.layers[0].self_attn
    q, kv = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 10, 8)
    mask = torch.zeros(1, 1, 3, 10, dtype=torch.bool)
    grouped_sdpa_forward(module, q, kv, kv, mask)  # 3 query tokens, a mask: folded onto the 2 KV heads
    grouped_sdpa_forward(module, q[:, :, :1], kv, kv, mask[:, :, :1])  # one token: folded too
    grouped_sdpa_forward(module, q, kv, kv, None)  # no mask: transformers' path (the kernel's own groups)
    grouped_sdpa_forward(module, q, kv, kv, mask.expand(1, 4, 3, 10))  # a mask per head: transformers'
    assert seen == [(2, False), (2, False), (4, True), (4, False)]


def test_folding_matches_the_reference_kernel(target):
    """Against transformers' ``sdpa_attention_forward`` (``repeat_kv``), within float32 rounding."""
    module = target.model.layers[0].self_attn  # 4 query heads on 2 KV heads
    gen = torch.Generator().manual_seed(0)
    for batch, q_len, kv_len in ((1, 1, 9), (1, 5, 40), (2, 17, 64)):
        query = torch.randn(batch, q_len, 4, 8, generator=gen).transpose(1, 2)  # as the model lays it out
        key, value = (torch.randn(batch, 2, kv_len, 8, generator=gen) for _ in range(2))
        causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
        bool_mask = causal.expand(batch, 1, q_len, kv_len).clone()
        bool_mask[-1, :, :, :3] = False  # left padding in the last row of the batch
        float_mask = torch.zeros(bool_mask.shape).masked_fill(~bool_mask, torch.finfo(torch.float32).min)
        for mask in (bool_mask, float_mask):
            ours, _ = grouped_sdpa_forward(module, query, key, value, mask, scaling=0.3)
            ref, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=0.3)
            assert ours.shape == ref.shape == (batch, q_len, 4, 8)
            torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


def test_a_bfloat16_cpu_row_without_a_mask_folds_and_matches_the_reference_kernel(target, monkeypatch):
    """One query row, no mask, bfloat16 on a CPU: its KV head's query heads as rows of one call
    (``attention._folded``: SDPA's bfloat16 one-row kernel is the slow one), the values of
    transformers' grouped heads to bfloat16's rounding; float32 and several rows keep that path."""
    module = target.model.layers[0].self_attn  # 4 query heads on 2 KV heads
    gen = torch.Generator().manual_seed(0)
    query = torch.randn(1, 1, 4, 8, generator=gen).transpose(1, 2).to(torch.bfloat16)
    key, value = (torch.randn(1, 2, 30, 8, generator=gen).to(torch.bfloat16) for _ in range(2))
    ours, _ = grouped_sdpa_forward(module, query, key, value, None, scaling=0.3)
    ref, _ = sdpa_attention_forward(module, query, key, value, None, scaling=0.3)
    assert ours.shape == ref.shape == (1, 1, 4, 8)
    torch.testing.assert_close(ours.float(), ref.float(), rtol=0.02, atol=0.02)
    kernel = torch.nn.functional.scaled_dot_product_attention
    seen = []  # (query heads, rows) of each kernel call
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **k: seen.append(tuple(a[0].shape[1:3])) or kernel(*a, **k),
    )
    grouped_sdpa_forward(module, query, key, value, None)
    grouped_sdpa_forward(module, query.float(), key.float(), value.float(), None)
    grouped_sdpa_forward(module, query.expand(1, 4, 3, 8), key, value, None)
    assert seen == [(2, 2), (4, 1), (4, 3)]


def test_a_blocked_mask_gives_each_folded_row_its_causal_end():
    mask = attention.blocked_mask(600, 3, 2, torch.device("cpu"), torch.bfloat16)
    assert mask.shape == (1, 1, 8, 1024)  # 2 x 3 rows padded to 8, 603 keys to two whole key blocks
    assert mask.dtype == torch.bfloat16 and set(mask.unique().tolist()) == {0.0, float("-inf")}
    visible = (mask[0, 0] == 0).sum(dim=1).tolist()
    assert visible == [601, 602, 603, 601, 602, 603, 603, 603]  # row g*3 + i sees held + i + 1 keys
    assert (mask[0, 0, 0, :601] == 0).all()  # a row sees a prefix of the keys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocked_attention_gives_the_reference_kernels_values(target, dtype):
    """Against transformers' ``sdpa_attention_forward`` over the causal mask and the keys themselves:
    the keys past the length (zeros, a rolled-back pass's stale ones) are hidden."""
    module = target.model.layers[0].self_attn  # 4 query heads on 2 KV heads
    gen = torch.Generator().manual_seed(0)
    held, n = 530, 6
    keys, values = (torch.randn(1, 2, kv.KEY_BLOCK * 2, 8, generator=gen).to(dtype) for _ in range(2))
    keys[:, :, held + n + 5 :] = 0  # stale keys, then zeros, past the length
    query = torch.randn(1, n, 4, 8, generator=gen).transpose(1, 2).to(dtype)
    mask = attention.blocked_mask(held, n, 2, query.device, dtype)
    ours = attention.blocked_attention(query, keys, values, mask, 2, 0.3)
    causal = torch.ones(n, held + n, dtype=torch.bool).tril(held)[None, None]
    ref, _ = sdpa_attention_forward(
        module, query, keys[:, :, : held + n], values[:, :, : held + n], causal, scaling=0.3
    )
    assert ours.shape == ref.shape == (1, n, 4, 8)
    tol = 1e-5 if dtype == torch.float32 else 0.02
    torch.testing.assert_close(ours.float(), ref.float(), rtol=tol, atol=tol)


def test_blocked_fits_fails_a_kernel_whose_rows_depend_on_their_call(monkeypatch):
    kernel = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda q, *a, **k: kernel(q, *a, **k) * (1 + q.shape[2] * 2**-10),  # bits that follow the row count
    )
    assert not attention.blocked_fits(2, 2, 16, torch.float32)


def test_a_growing_layers_blocks_are_whole_key_blocks_of_its_buffer():
    layer = kv.GrowingLayer()
    first = torch.randn(1, 2, 600, 8)
    layer.update(first, first)
    keys, values = layer.blocks()
    assert keys.shape == values.shape == (1, 2, 2 * kv.KEY_BLOCK, 8)
    assert torch.equal(keys[:, :, :600], first) and not keys[:, :, 600:].any()  # zeros past the length
    assert keys.data_ptr() == layer.keys.data_ptr()  # views of the buffer, no copy
    layer.update(torch.ones(1, 2, 700, 8), torch.ones(1, 2, 700, 8))  # grows: 1,300 keys
    keys, _ = layer.blocks()
    assert keys.shape[2] == 3 * kv.KEY_BLOCK and layer.get_seq_length() == 1300
    assert torch.equal(keys[:, :, :600], first) and not keys[:, :, 1300:].any()
    layer.crop(-200)  # a roll-back: the stale keys stay, finite, then zeros to the block's end
    keys, _ = layer.blocks()
    assert keys.shape[2] == 3 * kv.KEY_BLOCK and (keys[:, :, 1100:1300] == 1).all()
    assert not keys[:, :, 1300:].any()


def test_folded_rows_follow_the_kv_heads():
    query = torch.arange(6 * 3).reshape(1, 6, 3, 1)  # 6 query heads, 3 tokens
    mask = torch.arange(3 * 4).reshape(1, 1, 3, 4)
    folded, rows = fold_groups(query, mask, groups=3)  # 2 KV heads, 3 query heads each
    assert folded.shape == (1, 2, 9, 1) and rows.shape == (1, 1, 9, 4)
    assert folded[0, 1, :, 0].tolist() == query[0, 3:6, :, 0].flatten().tolist()  # heads 3..5 -> KV head 1
    assert rows[0, 0, 4].tolist() == mask[0, 0, 1].tolist()  # row g*q + i is mask row i (g=1, i=1)


def test_models_on_other_attention_are_left_alone(target):
    eager = copy.deepcopy(target)
    eager.set_attn_implementation("eager")
    assert not use_grouped_sdpa(eager) and eager.config._attn_implementation == "eager"


def test_models_on_any_device_are_switched(target):
    elsewhere = copy.deepcopy(target).to("meta")  # no GPU here: the switch must not look at the device
    assert use_grouped_sdpa(elsewhere) and elsewhere.config._attn_implementation == NAME
