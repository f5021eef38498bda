"""EAGLE-3 heads (Li et al., 2025) as the ``speculators`` format defines them (see docs/speculators.md).

An EAGLE-3 head drafts from several of the target's layers at once, not only its last:

    g_i = fc(norms(f_i))      f_i: the residual streams entering the target's layers ``feature_layers``
                              at position i, side by side [k x H] (taken in the verify pass itself)
    first layer at p          attention and MLP over cat[input_layernorm(embed(x_p)), hidden_norm(g_{p-1})]
                              (2H wide), the residual hidden_norm(g_{p-1}) (``norm_before_residual``) or g
    later layers              the target family's decoder layers
    logits                    lm_head(norm(x)) over the head's draft vocabulary; target id = d + d2t[d]

Drafting further than one token feeds the head its own output x in place of g (as ``EagleState``
does for every head). The embeddings are the target's (a speculators folder stores a copy: checked
and dropped, ``agentspec.head_folder``); the LM head is the head's own over a draft vocabulary, or the
target's where the head scores the whole vocabulary.

The modules are transformers' (the family's decoder layers, RMSNorm and rotary embedding, built from
the folder's ``transformer_layer_config``); the first layer's forward is written here because its
input is two normed halves, which no transformers layer takes. vLLM's and SGLang's EAGLE-3 models are
bound to their own runners, and speculators (which defines the format) pins an older transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from agentspec.attention import use_grouped_sdpa
from agentspec.drafters.eagle import FeatureHead, one_row_vocab, vocab_logits
from agentspec.packed import causal_mask

EAGLE3_ARCHITECTURE = "eagle3"


class Eagle3Head(FeatureHead):
    """An EAGLE-3 head (see the module doc), with what ``EagleState`` calls: ``project``, ``hidden``,
    ``scores``, ``new_cache``.

    ``layer_config``: the decoder layers' transformers config (the folder's
    ``transformer_layer_config``); ``options``: the folder's norm switches (``norm_before_residual``,
    ``norm_before_fc``, ``fc_norm``, ``norm_output``); ``draft_ids``: the target id of each draft-vocabulary
    id (``arange(Vd) + d2t``), None when the head scores the target's whole vocabulary: with its own LM
    head (``own_lm_head``, as speculators saves one), else the target's.
    """

    architecture = EAGLE3_ARCHITECTURE
    feeds_first_token = False  # x_0 has no g_{-1}: like vLLM, the head's first entry is x_1's

    def __init__(
        self,
        layer_config: Any,
        feature_layers: Sequence[int],
        embed: torch.nn.Module,
        head: torch.nn.Module,
        *,
        options: dict[str, bool],
        draft_ids: torch.Tensor | None = None,
        own_lm_head: bool = True,
        vocab_size: int,
    ):
        super().__init__(embed, head)
        from transformers import AutoModel

        self.config = layer_config
        self.feature_layers = tuple(feature_layers)
        self.norm_before_residual = options.get("norm_before_residual", True)
        self.norm_output = options.get("norm_output", False)
        self.vocab_size = vocab_size
        d, k = layer_config.hidden_size, len(self.feature_layers)
        stack_config = one_row_vocab(layer_config)  # the family's layers, norm and rotary
        stack_config._attn_implementation = "sdpa"
        stack = AutoModel.from_config(stack_config)
        norm_class = type(stack.norm)
        eps = layer_config.rms_norm_eps
        if options.get("norm_before_fc"):
            self.input_norm = norm_class(k * d, eps=eps)
        if options.get("fc_norm"):
            self.fc_norm = torch.nn.ModuleList(norm_class(d, eps=eps) for _ in range(k))
        self.fc = torch.nn.Linear(k * d, d, bias=False)
        self.layers = stack.layers
        self.norm = stack.norm
        self.rotary_emb = stack.rotary_emb
        # its layers attend through ``agentspec_sdpa``, which runs several calls' feeds as one packed
        # pass (``hidden``'s ``pack``); where the family cannot switch, each feed runs alone
        self.packs = use_grouped_sdpa(stack)
        first = self.layers[0]
        first.hidden_norm = norm_class(d, eps=eps)
        attn = first.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):  # the first layer reads [embedding, feature]
            old = getattr(attn, name)
            setattr(attn, name, torch.nn.Linear(2 * d, old.out_features, bias=old.bias is not None))
        # moves with the head (a buffer), not saved (the folder's d2t says it)
        self.register_buffer("draft_ids", None if draft_ids is None else draft_ids.long(), persistent=False)
        if draft_ids is not None or own_lm_head:
            rows = len(draft_ids) if draft_ids is not None else vocab_size
            self.lm_head = torch.nn.Linear(d, rows, bias=False)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """g [T, H] from the target's features [T, k x H] (the ``feature_layers``, side by side)."""
        f = features.to(self.dtype)
        if hasattr(self, "input_norm"):
            f = self.input_norm(f)
        elif hasattr(self, "fc_norm"):
            f = torch.cat(
                [norm(part) for norm, part in zip(self.fc_norm, f.chunk(len(self.fc_norm), -1))], -1
            )
        return self.fc(f)

    def hidden(self, g: torch.Tensor, ids: torch.Tensor, cache=None, pack=None) -> torch.Tensor:
        """What the head feeds back [1, T, H] for g (or its own earlier output) [1, T, H] beside token
        ids [1, T], after ``cache`` or as the rows of ``pack`` (an ``agentspec.packed.PackedPass`` over
        several states; ``packs``): the last layer's output (its norm with ``norm_output``)."""
        g = g.to(self.dtype)
        if pack is None:
            held, n = cache.get_seq_length(), ids.shape[1]
            positions = torch.arange(held, held + n, device=ids.device)[None]
            mask, where = causal_mask(held, n, g.device, self.dtype), {"cache": cache}
        else:  # each state's rows attend over its own cache, masked as alone (``PackedPass.attend``)
            positions, mask, where = pack.positions, None, {"cache": pack, "agentspec_pack": pack}
        rope = self.rotary_emb(g, positions)
        first = self.layers[0]
        h = first.hidden_norm(g)
        x = torch.cat([first.input_layernorm(self.embed(ids).to(self.dtype)), h], dim=-1)
        x, _ = first.self_attn(x, position_embeddings=rope, attention_mask=mask, **where)
        x = x + (h if self.norm_before_residual else g)
        x = x + first.mlp(first.post_attention_layernorm(x))
        for layer in self.layers[1:]:
            x = layer(x, attention_mask=mask, position_embeddings=rope, **where)
        return self.norm(x) if self.norm_output else x

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary [..., V] for ``hidden``'s outputs [..., H]."""
        x = x if self.norm_output else self.norm(x)
        if self.draft_ids is None:
            return self.lm_head(x) if hasattr(self, "lm_head") else self._shared["head"](x)
        return vocab_logits(self.lm_head(x), self.draft_ids, self.vocab_size)
