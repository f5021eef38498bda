"""A lean decoder forward for agentspec's own passes on Llama-family models (Llama, Qwen2).

Why our own: transformers' eager forward of one decode step is thousands of small ops and module
calls (mask building, per-layer kwargs, separate q/k/v and gate/up products, an 8-op RMSNorm), which
on a small model or a GPU cost as much as the weights' reads (issue 29's profile: a 45 ms float32
step after 400 tokens on this CPU spent ~11 ms in Python outside ops and ~8 ms in ~7,000 small ops,
against 26 ms of linears). vLLM and gpt-fast run model code of their own for the same reason; this
is that for the two families the library's pairs use, on agentspec's KV layout (``kv.GrowingLayer``),
the packed pass (``agentspec.packed``) and the pass linears (``kv.PassLinears``):

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
- the final norm only through the model's own module (an EAGLE head's hook reads it), the LM head
  only over the rows a caller keeps.

It runs only inside agentspec's passes (``kv.pass_rows``) over a ``DynamicCache`` of plain layers or
a ``PackedPass``; every other call of the model (``generate()``, a compiled step, a user's own) is
transformers' forward, unchanged. The lossless tests hold it to transformers' ``generate()``:
float32 token-identical, bfloat16 identical but for near-ties.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from agentspec.attention import NAME as GROUPED_SDPA
from agentspec.attention import (
    blocked_attention,
    blocked_fits,
    blocked_mask,
    grouped_sdpa_forward,
    invariant_rows,
)
from agentspec.kv import GrowingLayer, in_pass, through_forward
from agentspec.packed import PackedPass, causal_mask

# The model classes whose decoder layers this forward reproduces: pre-norm RMSNorm, rotary q/k, SiLU
# gated MLP, optional q/k/v bias (Qwen2); a family with anything more (q/k norms, sliding windows,
# soft-capping) keeps transformers' forward
FAMILIES = ("LlamaForCausalLM", "Qwen2ForCausalLM")


def supported(model: Any) -> bool:
    """Whether ``model`` is one this forward reproduces (see FAMILIES), as loaded for agentspec: sdpa
    attention, SiLU, plain linears, every layer full attention, no forward of its own already."""
    name = type(model).__name__
    if name not in FAMILIES or "forward" in vars(model):
        return False
    config = model.config
    if config._attn_implementation not in ("sdpa", GROUPED_SDPA) or config.hidden_act != "silu":
        return False
    if name == "LlamaForCausalLM" and config.mlp_bias:  # Llama's own switch; Qwen2 has no MLP bias
        return False
    if name == "Qwen2ForCausalLM" and any(t != "full_attention" for t in config.layer_types):
        return False  # Qwen2's sliding-window layers; Llama has none
    layers = [_Layer.parts(layer) for layer in model.model.layers]
    linears = [m for qkv, o, gate_up, down in layers for m in (*qkv, o, *gate_up, down)]
    return all(type(m) is torch.nn.Linear for m in [*linears, model.lm_head])


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
# kernel; in these dtypes that kernel's rounding is rms_norm's but for a last bit in under 2% of rows
# (float32 keeps rms_norm, held bit for bit to transformers' forward). bench_pass times the two
# (its "rms_norm" variant)
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
        self.replaced = [q, k, v, gate, up]  # computed by the fused linears in a pass
        self.qkv, self.gate_up = _fuse([q, k, v]), _fuse([gate, up])
        self.o_proj, self.down_proj = o, down
        self.bind(through_forward)  # what a pass computes for each of the four (``LeanForward.bind``)
        self.intermediate = gate.out_features
        first, second = layer.input_layernorm, layer.post_attention_layernorm
        self.norm1, self.eps1 = first.weight, first.variance_epsilon
        self.norm2, self.eps2 = second.weight, second.variance_epsilon
        # copies, as the packed linears' are: read when installed
        self.doubled1 = torch.cat((self.norm1, self.norm1)).detach() if doubled else None
        self.doubled2 = torch.cat((self.norm2, self.norm2)).detach() if doubled else None

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
    """The lean forward of one model (see the module doc), installed as its instance ``forward``.

    ``install`` fuses the weights and puts ``forward`` in front of the model's own: inside an
    agentspec pass over a cache it can feed, the lean forward; every other call, transformers'.
    ``fused`` are the fused linears (``kv.PassLinears`` gives them their pass paths) and ``replaced``
    the model's linears they stand for in passes (never called in one: PassLinears skips them).
    """

    def __init__(self, model: Any):
        self.model = model
        self.original = model.forward  # the bound transformers forward
        decoder = model.model
        config = model.config
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.final_norm = decoder.norm
        self.lm_head = model.lm_head
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = decoder.layers[0].self_attn.head_dim
        self.scaling = decoder.layers[0].self_attn.scaling
        self.groups = self.heads // self.kv_heads
        weight = self.lm_head.weight
        doubled = weight.device.type == "cpu" and weight.dtype in LAYER_NORM_DTYPES
        self.layers = [_Layer(layer, i, doubled) for i, layer in enumerate(decoder.layers)]
        # the passes of at most this many rows attend blocked (``attention.blocked_attention``), each
        # row with a one-row step's bits, where a pass's rows are held to those and this CPU's kernel
        # keeps them (``blocked_fits``, checked once here); None: through ``agentspec_sdpa``
        limit = invariant_rows(weight.device, weight.dtype)
        fits = limit is not None and blocked_fits(self.kv_heads, self.groups, self.head_dim, weight.dtype)
        self.blocked_rows = limit if fits else None
        self.fused = [m for layer in self.layers for m in (layer.qkv, layer.gate_up)]
        self.replaced = [m for layer in self.layers for m in layer.replaced]
        self.lm_head_product = through_forward(self.lm_head)

    def bind(self, product: Callable[[torch.nn.Linear], Callable[[torch.Tensor], torch.Tensor]]) -> None:
        """Compute each linear (the fused ones, o, down, the LM head) in passes as ``product(linear)``:
        ``through_forward`` until the pair's ``kv.PassLinears`` has given them their paths, then its
        ``product``, which calls a packed weight's kernel directly (this forward only runs inside a
        pass, so the per-call choice of a linear's forward is settled once here; bench_pass's
        "through forward" variant times the difference)."""
        for layer in self.layers:
            layer.bind(product)
        self.lm_head_product = product(self.lm_head)

    def linears(self) -> list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.nn.Linear]]:
        """Each linear a pass computes, in a pass's order (each layer's qkv, o, gate_up and down, then
        the LM head), with what computes it (``bind``): for timing them on their own
        (``agentspec.bench.passes.linears_alone``)."""
        return [*(x for layer in self.layers for x in layer.linears()), (self.lm_head_product, self.lm_head)]

    @classmethod
    def install(cls, model: Any) -> LeanForward:
        lean = cls(model)
        model.forward = partial(_dispatch, lean)
        return lean

    def feeds(self, cache: Any) -> bool:
        """Whether ``cache`` is one the lean forward writes: a packed pass's, or a DynamicCache of
        plain layers (a static, sliding or quantized one keeps transformers' forward)."""
        if isinstance(cache, PackedPass):
            return True
        return type(cache) is DynamicCache and all(
            type(x) in (DynamicLayer, GrowingLayer) for x in cache.layers
        )

    def __call__(self, input_ids, cache, logits_to_keep, position_ids=None, agentspec_pack=None):
        """Logits of the kept rows [1, R, V] after feeding ``input_ids`` [1, T] (see the module doc)."""
        if agentspec_pack is not None:
            pack = agentspec_pack
            spans = [
                self._span(state.cache, *span, mask)
                for state, span, mask in zip(pack.states, pack.spans, pack.masks)
            ]
        else:
            held, n = cache.get_seq_length(), input_ids.shape[1]
            spans = [
                self._span(cache, 0, n, causal_mask(held, n, input_ids.device, self.lm_head.weight.dtype))
            ]
            if position_ids is None:  # a solo pass's rows follow its cache
                position_ids = torch.arange(held, held + n, device=input_ids.device)[None]
        x = self.embed(input_ids)
        rope = self.rope(x, position_ids)
        for layer in self.layers:
            x = self._layer(layer, x, rope, spans)
        x = self.final_norm(x)  # the module: an EAGLE head's hook reads its output
        rows = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return self.lm_head_product(x[:, rows])

    def rope(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``_rotate``'s cosine and signed sine [1, T, 1, D] (broadcast over heads) at ``position_ids``:
        the first half's sine negated once a pass here, not in every layer."""
        cos, sin = self.rotary(x, position_ids)
        half = self.head_dim // 2
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return cos.unsqueeze(2), sin.unsqueeze(2)

    def _span(self, cache: Any, a: int, b: int, mask: torch.Tensor | None) -> tuple:
        """(cache, a, b, mask, blocked) for the pass's rows a:b over ``cache``: blocked, with its own
        mask, where ``blocked_rows`` allows and every layer holds whole key blocks (``GrowingLayer``)."""
        held, n = cache.get_seq_length(), b - a
        if self.blocked_rows is None or n > self.blocked_rows:
            return cache, a, b, mask, False
        if not cache.layers or not all(type(x) is GrowingLayer for x in cache.layers):  # none yet: lazy
            return cache, a, b, mask, False
        weight = self.lm_head.weight
        return cache, a, b, blocked_mask(held, n, self.groups, weight.device, weight.dtype), True

    def _layer(self, layer: _Layer, x: torch.Tensor, rope, spans) -> torch.Tensor:
        batch, t, _ = x.shape
        h = rms_norm(x, layer.norm1, layer.eps1, layer.doubled1)
        qkv = layer.qkv_product(h)
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        qk = _rotate(
            qkv[..., : q_dim + kv_dim].view(batch, t, self.heads + self.kv_heads, self.head_dim), *rope
        )
        q = qk[:, :, : self.heads].transpose(1, 2)  # [1, Hq, T, D]
        k = qk[:, :, self.heads :].transpose(1, 2)  # [1, Hkv, T, D]
        v = qkv[..., q_dim + kv_dim :].view(batch, t, self.kv_heads, self.head_dim).transpose(1, 2)
        outs = []
        for cache, a, b, mask, blocked in spans:
            keys, values = cache.update(k[:, :, a:b], v[:, :, a:b], layer.index)
            if blocked:
                keys, values = cache.layers[layer.index].blocks()
                out = blocked_attention(q[:, :, a:b], keys, values, mask, self.groups, self.scaling)
            else:
                out, _ = grouped_sdpa_forward(
                    layer.attn, q[:, :, a:b], keys, values, mask, scaling=self.scaling
                )
            outs.append(out)  # [1, n, Hq, D]
        attn = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        x = x + layer.o_product(attn.reshape(batch, t, q_dim))
        h = rms_norm(x, layer.norm2, layer.eps2, layer.doubled2)
        gate, up = layer.gate_up_product(h).split(layer.intermediate, dim=-1)
        return x + layer.down_product(F.silu(gate) * up)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [B, T, H, D]: transformers' ``apply_rotary_pos_emb``, elementwise, with
    the sine's first half negated (``signed_sin``) in place of ``rotate_half``'s: (-a) * s and a * (-s)
    are the same bits."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * signed_sin


# The keyword arguments agentspec's passes give the model (``kv.ModelState.forward_now``,
# ``packed.forward_packed``): a call with any other goes to transformers
_PASS_ARGS = frozenset(
    {"input_ids", "cache", "use_cache", "logits_to_keep", "position_ids", "attention_mask", "agentspec_pack"}
)


def _dispatch(lean: LeanForward, *args, **kwargs):
    """The model's forward: the lean one in an agentspec pass over a cache it feeds, else transformers'."""
    cache = kwargs.get("cache")
    pack = kwargs.get("agentspec_pack")
    mask = kwargs.get("attention_mask")
    if args or not in_pass() or not kwargs.keys() <= _PASS_ARGS or not lean.feeds(cache):
        return lean.original(*args, **kwargs)
    if pack is None and mask is not None:  # a solo pass with a mask of its own (padding): transformers'
        return lean.original(*args, **kwargs)
    logits = lean(
        kwargs["input_ids"], cache, kwargs.get("logits_to_keep", 0), kwargs.get("position_ids"), pack
    )
    return CausalLMOutputWithPast(logits=logits)
