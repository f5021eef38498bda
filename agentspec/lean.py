"""A lean decoder forward for agentspec's own passes on Llama-family models (Llama, Qwen2, Qwen3).

Why our own: transformers' eager forward of one decode step is thousands of small ops and module
calls (mask building, per-layer kwargs, separate q/k/v and gate/up products, an 8-op RMSNorm), which
on a small model or a GPU cost as much as the weights' reads (profiled: a 45 ms float32 step after
400 tokens on a 2-core CPU spent ~11 ms in Python outside ops and ~8 ms in ~7,000 small ops, against
26 ms of linears). vLLM and gpt-fast run model code of their own for the same reason; this
is that for the two families the library's pairs use, on agentspec's KV layout (``kv.GrowingLayer``),
the packed pass (``agentspec.packed``) and the pass linears (``linears.PassLinears``):

- q, k and v are one linear, and gate and up another (``_fuse``: the model's parameters become views
  of the fused weight, so no weight is held twice);
- each layer's norms in one kernel (``rms_norm``: ``torch.rms_norm``, or on a CPU in bfloat16 or
  float16 ``F.layer_norm`` over ``[x, -x]``); rotary embedding applied to q and k in one op set, from
  the model's own ``rotary_emb`` (every RoPE scaling transformers knows);
- attention per sequence on its own cache: in bfloat16 on a CPU, a pass of up to ``invariant_rows``
  rows (one-row steps too) blocked, one call a layer whose rows are each a one-row step's bits
  (``attention.blocked_attention``, where ``blocked_fits`` holds on this CPU; else row by row);
  otherwise through ``agentspec_sdpa``'s function with the mask a solo pass would have (one row:
  grouped heads; several: query groups folded into rows over a causal mask);
- the features a caller asks for (``agentspec.forward``: a layer's input, the final norm's output)
  taken as the pass computes them, the LM head only over the rows a caller keeps.

The pair calls it for its own passes (``kv.ModelState.forward``, ``packed.forward_packed``) over
a cache of ``kv.GrowingLayer``s or a ``PackedPass``; every other call of the model (``generate()``,
a compiled step, a user's own) is transformers' forward, which nothing here changes. The lossless
tests hold it to transformers' ``generate()``: float32 token-identical, bfloat16 identical but for
near-ties.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from agentspec.attention import NAME as GROUPED_SDPA
from agentspec.attention import (
    blocked_attention,
    blocked_fits,
    blocked_mask,
    grouped_sdpa_forward,
    invariant_rows,
    row_by_row,
    rows_apart,
)
from agentspec.forward import PassOut, feature_index
from agentspec.kv import GrowingLayer
from agentspec.linears import plain
from agentspec.packed import causal_mask

# The model classes whose decoder layers this forward reproduces, with their decoder stacks' classes:
# pre-norm RMSNorm, rotary q/k, SiLU gated MLP, optional q/k/v bias (Qwen2, Qwen3), each head's q and k
# RMS-normed before the rotation (Qwen3); a family with anything more (sliding windows, soft-capping)
# keeps transformers' forward
FAMILIES = {
    "LlamaForCausalLM": "LlamaModel",
    "Qwen2ForCausalLM": "Qwen2Model",
    "Qwen3ForCausalLM": "Qwen3Model",
}


def supported(model: Any) -> bool:
    """Whether ``model`` is one this forward reproduces (see FAMILIES), as loaded for agentspec: sdpa
    attention, SiLU, plain linears, every layer full attention, no forward of its own already."""
    if type(model).__name__ not in FAMILIES or "forward" in vars(model):
        return False
    return type(model.lm_head) is torch.nn.Linear and supported_decoder(model.model)


def supported_decoder(decoder: Any) -> bool:
    """Whether the decoder stack ``decoder`` (a model's ``.model``, or an EAGLE head's layer) is one this
    forward reproduces (see ``supported``)."""
    name = type(decoder).__name__
    if name not in FAMILIES.values() or "forward" in vars(decoder):
        return False
    config = decoder.config
    if config._attn_implementation not in ("sdpa", GROUPED_SDPA) or config.hidden_act != "silu":
        return False
    if name == "LlamaModel" and config.mlp_bias:  # Llama's own switch; Qwen2 has no MLP bias
        return False
    if name != "LlamaModel" and any(t != "full_attention" for t in config.layer_types):
        return False  # Qwen's sliding-window layers; Llama has none
    layers = [_Layer.parts(layer) for layer in decoder.layers]
    linears = [m for qkv, o, gate_up, down in layers for m in (*qkv, o, *gate_up, down)]
    return all(type(m) is torch.nn.Linear for m in linears)


def _fuse(parts: list[torch.nn.Linear]) -> torch.nn.Linear:
    """One linear computing ``parts`` side by side; each part's weight (and bias) becomes a view of
    the fused one, so the model computes as before and no weight is held twice."""
    first = parts[0].weight
    out = sum(p.out_features for p in parts)
    bias = parts[0].bias is not None
    # skip_init: every entry is written from the parts below (a random init first cost a third of the load)
    fused = torch.nn.utils.skip_init(
        torch.nn.Linear, first.shape[1], out, bias=bias, device=first.device, dtype=first.dtype
    )
    fused.requires_grad_(False)
    with torch.no_grad():
        at = 0
        for p in parts:
            n = p.out_features
            fused.weight[at : at + n] = p.weight
            p.weight = torch.nn.Parameter(fused.weight[at : at + n], requires_grad=p.weight.requires_grad)
            if bias:
                fused.bias[at : at + n] = p.bias
                p.bias = torch.nn.Parameter(fused.bias[at : at + n], requires_grad=p.bias.requires_grad)
            at += n
    return fused


# Where the norms run as ``F.layer_norm`` over ``[x, -x]`` (``rms_norm``): on a CPU, PyTorch's rms_norm is
# a composite of about ten ops (casts, pow, mean, rsqrt, two products) and its layer_norm one fused
# kernel; in these dtypes that kernel's rounding is rms_norm's but for a last bit in a few rows
# (float32 keeps rms_norm, held bit for bit to transformers' forward). The pass suite times the two
# (``python -m benchmarks pass``, its "rms_norm" variant; figures in docs/benchmarks.md)
LAYER_NORM_DTYPES = {torch.bfloat16, torch.float16}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, doubled: torch.Tensor | None) -> torch.Tensor:
    """RMSNorm of ``x`` over its last dimension. With ``doubled`` (``weight`` twice over), as the
    layer norm of ``[x, -x]``: its mean is 0 and its variance x's mean square, so its first half is
    x's RMSNorm (see LAYER_NORM_DTYPES for why)."""
    width = x.shape[-1]
    if doubled is None:
        return torch.rms_norm(x, (width,), weight, eps)
    return F.layer_norm(torch.cat((x, -x), dim=-1), (2 * width,), doubled, None, eps)[..., :width]


