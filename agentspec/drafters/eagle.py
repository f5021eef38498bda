"""EAGLE-style drafting: one decoder layer on the target's own last hidden states (Li et al., 2024).

A draft model of its own sees only tokens, and a small one predicts the target badly (the 2-layer
distilled draft agrees with SmolLM2-135M on about a third of held-out tokens). The target's final
hidden state at a position already holds what the target knows there; EAGLE's head reads it:

    input at position i    fc([f_{i-1}, embed(x_i)])        f: the target's final-norm output
    one decoder layer      of the target's architecture, with its own small KV cache
    output h_i             trained to match f_i, so the target's LM head on h_i predicts x_{i+1}

The feature of the last verified position comes free with every verify pass (``decode`` reads the
target's final norm and hands the verified rows to ``observe``). Drafting further than one token
feeds the head its own output h in place of the feature it does not have yet; those entries are
rolled back and fed again with the target's real features once they are verified.

``EagleState`` keeps the head's cache in step with the verified sequence behind the same interface
as ``agentspec.kv.ModelState`` (``ids``, ``sync``, ``forward``, ``truncate``, ``reset``), so the
``ModelDrafter`` loop, its confidence schedule and ``drafter="auto"`` drive it unchanged. Positions
whose target feature the head never saw (a prefix restored from the prefix cache, the first pass of
a call) get no entry: the head's attention starts at the first position it has a feature for. Its
cache is not kept in the prefix cache; the output is the target's either way.

We write our own because transformers has no EAGLE drafter (its assisted generation takes a draft
model of tokens), and vLLM's and SGLang's are bound to their own model runners.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from agentspec.forward import NORMED
from agentspec.kv import PassIds, common_prefix_len, crop_layers, growing_cache, to_device
from agentspec.packed import PackedPass, one_product
from agentspec.steps import Job, Steps, run_alone

EAGLE_ARCHITECTURE = "eagle"
MAX_PENDING_FEATURES = 4096  # features kept while the head is not fed (a benched draft): the newest
# Filled into the logits of ids outside a draft vocabulary (``vocab_logits``): q = 0 there after a
# softmax, finite so that a grammar mask leaving only such ids still gives a distribution (uniform over
# them), and within float16 range
OUTSIDE_LOGIT = -1.0e4


def vocab_logits(sub: torch.Tensor, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over the target's vocabulary [..., V] from a draft vocabulary's [..., len(ids)] (the
    target id of each row in ``ids``), ``OUTSIDE_LOGIT`` elsewhere."""
    out = sub.new_full((*sub.shape[:-1], vocab_size), OUTSIDE_LOGIT)
    return out.index_copy_(-1, ids, sub)


def with_layers(config, layers: int):
    """A copy of a transformers ``config`` with ``layers`` decoder layers (its per-layer kinds cut)."""
    config = copy.deepcopy(config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types[:layers])
    return config


def one_row_vocab(config):
    """A copy of ``config`` whose embedding table has one row: a head's own stack, which embeds with
    the target's table (no special id falls in the one row)."""
    config = copy.deepcopy(config)
    config.vocab_size = 1
    config.pad_token_id = config.bos_token_id = config.eos_token_id = None
    return config


def eagle_config(target_config):
    """The head's decoder config: the target's, with one layer (and a one-row embedding table, unused:
    the head takes embeddings as input)."""
    config = one_row_vocab(with_layers(target_config, 1))
    config.tie_word_embeddings = False
    return config


class FeatureHead(torch.nn.Module):
    """What a head drafting from the target's features is to ``EagleState``: the target's embeddings
    and LM head it shares (not submodules: neither stored nor trained), where it lives (its ``fc``),
    and the cache of its own layers (``new_cache``; ``config``: theirs), and how many positions of a
    restored prefix it wants computed again for their features (``context_rows``)."""

    config: Any
    fc: torch.nn.Linear
    context_rows = 64
    packs = False  # whether its ``hidden`` runs the feeds of several states as one packed pass (``pack=``)

    def __init__(self, embed: torch.nn.Module, head: torch.nn.Module):
        super().__init__()
        self._shared = {"embed": embed, "head": head}

    @property
    def embed(self) -> torch.nn.Module:
        return self._shared["embed"]

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def new_cache(self):
        return growing_cache(self.config)


