"""``agentspec.bench.passes``: op categories by name, a profiled pass on a tiny model, and a pass's
linears timed on their own."""

from __future__ import annotations

import pytest
import torch

from agentspec.bench import passes
from agentspec.models import ModelPair


@pytest.mark.parametrize(
    ("op", "expected"),
    [
        ("aten::linear", "linear"),
        ("mkldnn::_linear_pointwise", "linear"),  # a prepacked oneDNN linear
        ("aten::addmm", "linear"),  # not "add": linear is matched first
        ("aten::scaled_dot_product_attention", "attention"),
        ("aten::rms_norm", "norm"),
        ("aten::copy_", "kv_cache"),  # GrowingLayer's in-place append
        ("aten::cat", "kv_cache"),  # transformers' DynamicLayer append
        ("aten::_to_copy", "elementwise"),  # a dtype cast, not a cache write
        ("aten::silu", "elementwise"),
        ("aten::embedding", "other"),
        ("aten::slice", "other"),
    ],
)
def test_category_by_op_name(op, expected):
    assert passes.category(op) == expected


def test_a_profiled_pass_splits_its_wall_time(target, one_thread):
    out = passes.profile_passes(target, cache_len=24, k=3, count=2)
    cats = out["categories_ms"]
    assert cats["linear"] > 0 and passes.OUTSIDE in cats
    # the categories, outside_ops included, add up to the pass's wall time
    assert sum(cats.values()) == pytest.approx(out["wall_ms_per_pass"], rel=1e-3)
    assert all(row["category"] == passes.category(row["op"]) for row in out["top_ops"])


def test_pass_times_times_every_row_count_each_round(target, one_thread):
    times = passes.pass_times(target, cache_len=16, rows=[1, 3], repeats=2)
    assert {k: len(v) for k, v in times.items()} == {1: 2, 3: 2}


def test_linears_alone_runs_every_linear_of_a_pass_as_the_pass_does(tiny_llama, one_thread):
    model = tiny_llama(3)
    lean = ModelPair(target=model, tokenizer=None).target_forward
    chain = lean.linears()
    assert len(chain) == 4 * model.config.num_hidden_layers + 1 and chain[-1][1] is model.lm_head
    # with the model's linears the fused ones stand for, the chain's are all of the model's
    fused = {id(m) for layer in lean.layers for m in (layer.qkv, layer.gate_up)}
    layers = model.model.layers  # the model's own q/k/v and gate/up, which the fused ones compute
    attn = [(x.self_attn.q_proj, x.self_attn.k_proj, x.self_attn.v_proj) for x in layers]
    replaced = {id(m) for x, qkv in zip(layers, attn) for m in (*qkv, x.mlp.gate_proj, x.mlp.up_proj)}
    ran = {id(linear) for _, linear in chain} - fused | replaced
    assert ran == {id(m) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    for product, linear in chain:  # each computes its linear
        x = torch.randn(1, 1, linear.in_features)
        with torch.inference_mode():
            torch.testing.assert_close(product(x), torch.nn.functional.linear(x, linear.weight, linear.bias))
    times = passes.linears_alone(lean, repeats=2)
    assert len(times) == 2 and all(t > 0 for t in times)