class _Layer:
    """One decoder layer's weights as the lean forward reads them (``doubled``: each norm's weight
    twice over, for ``rms_norm``'s layer-norm way)."""

    def __init__(self, layer: Any, index: int, doubled: bool):
        (q, k, v), o, (gate, up), down = self.parts(layer)
        self.index = index
        self.attn = layer.self_attn  # its attention settings (grouped heads, causal) for agentspec_sdpa
        self.qkv, self.gate_up = _fuse([q, k, v]), _fuse([gate, up])
        self.o_proj, self.down_proj = o, down
        self.bind(plain)  # what a pass computes for each of the four (``LeanForward.bind``)
        self.intermediate = gate.out_features
        first, second = layer.input_layernorm, layer.post_attention_layernorm
        self.norm1, self.eps1 = first.weight, first.variance_epsilon
        self.norm2, self.eps2 = second.weight, second.variance_epsilon
        # copies, as the packed linears' are: read when installed
        self.doubled1 = torch.cat((self.norm1, self.norm1)).detach() if doubled else None
        self.doubled2 = torch.cat((self.norm2, self.norm2)).detach() if doubled else None
        # Qwen3's per-head q and k norms (weight, eps, doubled weight); None for the other families
        self.qk_norms = None
        if getattr(layer.self_attn, "q_norm", None) is not None:
            qn, kn = layer.self_attn.q_norm, layer.self_attn.k_norm
            self.qk_norms = tuple(
                (n.weight, n.variance_epsilon, torch.cat((n.weight, n.weight)).detach() if doubled else None)
                for n in (qn, kn)
            )

    def bind(self, product: Callable[[torch.nn.Linear], Callable[[torch.Tensor], torch.Tensor]]) -> None:
        """Compute the layer's four linears in passes as ``product(linear)`` (``LeanForward.bind``)."""
        self.qkv_product, self.gate_up_product = product(self.qkv), product(self.gate_up)
        self.o_product, self.down_product = product(self.o_proj), product(self.down_proj)

    def linears(self) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.nn.Linear]]:
        """(what computes it in a pass, the linear) for the layer's four, in a pass's order."""
        return [
            (self.qkv_product, self.qkv),
            (self.o_product, self.o_proj),
            (self.gate_up_product, self.gate_up),
            (self.down_product, self.down_proj),
        ]

    @staticmethod
    def parts(layer: Any) -> tuple:
        """((q, k, v), o, (gate, up), down): the layer's linears."""
        attn, mlp = layer.self_attn, layer.mlp
        return (
            (attn.q_proj, attn.k_proj, attn.v_proj),
            attn.o_proj,
            (mlp.gate_proj, mlp.up_proj),
            mlp.down_proj,
        )


