"""Block drafters: DFlash and DSpark heads, a whole draft in one forward (see docs/speculators.md).

A DFlash head (Chen et al., 2026) drafts B tokens at once. The target's features at every verified
position become its context, ``ctx_i = hidden_norm(fc(f_i))``, and each of its layers attends from
the block [x_p, mask x (B - 1)] at positions p.. to the context's keys and values (that layer's k/v
projections of ctx, kept per call like a KV cache) and, both ways, to the block itself:

    slot k's logits   lm_head(norm(x_k)): x_{p+k} (``sample_from_anchor`` false: slots 1..B-1 draft),
                      or x_{p+k+1} (true: every slot drafts)

A DSpark head (DeepSeek) adds, after that one forward, a sequential Markov bias on the previous token
(``W2 W1[prev]``, low rank) and a confidence head: each slot's estimated chance of surviving
verification given those before it, which reaches the loop with the draft (``Draft.survival``).

The decoder layers are Qwen3-style (q and k RMS-normed per head) whatever the target's family, as
speculators builds them; their modules are transformers' Qwen3 ones. The attention is written here:
a block attending to a context it does not extend is no transformers layer's forward. vLLM runs
these heads only inside its own model runner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from transformers.models.qwen3.modeling_qwen3 import rotate_half

from agentspec.config import GenerationConfig
from agentspec.drafters.base import Draft, Drafter
from agentspec.drafters.eagle import FeatureHead, vocab_logits
from agentspec.grammar import Constraint, apply_bitmask
from agentspec.kv import crop_layers, to_device
from agentspec.packed import one_product
from agentspec.sampling import probabilities
from agentspec.steps import Job, Steps, run_alone

BLOCK_ARCHITECTURES = ("dflash", "dspark")
MARKOV_TYPES = ("vanilla", "gated", "rnn")


class BlockHead(FeatureHead):
    """A DFlash or DSpark head (see the module doc). ``layer_config``: a Qwen3 config of its layers;
    ``options``: the folder's ``block_size``, ``mask_token_id``, ``sample_from_anchor`` and, for dspark,
    ``markov_rank``, ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``."""

    feeds_first_token = False

    def __init__(
        self,
        kind: str,
        layer_config: Any,
        feature_layers: Sequence[int],
        embed: torch.nn.Module,
        head: torch.nn.Module,
        *,
        options: dict[str, Any],
        draft_ids: torch.Tensor | None,
        own_lm_head: bool,
        vocab_size: int,
    ):
        super().__init__(embed, head)
        from transformers import Qwen3Model

        self.architecture = kind
        self.config = layer_config
        self.feature_layers = tuple(feature_layers)
        self.block_size = int(options["block_size"])
        self.mask_token_id = int(options["mask_token_id"])
        self.sample_from_anchor = bool(options.get("sample_from_anchor", kind == "dspark"))
        self.vocab_size = vocab_size
        d, k = layer_config.hidden_size, len(self.feature_layers)
        stack = Qwen3Model(layer_config)
        self.layers, self.norm, self.rotary_emb = stack.layers, stack.norm, stack.rotary_emb
        self.fc = torch.nn.Linear(k * d, d, bias=False)
        self.hidden_norm = type(stack.norm)(d, eps=layer_config.rms_norm_eps)
        self.register_buffer("draft_ids", None if draft_ids is None else draft_ids.long(), persistent=False)
        rows = len(draft_ids) if draft_ids is not None else vocab_size
        if draft_ids is not None or own_lm_head:
            self.lm_head = torch.nn.Linear(d, rows, bias=False)
        self.markov_type = None
        if kind == "dspark":
            self.markov_type = options.get("markov_head_type", "vanilla")
            self.markov_head = _markov_head(
                self.markov_type, vocab_size, rows, int(options["markov_rank"]), d
            )
            self.with_markov = bool(options.get("confidence_head_with_markov", True))
            if options.get("enable_confidence_head", True):
                width = d + (int(options["markov_rank"]) if self.with_markov else 0)
                self.confidence_head = torch.nn.Module()
                self.confidence_head.proj = torch.nn.Linear(width, 1)

    @property
    def drafts_per_block(self) -> int:
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """The context rows [T, H] for the target's features [T, k x H]."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def extend(self, ctx: torch.Tensor, cache) -> None:
        """Write each layer's keys and values of context rows ``ctx`` [T, H] after ``cache``'s."""
        held, n = cache.get_seq_length(), ctx.shape[0]
        x = ctx[None]
        cos, sin = self.rotary_emb(x, torch.arange(held, held + n, device=x.device)[None])
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            k = attn.k_norm(attn.k_proj(x).view(1, n, -1, attn.head_dim)).transpose(1, 2)
            v = attn.v_proj(x).view(1, n, -1, attn.head_dim).transpose(1, 2)
            cache.update(_rotate(k, cos, sin), v, i)

    @torch.inference_mode()
    def block(self, anchor: int, cache) -> torch.Tensor:
        """The block's final hidden states [B, H] after the context in ``cache``, anchored at ``anchor``."""
        return self.blocks([anchor], [cache])[0]

    @torch.inference_mode()
    def blocks(self, anchors: Sequence[int], caches: Sequence[Any]) -> list[torch.Tensor]:
        """Several calls' blocks in one forward: each [B, H] after the context in its cache.

        The blocks' rows go through every linear together (the head's weights read once for them
        all); each block attends over its own context. Each layer writes a block's keys and values
        after its context's, where the cache's layers grow in place (no copy of the context), and the
        block attends both ways over them; they are cropped off again after the forward: the block is
        not context."""
        b, n = self.block_size, len(anchors)
        held = [cache.get_seq_length() for cache in caches]
        ids = torch.full((1, n * b), self.mask_token_id, dtype=torch.long, device=self.device)
        ids[0, ::b] = to_device(list(anchors), self.device)
        x = self.embed(ids).to(self.dtype)
        positions = torch.cat([torch.arange(h, h + b, device=x.device) for h in held])[None]
        cos, sin = self.rotary_emb(x, positions)
        try:
            for i, layer in enumerate(self.layers):
                x = self._layer(i, layer, x, (cos, sin), caches)
        finally:  # each layer that took a block's rows gives them back (a failed layer: none)
            for cache, h in zip(caches, held):
                crop_layers(cache, h)
        return list(self.norm(x)[0].split(b))

    def _layer(self, i: int, layer: Any, x: torch.Tensor, rope: tuple, caches: Sequence[Any]) -> torch.Tensor:
        """Layer ``i`` over the blocks' rows ``x`` [1, n x B, H], each block attending over its own
        cache's context and itself (its keys and values written there first)."""
        attn, rows = layer.self_attn, x.shape[1]
        h = layer.input_layernorm(x)
        q = _rotate(attn.q_norm(attn.q_proj(h).view(1, rows, -1, attn.head_dim)).transpose(1, 2), *rope)
        k = _rotate(attn.k_norm(attn.k_proj(h).view(1, rows, -1, attn.head_dim)).transpose(1, 2), *rope)
        v = attn.v_proj(h).view(1, rows, -1, attn.head_dim).transpose(1, 2)
        b, outs = self.block_size, []
        for j, cache in enumerate(caches):
            at = slice(j * b, (j + 1) * b)
            keys, values = cache.update(k[:, :, at], v[:, :, at], i)
            outs.append(
                F.scaled_dot_product_attention(q[:, :, at], keys, values, scale=attn.scaling, enable_gqa=True)
            )
        out = torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]
        x = x + attn.o_proj(out.transpose(1, 2).reshape(1, rows, -1))
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def scores(self, hid: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Logits over the target's vocabulary [..., V] for block hidden states [..., H] (plus a
        Markov ``bias`` over the head's rows)."""
        if not hasattr(self, "lm_head"):
            return self._shared["head"](hid) if bias is None else self._shared["head"](hid) + bias
        sub = self.lm_head(hid) if bias is None else self.lm_head(hid) + bias
        return sub if self.draft_ids is None else vocab_logits(sub, self.draft_ids, self.vocab_size)

    def step(self, hid: torch.Tensor, prev: int, state: torch.Tensor | None):
        """DSpark's sequential step for one slot: (logits [V], survival estimate or None, the Markov
        state) given the slot's hidden state [H] and the previous token's target id."""
        head = self.markov_head
        e = head.markov_w1.weight[prev].to(self.dtype)
        if self.markov_type == "vanilla":
            bias = head.markov_w2(e)
        elif self.markov_type == "gated":
            bias = head.markov_w2(torch.sigmoid(head.gate_proj(torch.cat([hid, e]))) * e)
        else:
            state = e.new_zeros(head.markov_w2.in_features) if state is None else state
            gate, cand, out = head.joint_proj(torch.cat([state, e, hid])).chunk(3)
            gate = torch.sigmoid(gate)
            state = gate * state + (1.0 - gate) * torch.tanh(cand)
            bias = head.markov_w2(torch.tanh(out))
        survival = None
        if hasattr(self, "confidence_head"):
            inputs = torch.cat([hid, e]) if self.with_markov else hid
            survival = torch.sigmoid(self.confidence_head.proj(inputs))[0]
        return self.scores(hid, bias), survival, state


def _markov_head(kind: str, vocab: int, rows: int, rank: int, width: int) -> torch.nn.Module:
    if kind not in MARKOV_TYPES:
        raise ValueError(f"markov_head_type {kind!r}: expected one of {MARKOV_TYPES}")
    head = torch.nn.Module()
    head.markov_w1 = torch.nn.Embedding(vocab, rank)
    head.markov_w2 = torch.nn.Linear(rank, rows, bias=False)
    if kind == "gated":
        head.gate_proj = torch.nn.Linear(width + rank, rank)
    elif kind == "rnn":
        head.joint_proj = torch.nn.Linear(2 * rank + width, 3 * rank)
    return head


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [1, heads, T, D] at ``cos``/``sin`` [1, T, D], transformers' way (its
    ``apply_rotary_pos_emb`` rotates a q and a k together; the context's rows have no q)."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


class BlockState:
    """A block head's context for one call: each layer's keys and values of the target's verified
    features, for positions ``[base, end)`` (features arrive with each verify pass; a gap, such as a
    prefix restored from the prefix cache whose features were never computed, restarts it)."""

    def __init__(self, head: BlockHead):
        self.head = head
        self.reset()

    def reset(self) -> None:
        self.cache = self.head.new_cache()
        self.base = self.end = 0

    @torch.inference_mode()
    def observe(self, pos: int, features: torch.Tensor) -> None:
        """The target's features of verified positions ``[pos, pos + len(features))``."""
        held = self.end > self.base
        if held and self.base <= pos < self.end:  # rows the context holds (fed again): the rest only
            features, pos = features[self.end - pos :], self.end
        if not len(features):
            return
        if not held or pos != self.end:  # nothing yet, or a gap: the context restarts at ``pos``
            self.cache, self.base = self.head.new_cache(), pos
        try:
            self.head.extend(self.head.project(features.detach()), self.cache)
        except BaseException:
            self.reset()
            raise
        self.end = pos + len(features)


class BlockDrafter(Drafter):
    """Drafts with a ``BlockHead``: up to ``drafts_per_block`` tokens from one forward of its layers
    over the target's features (DSpark: then its sequential head, token by token)."""

    name = "model"
    masks_own_draft = True  # each slot drawn under the grammar's mask, pushed onto its path

    def __init__(self, head: BlockHead, vocab_size: int, name: str | None = None):
        self.head = head
        self.vocab_size = vocab_size
        self.feature_layers = head.feature_layers
        self.context_rows = head.context_rows
        self.draft_cap = head.drafts_per_block
        self.state = BlockState(head)
        if name is not None:
            self.name = name

    def observe_features(self, position: int, features: torch.Tensor) -> None:
        self.state.observe(position, features)

    def propose(
        self, seq, k, config: GenerationConfig, generator, constraint: Constraint | None = None
    ) -> Draft:
        """Up to ``k`` tokens after ``seq``, drafted where the context reaches its last token; with a
        ``constraint``, each drawn under its mask and pushed onto its path."""
        return run_alone(self.propose_steps(seq, k, config, generator, constraint))

    @torch.inference_mode()
    def propose_steps(
        self, seq, k, config: GenerationConfig, generator, constraint: Constraint | None = None
    ) -> Steps[Draft]:
        """``propose``, its block's forward a job that a round of several calls' drafting runs in
        one forward of the head for all their blocks."""
        p = len(seq) - 1  # the anchor: the last verified token, whose features come with the next pass
        k = min(k, self.draft_cap)
        if k <= 0 or self.state.end != p or self.state.end == self.state.base:
            return Draft([])
        head = self.head
        block = _Block(self.state, seq[-1], k if head.markov_type is None else 0)  # DFlash: one product
        hid, every = yield Job(id(head), block.alone, _together, block)
        if constraint is None:
            return _on_device(head, hid, every, seq[-1], k, config, generator)
        return _under_grammar(head, hid, every, seq[-1], k, config, generator, constraint)

    def reset(self) -> None:
        self.state.reset()


@dataclass
class _Block:
    """One call's block: its context (``state``), its ``anchor``, and how many of its drafting slots
    to score with it (``scored``; 0: a DSpark head scores each slot after its Markov step)."""

    state: BlockState
    anchor: int
    scored: int

    def slots(self, hid: torch.Tensor) -> torch.Tensor:
        """The drafting slots' rows of the block's hidden states [B, H]."""
        return hid if self.state.head.sample_from_anchor else hid[1:]

    def alone(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Its slots' hidden states and the scored slots' logits (None: none), in a forward of its own."""
        head = self.state.head
        hid = self.slots(head.block(self.anchor, self.state.cache))
        return hid, head.scores(hid[: self.scored]) if self.scored else None


def _together(jobs: list[Job]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Several calls' blocks (``Job.payload``: each a ``_Block``) in one forward of the head and one
    product of its LM head over the slots they score."""
    blocks: list[_Block] = [job.payload for job in jobs]
    head = blocks[0].state.head
    anchors, caches = [blk.anchor for blk in blocks], [blk.state.cache for blk in blocks]
    hids = [blk.slots(h) for blk, h in zip(blocks, head.blocks(anchors, caches))]
    scored = one_product(
        [h[: blk.scored] if blk.scored else None for h, blk in zip(hids, blocks)], head.scores
    )
    return list(zip(hids, scored))


def _on_device(
    head: BlockHead, hid, every, anchor: int, k: int, config: GenerationConfig, generator
) -> Draft:
    """The block's ``k`` tokens drawn on the device, none read: DFlash's slots at once, DSpark's slot by
    slot (its Markov step takes the previous token as a device index). The verification reads them
    with its result."""
    if every is not None:  # DFlash: every slot scored in one product
        tokens, q = _draw_rows(every[:k].float(), config, generator)
        return Draft(tokens, q)
    prev = to_device([anchor], head.device)[0]
    tokens, qs, survival, markov = [], [], [], None
    for slot in range(k):
        logits, chance, markov = head.step(hid[slot], prev, markov)
        token, q = _draw_rows(logits[None].float(), config, generator)
        prev = token[0]
        tokens.append(prev)
        qs.append(q)
        survival.append(chance)
    q = torch.cat(qs) if qs[0] is not None else None
    confidence = torch.stack(survival) if survival[0] is not None else None
    return Draft(torch.stack(tokens), q, survival=confidence)


def _under_grammar(head: BlockHead, hid, every, anchor: int, k, config, generator, constraint) -> Draft:
    """The block's tokens each drawn under the grammar's mask and pushed onto its path (read one by
    one: the grammar's matcher runs on the host)."""
    tokens, qs, survival = [], [], []
    prev, markov = anchor, None
    for slot in range(k):
        if every is not None:
            logits, chance = every[slot], None
        else:
            logits, chance, markov = head.step(hid[slot], prev, markov)
        bitmask = constraint.bitmask()
        if constraint.terminated or not bool(bitmask.any()):
            break
        logits = apply_bitmask(logits[None], bitmask[None])[0]
        token, q = _draw(logits.float(), config, generator)
        if not constraint.push(token):
            break
        tokens.append(token)
        qs.append(q)
        survival.append(chance)
        prev = token
    if not tokens:
        return Draft([])
    q = torch.stack(qs) if qs[0] is not None else None
    confidence = torch.stack(survival) if survival[0] is not None else None
    return Draft(tokens, q, survival=confidence)


def _draw_rows(
    logits: torch.Tensor, config: GenerationConfig, generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A token per row of ``logits`` [n, V], on the device: the argmax when greedy, else a draw from
    the warped distribution (returned as q [n, V])."""
    if config.greedy:
        return logits.argmax(-1), None
    q = probabilities(logits, config.temperature, config.top_k, config.top_p)
    return torch.multinomial(q, 1, generator=generator)[:, 0], q


def _draw(logits: torch.Tensor, config: GenerationConfig, generator) -> tuple[int, torch.Tensor | None]:
    """A token from ``logits`` [V]: the argmax when greedy, else a draw from the warped distribution
    (returned as its q)."""
    if config.greedy:
        return int(logits.argmax()), None
    q = probabilities(logits[None], config.temperature, config.top_k, config.top_p)[0]
    return int(torch.multinomial(q, 1, generator=generator)), q