class EagleHead(FeatureHead):
    """``fc`` -> one decoder layer -> norm; scores with the target's LM head (shared, or cut to a subset).

    ``embed`` and ``head`` are the target's modules (or a ``SubsetHead`` over its weights): not
    stored with the draft.
    """

    architecture = EAGLE_ARCHITECTURE
    feature_layers = (NORMED,)  # what it drafts from: the target's final norm output
    feeds_first_token = True  # x_0 is fed beside a zero feature (how ``agentspec distill`` trains it)
    context_rows = 0  # none: the embedded head (0.06 of its drafts accepted) would not repay the rows

    def __init__(self, config, embed: torch.nn.Module, head: torch.nn.Module):
        super().__init__(embed, head)
        from transformers import AutoModel

        d = config.hidden_size
        self.config = config
        self.fc = torch.nn.Linear(2 * d, d, bias=True)
        self.decoder = AutoModel.from_config(config)

    @property
    def head(self) -> torch.nn.Module:
        return self._shared["head"]

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.head

    def set_output_embeddings(self, head: torch.nn.Module) -> None:
        self._shared["head"] = head

    def inputs(self, feats: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``fc``'s input [B, T, 2d]: features ``feats`` [B, T, d] beside the embeddings of ``ids`` [B, T]."""
        return torch.cat([feats.to(self.dtype), self.embed(ids).to(self.dtype)], dim=-1)

    def hidden(self, feats, ids, cache=None, attention_mask=None) -> torch.Tensor:
        """[B, T, d] head outputs for features ``feats`` [B, T, d] and token ids [B, T] (see module doc)."""
        x = self.fc(self.inputs(feats, ids))
        out = self.decoder(
            inputs_embeds=x, attention_mask=attention_mask, cache=cache, use_cache=cache is not None
        )
        return out.last_hidden_state

    def forward(self, feats, ids, cache=None, attention_mask=None) -> torch.Tensor:
        return self.head(self.hidden(feats, ids, cache, attention_mask))


def is_feature_head(model) -> bool:
    """Whether ``model`` is a head drafting from the target's features (EAGLE, DFlash, DSpark), not a
    draft model of its own."""
    return isinstance(model, FeatureHead)


def is_eagle(model) -> bool:
    """Whether ``model`` is this module's EAGLE-1 head (``agentspec distill``'s default)."""
    return getattr(model, "architecture", None) == EAGLE_ARCHITECTURE


class EagleForward:
    """What an ``EagleState``'s passes call (the pair's ``ModelPair.draft_head``): the head's ``fc``,
    its decoder layer and the scores of the LM head it shares, as the pair computes them.

    ``decoder``: the lean forward of the head's decoder stack (``agentspec.lean``, where its family
    has one), None for transformers' own; ``fc`` and ``scores``: the pair's products for the head's
    ``fc`` and for the target's LM head (``linears.PassLinears``: packed where the CPU gains), None
    for the modules themselves. The head's own ``hidden`` stays transformers' (distillation trains it).
    """

    def __init__(self, head: EagleHead, decoder=None, fc=None, scores=None):
        self.head = head
        self.decoder = decoder
        self.packs = decoder is not None  # the lean forward runs packed passes of several calls' feeds
        self.fc = fc if fc is not None else head.fc
        self.scores = scores if scores is not None else head.head

    @staticmethod
    def project(features: torch.Tensor) -> torch.Tensor:
        """What the head reads of the target's features: the final norm's output as it is."""
        return features

    def hidden(self, feats: torch.Tensor, ids: torch.Tensor, cache=None, pack=None) -> torch.Tensor:
        """The head's outputs [1, T, d] for features ``feats`` [1, T, d] and ids [1, T] after ``cache``,
        or as the rows of ``pack`` (an ``agentspec.packed.PackedPass`` over several states; ``packs``)."""
        x = self.fc(self.head.inputs(feats, ids))
        if self.decoder is None:
            return self.head.decoder(inputs_embeds=x, cache=cache, use_cache=True).last_hidden_state
        return self.decoder.hidden(x, cache=cache, pack=pack)


class EagleState:
    """An ``EagleHead``'s KV cache and the ids it covers, fed the target's features (see module doc).

    ``ids`` covers positions ``[0, len(ids))``; the cache holds entries for ``[base, len(ids))``.
    Entries ``[base, real)`` were fed the target's features and stay valid; later ones (drafted
    tokens) were fed the head's own output and are rolled back at the next ``sync``.
    """

    def __init__(self, model, run=None):
        self.model = model
        # what its passes call (``project``, ``hidden``, ``scores``): the pair's (``ModelPair.draft_head``),
        # else the head's own modules (an EAGLE-3 head is its own forward)
        if run is None:
            run = EagleForward(model) if isinstance(model, EagleHead) else model
        self.run = run
        self.reset()

    def reset(self) -> None:
        self.cache = self.model.new_cache()
        self.ids: list[int] = []
        self.unread = 0  # drafted entries after ``ids`` fed from the device (their ids not read)
        self.base = 0
        self.real = 0
        self.last: torch.Tensor | None = None  # [d]: the head's output at the last entry
        self._feats: list[torch.Tensor] = []  # target features of positions [feat_pos, feat_end)
        self.feat_pos = self.feat_end = 0
        self.seen = False  # any feature observed in this call

    def check(self) -> None:
        n = self.cache.get_seq_length()
        assert n == len(self.ids) + self.unread - self.base, (
            f"EAGLE cache out of step: {n=} {len(self.ids)=} {self.unread=} {self.base=}"
        )
        assert self.base <= self.real <= len(self.ids), (self.base, self.real, len(self.ids))

    def observe(self, pos: int, hidden: torch.Tensor) -> None:
        """The target's verified features at positions ``[pos, pos + len(hidden))``."""
        if not len(hidden):
            return
        self.seen = True
        hidden = hidden.detach()
        if pos != self.feat_end or not self._feats:
            self._feats, self.feat_pos = [hidden], pos
        else:
            self._feats.append(hidden)
        self.feat_end = pos + len(hidden)
        # too many unfed (a benched head): drop the oldest passes whole, no copy; the head then
        # restarts where its features do
        while (
            len(self._feats) > 1
            and self.feat_end - self.feat_pos - len(self._feats[0]) >= MAX_PENDING_FEATURES
        ):
            self.feat_pos += len(self._feats.pop(0))

    def _take(self, start: int, end: int) -> torch.Tensor:
        """Features of positions [start, end); those before ``end`` are dropped (fed for good)."""
        feats = torch.cat(self._feats) if len(self._feats) > 1 else self._feats[0]
        out = feats[start - self.feat_pos : end - self.feat_pos]
        self._feats, self.feat_pos = [feats[end - self.feat_pos :]], end
        return out

    def truncate(self, length: int) -> None:
        """Keep the entries of ``ids[:length]``, unread ones rolled back (the target's features are
        ``sync``'s business)."""
        length = min(length, len(self.ids))
        extra = len(self.ids) + self.unread - length
        if extra > 0:
            if length <= self.base:
                self.reset_cache(length)
                del self.ids[length:]
            else:
                self.cache.crop(-extra)
                del self.ids[length:]
                self.real = min(self.real, length)
                self.last = None  # the output before the cut is not kept: chaining needs a new pass
            self.unread = 0
        self.check()

    def settle(self, ids: list[int]) -> None:
        """After a verify pass: the unread drafted entries are rolled back (drafted entries read the
        head's own outputs, so they are never kept; ``ids``, their verified values, are not needed)."""
        self.truncate(len(self.ids))

    def reset_cache(self, base: int) -> None:
        self.cache = self.model.new_cache()
        self.base = self.real = base
        self.unread = 0
        self.last = None

    def sync(self, seq: list[int], start: int = 0, end: int | None = None) -> list[int]:
        """Roll back to the verified entries ``seq[:end]`` still starts with; return the ids to feed.

        Drafted entries are always rolled back (they read the head's own outputs). The target's
        features describe the verified sequence, which only grows within a call: a ``seq`` that
        differs inside it is another sequence, and its features are dropped with it. ``start``:
        leading ids the caller knows agree with ``seq`` (``ModelState.sync``).
        """
        end = len(seq) if end is None else end
        common = min(common_prefix_len(self.ids, seq, start), end)
        if common < self.real:
            self._feats, self.feat_pos, self.feat_end, self.seen = [], 0, 0, False
        self.truncate(min(common, self.real))
        return seq[len(self.ids) : end]

    @torch.inference_mode()
    def forward(self, new_ids: list[int] | PassIds, keep: int) -> torch.Tensor:
        """Feed ``new_ids``; return the logits of the last ``keep`` of them [keep, V], or [0, V] when
        the last one could not be fed (``forward_steps``, its feeds run by themselves)."""
        return run_alone(self.forward_steps(new_ids, keep))

    @torch.inference_mode()
    def forward_steps(self, new_ids: list[int] | PassIds, keep: int) -> Steps[torch.Tensor]:
        """``forward`` as a drafter's steps (``agentspec.steps``): each feed of the head is a job that a
        round of several calls' drafting runs in one pass of the head with theirs.

        A token whose previous position has a target feature is fed with it (in one batch); one past
        the verified positions is fed the head's last output (drafting); one whose previous feature
        this call never had gets no entry (the head's attention restarts after it). Tokens that can
        wait for their feature (before the first verify pass, or with nothing to chain from) are
        left out of ``ids``: the next ``sync`` returns them again.
        """
        if isinstance(new_ids, PassIds):
            if new_ids.device is not None:
                assert not new_ids.host, "a drafted token on the device comes alone"
                return (yield from self._draft_step(new_ids.device))
            new_ids = new_ids.host
        assert new_ids, "forward needs at least one new token"
        assert not self.unread, "host ids cannot follow unread entries: settle first"
        outs: list[torch.Tensor] = []
        logits: torch.Tensor | None = None  # the last feed's, where it was asked for them
        i, n = 0, len(new_ids)
        fed_last = False
        while i < n and self.seen:  # before the call's first verify pass: nothing to read yet
            pos = len(self.ids)  # of new_ids[i]
            first = pos == 0 and self.model.feeds_first_token
            has_feature = first or self.feat_pos <= pos - 1 < self.feat_end
            if has_feature and self.real == pos:
                end = min(n, i + self.feat_end - (pos - 1))  # tokens with a real feature before them
                if first:
                    end = min(n, i + 1)
                feats = (
                    self._zero_row() if first else self.run.project(self._take(pos - 1, pos - 1 + end - i))
                )
                h, logits = yield from self._feed(feats, new_ids[i:end], keep if end == n else 0)
                outs.append(h)
                self.real = len(self.ids)
                i, fed_last = end, True
            elif pos - 1 >= self.feat_end:  # past the verified positions: a draft
                if self.last is None or len(self.ids) == self.base:
                    break  # nothing to chain from: fed once the target has verified it
                # the head's own output in place of the feature
                h, logits = yield from self._feed(
                    self.last[None], new_ids[i : i + 1], keep if i + 1 == n else 0
                )
                outs.append(h)
                i, fed_last = i + 1, True
            else:  # a feature this call never had (a restored prefix): no entry, restart after it
                if len(self.ids) > self.base:
                    self.reset_cache(len(self.ids))
                self.ids.append(new_ids[i])
                self.base = self.real = len(self.ids)
                i, fed_last = i + 1, False
        self.check()
        if not fed_last:  # the last token has no entry: nothing to predict from
            return torch.zeros((0, 1))
        if logits is None or len(logits) < keep:  # the rows asked for span several feeds
            logits = self.run.scores(torch.cat(outs)[-keep:])
        return logits

    def _draft_step(self, ids: torch.Tensor) -> Steps[torch.Tensor]:
        """Feed drafted tokens still on the device [1] with the head's last output; their logits
        [1, V], or [0, V] with nothing to chain from. Their entries are ``unread``."""
        if self.last is None or len(self.ids) + self.unread == self.base:
            return torch.zeros((0, 1))
        return (yield from self._feed(self.last[None], ids, 1))[1]

    def _zero_row(self) -> torch.Tensor:
        return torch.zeros(
            (1, self.model.config.hidden_size), device=self.model.device, dtype=self.model.dtype
        )

    def _feed(
        self, feats: torch.Tensor, ids: list[int] | torch.Tensor, keep: int
    ) -> Steps[tuple[torch.Tensor, torch.Tensor | None]]:
        """Feed ``ids`` beside ``feats`` [n, d]; the head's outputs [n, d] and the logits of the last
        ``keep`` of them (None for 0), computed with other calls' feeds where the head packs them."""
        on_device = isinstance(ids, torch.Tensor)
        x = ids.reshape(1, -1) if on_device else to_device(ids, self.model.device)[None]
        feed = _Feed(self, feats[None].to(self.model.device), x, keep)
        together = _feeds_together if self.run.packs else None
        try:
            h, logits = yield Job(id(self.run), feed.alone, together, feed)
        except BaseException:
            self.reset()
            raise
        if on_device:
            self.unread += x.shape[1]
        else:
            self.ids.extend(ids)
        self.last = h[-1]
        return h, logits

    def _roll_back(self, held: int) -> None:
        """Undo a packed pass that failed, which may have extended some layers only (as
        ``ModelState._roll_back``); a cache that cannot be cropped starts clean."""
        try:
            crop_layers(self.cache, held)
        except Exception:
            self.reset()


@dataclass
class _Feed:
    """One feed of a head's state: ``feats`` [1, n, d] (or the head's own outputs) beside ``ids``
    [1, n], and how many of its last rows to score (``keep``)."""

    state: EagleState
    feats: torch.Tensor
    ids: torch.Tensor
    keep: int

    def alone(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Its outputs [n, d] and kept logits, in a pass of its own."""
        run = self.state.run
        h = run.hidden(self.feats, self.ids, self.state.cache)[0]
        return h, run.scores(h[-self.keep :]) if self.keep else None


def _feeds_together(jobs: list[Job]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Several states' feeds of one head (``Job.payload``: each a ``_Feed``) as one packed pass of its
    layers and one product of its LM head over the rows they keep: the head's weights read once for
    them all. Each state's rows attend over its own cache (``agentspec.packed.PackedPass``)."""
    feeds: list[_Feed] = [job.payload for job in jobs]
    run, head = feeds[0].state.run, feeds[0].state.model
    held = [f.state.cache.get_seq_length() for f in feeds]
    lengths = [f.ids.shape[1] for f in feeds]
    pack = PackedPass([f.state for f in feeds], held, lengths, head.device, head.dtype)
    feats, ids = torch.cat([f.feats for f in feeds], dim=1), torch.cat([f.ids for f in feeds], dim=1)
    try:
        h = run.hidden(feats, ids, pack=pack)[0]
    except BaseException:
        for f, n in zip(feeds, held):
            f.state._roll_back(n)
        raise
    rows = [h[a:b] for a, b in pack.spans]
    logits = one_product([r[-f.keep :] if f.keep else None for r, f in zip(rows, feeds)], run.scores)
    return list(zip(rows, logits))