class LeanForward:
    """The lean forward of one model (see the module doc): an ``agentspec.forward.Forward`` the pair
    owns and its passes call.

    Built, it fuses the weights (the model's q/k/v and gate/up parameters become views of the fused
    ones: same values, no copy) and computes every linear with ``F.linear``; ``bind`` gives each the
    product the pair's ``linears.PassLinears`` chose (``linears()`` lists what it computes). The
    model's own forward and modules are untouched. ``decoder`` alone (a decoder stack without an LM
    head: an EAGLE head's layer) runs from embeddings to the final norm (``hidden``).
    """

    packs = True  # it runs packed passes (``pack=``)

    def __init__(self, model: Any, decoder: Any = None):
        self.model = model  # whose config numbers the layers (``forward.feature_index``)
        decoder = model.model if decoder is None else decoder
        config = decoder.config
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.final_norm = decoder.norm
        self.lm_head = getattr(model, "lm_head", None)  # None: a decoder stack alone
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        attn = decoder.layers[0].self_attn
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        self.groups = self.heads // self.kv_heads
        weight = attn.o_proj.weight
        self.device, self.dtype = weight.device, weight.dtype
        doubled = weight.device.type == "cpu" and weight.dtype in LAYER_NORM_DTYPES
        self.layers = [_Layer(layer, i, doubled) for i, layer in enumerate(decoder.layers)]
        # the passes of at most this many rows attend blocked (``attention.blocked_attention``), each
        # row with a one-row step's bits, where a pass's rows are held to those and this CPU's kernel
        # keeps them (``blocked_fits``, checked once here); None: row by row or through agentspec_sdpa
        limit = invariant_rows(weight.device, weight.dtype)
        fits = limit is not None and blocked_fits(self.kv_heads, self.groups, self.head_dim, weight.dtype)
        self.blocked_rows = limit if fits else None
        self.lm_head_product = plain(self.lm_head) if self.lm_head is not None else None

    def bind(self, product: Callable[[torch.nn.Linear], Callable[[torch.Tensor], torch.Tensor]]) -> None:
        """Compute each linear (the fused ones, o, down, the LM head) in passes as ``product(linear)``:
        the pair's ``linears.PassLinears.product``, settled once here."""
        for layer in self.layers:
            layer.bind(product)
        if self.lm_head is not None:
            self.lm_head_product = product(self.lm_head)

    def linears(self) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.nn.Linear]]:
        """Each linear a pass computes, in a pass's order (each layer's qkv, o, gate_up and down, then
        the LM head), with what computes it (``bind``): what the pair's ``PassLinears`` decides for,
        and what ``agentspec.bench.passes.linears_alone`` times."""
        head = [(self.lm_head_product, self.lm_head)] if self.lm_head is not None else []
        return [*(x for layer in self.layers for x in layer.linears()), *head]

    def __call__(self, ids, keep, *, cache=None, pack=None, positions=None, features: Sequence[int] = ()):
        """The logits of the kept rows [R, V] after feeding ``ids`` [1, T], and the ``features`` asked
        for (``agentspec.forward``'s numbering), [T, H] each."""
        wanted: dict[int, torch.Tensor | None] = {feature_index(self.model, f): None for f in features}
        x = self.hidden(self.embed(ids), cache=cache, pack=pack, positions=positions, wanted=wanted)
        rows = slice(-keep, None) if isinstance(keep, int) else keep
        found = tuple(wanted[feature_index(self.model, f)] for f in features)
        return PassOut(self.lm_head_product(x[0, rows]), found)

    def hidden(self, x, *, cache=None, pack=None, positions=None, wanted=None) -> torch.Tensor:
        """The final norm's output [1, T, H] for embeddings ``x`` [1, T, H] fed after ``cache`` (or as
        ``pack``'s rows); ``wanted`` (layer index -> None) gets each listed layer's input, and the
        final norm's output at index L."""
        wanted = {} if wanted is None else wanted
        if pack is not None:
            spans = [
                self._span(state.cache, *span, mask)
                for state, span, mask in zip(pack.states, pack.spans, pack.masks)
            ]
            positions = pack.positions
        else:
            held, n = cache.get_seq_length(), x.shape[1]
            spans = [self._span(cache, 0, n, causal_mask(held, n, x.device, self.dtype))]
            if positions is None:  # a solo pass's rows follow its cache
                positions = torch.arange(held, held + n, device=x.device)[None]
        rope = self.rope(x, positions)
        for layer in self.layers:
            if layer.index in wanted:
                wanted[layer.index] = x[0]
            x = self._layer(layer, x, rope, spans)
        x = self.final_norm(x)
        if len(self.layers) in wanted:
            wanted[len(self.layers)] = x[0]
        return x

    def rope(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``_rotate``'s cosine and signed sine [1, T, 1, D] (broadcast over heads) at ``position_ids``:
        the first half's sine negated once a pass here, not in every layer."""
        cos, sin = self.rotary(x, position_ids)
        half = self.head_dim // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos.unsqueeze(2), sin.unsqueeze(2)

    def _span(self, cache: Any, a: int, b: int, mask: torch.Tensor | None) -> tuple:
        """(cache, a, b, mask, way) for the pass's rows a:b over ``cache``, ``way`` how they attend:
        ``BLOCKED`` with its own mask where ``blocked_rows`` allows and every layer holds whole key
        blocks (``GrowingLayer``), ``ROWS`` one by one where a verify-sized pass is held to one-row
        bits otherwise (``attention.rows_apart``), else ``FOLDED`` (``agentspec_sdpa``)."""
        held, n = cache.get_seq_length(), b - a
        apart = mask is not None and rows_apart(self.device, self.dtype, n)
        if self.blocked_rows is None or n > self.blocked_rows:
            return cache, a, b, mask, ROWS if apart else FOLDED
        if not cache.layers or not all(type(x) is GrowingLayer for x in cache.layers):  # none yet: lazy
            return cache, a, b, mask, ROWS if apart else FOLDED
        return cache, a, b, blocked_mask(held, n, self.groups, self.device, self.dtype), BLOCKED

    def _layer(self, layer: _Layer, x: torch.Tensor, rope, spans) -> torch.Tensor:
        batch, t, _ = x.shape
        h = rms_norm(x, layer.norm1, layer.eps1, layer.doubled1)
        qkv = layer.qkv_product(h)
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        qk = qkv[..., : q_dim + kv_dim].view(batch, t, self.heads + self.kv_heads, self.head_dim)
        if layer.qk_norms is not None:  # Qwen3: each head's q and k normed before the rotation
            (qw, q_eps, q_doubled), (kw, k_eps, k_doubled) = layer.qk_norms
            q_part, k_part = qk[:, :, : self.heads], qk[:, :, self.heads :]
            qk = torch.cat(
                (rms_norm(q_part, qw, q_eps, q_doubled), rms_norm(k_part, kw, k_eps, k_doubled)), dim=2
            )
        qk = _rotate(qk, *rope)
        q = qk[:, :, : self.heads].transpose(1, 2)  # [1, Hq, T, D]
        k = qk[:, :, self.heads :].transpose(1, 2)  # [1, Hkv, T, D]
        v = qkv[..., q_dim + kv_dim :].view(batch, t, self.kv_heads, self.head_dim).transpose(1, 2)
        outs = [self._attend(layer, q, k, v, span) for span in spans]  # [1, n, Hq, D] each
        attn = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        x = x + layer.o_product(attn.reshape(batch, t, q_dim))
        h = rms_norm(x, layer.norm2, layer.eps2, layer.doubled2)
        gate, up = layer.gate_up_product(h).split(layer.intermediate, dim=-1)
        return x + layer.down_product(F.silu(gate) * up)

    def _attend(self, layer: _Layer, q, k, v, span: tuple) -> torch.Tensor:
        """One sequence's rows a:b written to its cache and attended over it, the span's way."""
        cache, a, b, mask, way = span
        keys, values = cache.update(k[:, :, a:b], v[:, :, a:b], layer.index)
        if way == BLOCKED:
            keys, values = cache.layers[layer.index].blocks()
            return blocked_attention(q[:, :, a:b], keys, values, mask, self.groups, self.scaling)
        if way == ROWS:
            return row_by_row(layer.attn, q[:, :, a:b], keys, values, scaling=self.scaling)[0]
        return grouped_sdpa_forward(layer.attn, q[:, :, a:b], keys, values, mask, scaling=self.scaling)[0]


# How a span's rows attend (``LeanForward._span``)
BLOCKED, ROWS, FOLDED = "blocked", "rows", "folded"


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [B, T, H, D]: transformers' ``apply_rotary_pos_emb``, elementwise, with
    the sine's first half negated (``signed_sin``) in place of ``rotate_half``'s: (-a) * s and a * (-s)
    are the same bits."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin
