"""The forward a pass calls: new rows, their group, the features wanted -> logits and features.

Every agentspec pass over a model goes through one object the pair owns (``Forward``), called at one
place (``kv.ModelState.forward``, ``packed.forward_packed``): ``agentspec.lean.LeanForward`` for
the families it covers (its linears bound once, packed where the CPU gains), ``PlainForward`` for the
rest (transformers' own forward, with ``F.linear``). Nothing is assigned on the model: ``generate()``,
a user's own calls, ``copy.deepcopy`` and ``save_pretrained`` see it as transformers built it.

Features are numbered as transformers numbers ``output_hidden_states``: ``i`` in ``0..L-1`` (L decoder
layers) is the residual stream entering decoder layer ``i`` (0: the embeddings), where vLLM's EAGLE-3
reads its auxiliary layers; ``L`` is the final norm's output, what an EAGLE-1 head drafts from; a
negative one counts from the end (``NORMED``, -1: the final norm's output).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

NORMED = -1


@dataclass
class PassOut:
    """What one forward returns."""

    logits: torch.Tensor  # [R, V]: the kept rows
    features: tuple[torch.Tensor, ...] = ()  # [T, H] per feature asked for, every fed row


class Forward(Protocol):
    """A model's forward as agentspec's passes call it (see the module doc)."""

    model: Any  # the transformers model whose weights it reads
    packs: bool  # whether it runs a packed pass of several sequences (``pack=``)

    def __call__(
        self,
        ids: torch.Tensor,
        keep: int | torch.Tensor,
        *,
        cache: Any = None,
        pack: Any = None,
        positions: torch.Tensor | None = None,
        features: Sequence[int] = (),
    ) -> PassOut:
        """Feed ``ids`` [1, T] after ``cache`` (a solo pass; its rows at ``positions`` [1, T], by default
        following the cache) or as the rows of ``pack`` (an ``agentspec.packed.PackedPass``: each
        sequence after its own cache, at its own positions); the logits of the last ``keep`` rows (an
        int) or of the rows ``keep`` lists, and the ``features`` asked for."""
        ...


class PlainForward:
    """transformers' own forward (``model(...)``), its linears ``F.linear``: what a model of a family
    ``agentspec.lean`` does not cover runs, and a model given to a ``ModelState`` alone.

    A packed pass hands transformers the pack as the cache and as ``agentspec_pack``, which reaches
    the attention function (``attention.grouped_sdpa_forward``): a model runs packed passes only with
    ``agentspec_sdpa`` attention (``packs``, given by whoever switched it: ``models.load_pair``).
    Features come from ``output_hidden_states``, restricted to the layers asked for.
    """

    def __init__(self, model: Any, packs: bool = False):
        self.model = model
        self.packs = packs  # the pair says so for a model it switched to ``agentspec_sdpa``

    def __call__(self, ids, keep, *, cache=None, pack=None, positions=None, features: Sequence[int] = ()):
        wanted = sorted({feature_index(self.model, f) for f in features})
        kwargs: dict[str, Any] = {"input_ids": ids, "use_cache": True, "logits_to_keep": keep}
        if wanted:
            kwargs["output_hidden_states"] = wanted
        if pack is not None:
            # a 4-D mask is taken as it is by transformers' mask builders, which then build none; the
            # packed pass masks each sequence itself (``PackedPass.attend``): never read
            mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=ids.device)
            kwargs.update(cache=pack, position_ids=pack.positions, attention_mask=mask, agentspec_pack=pack)
        else:
            kwargs.update(cache=cache, position_ids=positions)
        out = self.model(**kwargs)
        found = tuple(out.hidden_states[feature_index(self.model, f)][0] for f in features)
        return PassOut(out.logits[0], found)


def side_by_side(features: tuple[torch.Tensor, ...], rows: slice | None = None) -> torch.Tensor:
    """The features a pass returned [T, H] each, side by side [T, n x H] (in the order asked for), cut
    to ``rows``: what a head drafting from several layers reads (one feature: no copy)."""
    parts = [f if rows is None else f[rows] for f in features]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def feature_index(model: Any, feature: int) -> int:
    """``feature`` as a non-negative index into ``0..L`` (see the module doc), checked."""
    layers = model.config.num_hidden_layers
    index = feature + layers + 1 if feature < 0 else feature
    if not 0 <= index <= layers:
        raise ValueError(f"feature layer {feature} out of range for a model of {layers} layers (0..{layers})")
    return index
