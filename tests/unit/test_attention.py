"""``agentspec_sdpa``: transformers' sdpa attention, with grouped KV heads on CPU for multi-token passes."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache

import agentspec
from agentspec.attention import NAME, grouped_sdpa_forward, use_grouped_sdpa
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


def test_the_grouped_path_runs_only_where_it_applies(target, monkeypatch):
    seen = []
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **k: seen.append(k.get("enable_gqa", False)) or torch.zeros_like(a[0]),
    )
    twin = switched(target)
    module = twin.model.layers[0].self_attn
    q, kv = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 10, 8)
    mask = torch.zeros(1, 1, 3, 10, dtype=torch.bool)
    grouped_sdpa_forward(module, q, kv, kv, mask)  # 3 query tokens, a mask: grouped
    grouped_sdpa_forward(module, q[:, :, :1], kv, kv, mask[:, :, :1])  # one token: transformers' path
    assert seen == [True, False]


def test_models_on_other_attention_are_left_alone(target):
    eager = copy.deepcopy(target)
    eager.set_attn_implementation("eager")
    assert not use_grouped_sdpa(eager) and eager.config._attn_implementation == "eager"
