"""Grouped-query attention over a mask without copying the KV cache, on every device.

transformers' ``sdpa`` attention expands the key/value heads to one copy per query head
(``repeat_kv``) whenever more than one query token comes with a mask: CUDA's fused kernels take
grouped heads (``enable_gqa``) only without a mask. A speculative verify pass is exactly that case
(k + 1 query tokens, a causal mask over the cache), so every layer of every pass copies the whole
cache, num_key_value_groups times over (for a 7B at long context, more bytes than its weights).

``agentspec_sdpa`` folds the query groups into rows instead (``fold_groups``): the G query heads
that share a KV head become G x q rows of one head, the mask repeated for each group (a small
tensor), so SDPA runs with the KV heads as they are and any kernel that takes a mask (CUDA's
memory-efficient one, the CPU's) does the work. This is transformers' own ``pack_gqa`` (which it
uses for one query token, outside ``torch.compile``) extended to several rows. Registered through
transformers' ``AttentionInterface`` (and ``sdpa``'s mask builder), so a model opts in with
``model.set_attn_implementation("agentspec_sdpa")``. Timed against ``repeat_kv`` and ``enable_gqa`` on
verify passes, logits equal within float32 rounding (docs/benchmarks.md, "Design probes").
Every other case (no mask, position bias, softcap, a per-head mask) is transformers' own path.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from agentspec.kv import KEY_BLOCK, round_up
from agentspec.linears import INVARIANT_ROWS

NAME = "agentspec_sdpa"


def fold_groups(
    query: torch.Tensor, mask: torch.Tensor | None, groups: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Query [B, Hkv*G, q, D] -> [B, Hkv, G*q, D]; mask [b, 1, q, kv] -> [b, 1, G*q, kv] (None: none).

    Query head h reads KV head h // G (``repeat_kv``'s order), so the G heads of a KV head are
    adjacent and fold into its rows; row g*q + i of the folded mask is row i of the mask.
    """
    batch, heads, q_len, dim = query.shape
    folded = query.reshape(batch, heads // groups, groups * q_len, dim)
    if mask is None or mask.shape[2] == 1:  # one row broadcasts over every folded row
        return folded, mask
    b, _, _, kv_len = mask.shape
    rows = mask[:, :, None].expand(b, 1, groups, q_len, kv_len).reshape(b, 1, groups * q_len, kv_len)
    return folded, rows


def grouped_sdpa_forward(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """``sdpa`` attention; with a mask, query groups fold into rows of the KV heads (no KV copies).
    In a packed pass of several sequences (``agentspec.packed``) each attends over its own keys."""
    pack = kwargs.pop("agentspec_pack", None)
    if pack is not None:
        return pack.attend(module, query, dropout, scaling, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    if _folds(query, attention_mask, groups, kwargs):
        return _folded(query, key, value, attention_mask, groups, dropout, scaling), None
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


# Where one query row without a mask folds too (``_folds``): on a CPU, SDPA's bfloat16 kernel for a
# one-row query is several times slower than for a few rows (docs/benchmarks.md, "Design probes");
# float32's is not, and there transformers' path takes the kernels' own grouped heads
FOLD_ONE_ROW_DTYPES = {torch.bfloat16}


def _folds(query: torch.Tensor, mask: torch.Tensor | None, groups: int, kwargs: dict) -> bool:
    """Whether the query groups fold into rows (``_folded``): under a mask the heads share, or as one
    bfloat16 row on a CPU without one; every other case is transformers' own path."""
    if (
        groups == 1
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
        or kwargs.get("output_attentions", False)
    ):
        return False
    if mask is None:
        return query.shape[2] == 1 and query.device.type == "cpu" and query.dtype in FOLD_ONE_ROW_DTYPES
    return mask.shape[1] == 1  # a mask per head does not fold


def _folded(query, key, value, mask, groups: int, dropout, scaling) -> torch.Tensor:
    """SDPA over the query groups folded into rows of the unrepeated KV heads; [B, q, heads, Dv]."""
    batch, heads, q_len, _ = query.shape
    folded, mask = fold_groups(query, mask, groups)
    if mask is None:  # a verify pass's row (a slice of its query) reaches the kernel as a step's does
        folded = folded.contiguous()
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling
    )  # [B, Hkv, G*q, Dv]
    return out.reshape(batch, heads, q_len, value.shape[-1]).transpose(1, 2).contiguous()


def invariant_rows(device: torch.device, dtype: torch.dtype) -> int | None:
    """The most rows an agentspec pass on ``device`` in ``dtype`` computes each exactly as a one-row
    pass would (``rows_apart``): a verify pass's (the last verified token and the drafts), as many as
    its linears keep row-invariant (``linears.INVARIANT_ROWS``); a prefill, chunked or not, keeps one call
    (a row's call costs ~30 us a layer). None where no pass is held to that (float32, GPUs: below)."""
    return INVARIANT_ROWS if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) else None


def rows_apart(device: torch.device, dtype: torch.dtype, rows: int) -> bool:
    """Whether a solo pass of ``rows`` rows (after a cache, under a causal mask) attends its rows one
    by one (``row_by_row``), each as a one-row pass would: a verify-sized pass (at most
    ``invariant_rows``) on a CPU in a dtype coarser than float32. There the attention kernel for
    several rows sums in another order than the one-row kernel, and bfloat16 rounding turns that
    into other logits; with the prepacked linears (``linears.PackedWeight``), which compute each row as
    a one-row pass does (checked on this CPU when packed), a verify pass's rows are then bit-identical
    to one-row steps, so speculative decoding in bfloat16 is token-identical to plain decoding. The
    cost: one small attention call per row and layer (a 5-row pass 9% slower, a 17-row one 37%,
    measured side by side); ``lean`` attends blocked instead where this CPU's kernel allows
    (``blocked_fits``). Elsewhere the rounding it would hide is float32's (token-identical in the
    tests) or a GPU's, whose linears are not row-invariant either (bfloat16 divergences are reported
    with their logit margins)."""
    limit = invariant_rows(device, dtype)
    return limit is not None and 1 < rows <= limit


def row_by_row(module, query, key, value, dropout=0.0, scaling=None, **kwargs):
    """Causal attention of each query row over the keys up to its own position, as a one-row pass
    attends (no mask: the row sees every key it is given)."""
    q_len, kv_len = query.shape[2], key.shape[2]
    groups = getattr(module, "num_key_value_groups", 1)
    fold = _folds(query[:, :, :1], None, groups, kwargs)  # as a one-row pass's, the same for every row
    outs = []
    for i in range(q_len):
        end = kv_len - q_len + i + 1
        row, k, v = query[:, :, i : i + 1], key[:, :, :end], value[:, :, :end]
        if fold:
            outs.append(_folded(row, k, v, None, groups, dropout, scaling))
        else:
            out, _ = sdpa_attention_forward(
                module, row, k, v, None, dropout=dropout, scaling=scaling, **kwargs
            )  # fmt: skip
            outs.append(out)
    return torch.cat(outs, dim=1), None


# Blocked attention: every row of a verify pass in one SDPA call, each with a one-row step's bits.
#
# SDPA's CPU kernel sums a row in an order set by its key count's last block (keys split into blocks
# of ``kv.KEY_BLOCK``) and by how many query rows its call holds (on this AMD EPYC a call of 3 rows, a
# one-row step's folded groups, sums otherwise than one of 4 or more). So a pass's call of several
# rows is not its rows' one-row bits, and ``row_by_row`` calls the kernel once per row: 17 calls a
# layer, each reading every cached key (which made attention the largest share of a bfloat16 agent
# conversation's pass time).
# ``blocked_attention`` gives every call one shape instead, one-row steps and verify passes alike:
# the keys through the end of their last block (``kv.GrowingLayer.blocks``: zeros or stale keys past
# the length, masked), the folded rows padded to a multiple of ``ROW_PAD``, and each row's causal
# end in the mask. A masked key's weight is exactly 0 and adds exactly nothing, so a row's sums are
# the same whichever call holds it. ``blocked_fits`` checks that on the CPU at hand, once per model,
# and ``row_by_row`` stays where it does not hold. (The pass suite times the two: its "row by row"
# variant, ``python -m benchmarks pass``.)
ROW_PAD = 4


def blocked_mask(held: int, n: int, groups: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [1, 1, rows, keys] of a blocked call of ``n`` rows after ``held`` cached keys:
    folded row g*n + i sees keys up to its own position, held + i; padding rows see every key."""
    rows = round_up(groups * n, ROW_PAD)
    keys = round_up(held + n, KEY_BLOCK)
    ends = torch.arange(held + 1, held + n + 1, device=device).repeat(groups)
    ends = torch.nn.functional.pad(ends, (0, rows - groups * n), value=held + n)
    hidden = torch.arange(keys, device=device)[None, :] >= ends[:, None]
    return torch.zeros(rows, keys, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))[None, None]


def blocked_attention(query, keys, values, mask, groups: int, scaling) -> torch.Tensor:
    """Query [1, Hkv*G, n, D] over ``keys``/``values`` [1, Hkv, whole blocks, D] under ``blocked_mask``:
    the output [1, n, Hkv*G, Dv], each row as the row's own one-row call computes it."""
    batch, heads, n, dim = query.shape
    folded, _ = fold_groups(query, None, groups)  # [1, Hkv, G*n, D]
    folded = torch.nn.functional.pad(folded, (0, 0, 0, mask.shape[2] - groups * n))
    out = torch.nn.functional.scaled_dot_product_attention(
        folded, keys, values, attn_mask=mask, scale=scaling
    )
    return out[:, :, : groups * n].reshape(batch, heads, n, values.shape[-1]).transpose(1, 2).contiguous()


def blocked_fits(kv_heads: int, groups: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether this CPU's SDPA gives every row of a blocked call the row's own one-row bits: two
    passes checked row by row on random values, the second's rows across a key block's end."""
    gen = torch.Generator().manual_seed(0)
    for held, n in ((700, 5), (KEY_BLOCK * 2 - 10, 17)):
        keys = round_up(held + n, KEY_BLOCK)
        k, v = (torch.zeros(1, kv_heads, keys, head_dim, dtype=dtype) for _ in range(2))
        k[:, :, : held + n] = (torch.randn(1, kv_heads, held + n, head_dim, generator=gen) * 3).to(dtype)
        v[:, :, : held + n] = torch.randn(1, kv_heads, held + n, head_dim, generator=gen).to(dtype)
        query = torch.randn(1, kv_heads * groups, n, head_dim, generator=gen).to(dtype)
        scale = head_dim**-0.5
        whole = blocked_attention(query, k, v, blocked_mask(held, n, groups, k.device, dtype), groups, scale)
        for i in range(n):
            end = round_up(held + i + 1, KEY_BLOCK)
            mask = blocked_mask(held + i, 1, groups, k.device, dtype)
            one = blocked_attention(query[:, :, i : i + 1], k[:, :, :end], v[:, :, :end], mask, groups, scale)
            if not torch.equal(one, whole[:, i : i + 1]):
                return False
    return True


AttentionInterface.register(NAME, grouped_sdpa_forward)
AttentionMaskInterface.register(NAME, sdpa_mask)


def use_grouped_sdpa(model) -> bool:
    """Switch a model that runs transformers' ``sdpa`` to ``agentspec_sdpa``; True if switched."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    try:
        model.set_attn_implementation(NAME)
    except (ValueError, TypeError, AttributeError):  # a model class that cannot switch: keep its own
        return False
    return getattr(config, "_attn_implementation", None) == NAME
