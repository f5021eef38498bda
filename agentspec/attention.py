"""Grouped-query attention on CPUs without copying the KV cache for every verify pass.

transformers' ``sdpa`` attention expands the key/value heads to one copy per query head
(``repeat_kv``) whenever more than one query token comes with a mask: CUDA's fused SDPA kernels
need that. A speculative verify pass is exactly that case (k + 1 query tokens, a causal mask
over the cache), so on a CPU every layer of every pass copies the whole cache, num_key_value_groups
times over. PyTorch's CPU SDPA handles grouped heads itself (``enable_gqa=True``). ``agentspec_sdpa``
is transformers' ``sdpa`` with that one case changed, registered through transformers'
``AttentionInterface`` (and ``sdpa``'s mask builder), so a model opts in with
``model.set_attn_implementation("agentspec_sdpa")``. ``benchmarks/bench_attention.py`` measures
what it saves on verify passes (``benchmarks/results/attention.json``), with bit-identical logits.
Every other case (GPUs, one-token steps, position bias, softcap) is transformers' own path.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "agentspec_sdpa"


def grouped_sdpa_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """``sdpa`` attention; on CPU, several query tokens attend to grouped KV heads without copies."""
    groups = getattr(module, "num_key_value_groups", 1)
    q_len, kv_len = query.shape[2], key.shape[2]
    plain = (
        query.device.type != "cpu"
        or groups == 1
        or q_len == 1  # transformers already folds the groups into the query for one token
        or (attention_mask is None and q_len != kv_len)  # its causal-alignment special case
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or kwargs.get("output_attentions", False)
    )
    if plain:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    causal = attention_mask is None and (
        is_causal if is_causal is not None else getattr(module, "is_causal", True)
    )
    out = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=True,
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(NAME, grouped_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_grouped_sdpa(model) -> bool:
    """Switch a CPU model that runs transformers' ``sdpa`` to ``agentspec_sdpa``; True if switched."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if next(model.parameters()).device.type != "cpu":
        return False
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, TypeError, AttributeError):  # a model class that cannot switch: keep its own
        return False
    return getattr(config, "_attn_implementation", None) == NAME
