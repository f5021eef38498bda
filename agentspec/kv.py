"""A model's KV cache together with the token ids it covers.

Invariant (asserted): ``cache.get_seq_length() == len(ids) + unread``. Roll-back is one call to
``truncate``; ``sync`` crops to the longest common prefix with a new sequence, so a state that is
reused across steps (or calls) only ever re-reads the tokens that changed.

A state runs its passes through the forward it was given (``agentspec.forward.Forward``: the pair's
lean forward, or transformers' own), called at one place, ``ModelState.forward``.

Host syncs: ids go to the device without the host waiting (``to_device``), and a pass may be fed
tokens that are still on the device (``PassIds``: a draft model's tokens, which the verification
reads back once, with its own result). Their positions are ``unread`` until ``settle`` names them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from agentspec.forward import Forward, PlainForward, side_by_side


def common_prefix_len(a: list[int], b: list[int], start: int = 0) -> int:
    """Length of the longest common prefix of ``a`` and ``b``, given that their first ``start``
    entries are known to agree (only the rest is compared: O(new tokens), not O(context))."""
    n = min(len(a), len(b))
    i = min(start, n)
    if a[i:n] == b[i:n]:  # the usual case, compared in C
        return n
    while i < n and a[i] == b[i]:
        i += 1
    return i


def longest_holder(states: Sequence[ModelState], ids: list[int], at: int) -> tuple[int | None, int]:
    """Which of ``states`` holds the rows of ``ids`` furthest past position ``at`` (< ``len(ids)``),
    by index, and to where (at most ``len(ids)``): where to copy them from (``ModelState.take_rows``)
    instead of computing them. (None, at) where none goes past ``at``."""
    best, end = None, at
    for i, other in enumerate(states):
        held = other.ids
        if len(held) <= end or held[at] != ids[at]:  # it shares nothing past ``at``: no need to compare
            continue
        n = min(common_prefix_len(held, ids), len(ids))
        if n > end:
            best, end = i, n
    return best, end


def to_device(ids: list[int], device: torch.device) -> torch.Tensor:
    """ids [n] as a long tensor on ``device``, copied without making the host wait.

    On CUDA the ids are staged in pinned host memory and copied with ``non_blocking=True`` (a copy
    from pageable memory blocks until it is done); PyTorch's pinned allocator keeps the staging
    buffer until the copy has run. Elsewhere a plain tensor.
    """
    if device.type != "cuda":
        return torch.tensor(ids, dtype=torch.long, device=device)
    staged = torch.tensor(ids, dtype=torch.long).pin_memory()
    return staged.to(device, non_blocking=True)


@dataclass(frozen=True)
class PassIds:
    """A pass's new tokens: ``host`` ids, then ``device`` ids [k] still on the model's device.

    A draft model's tokens stay on the device while it drafts and while the target verifies them;
    their values come back with the verification's one read. ``list + PassIds`` prepends host ids
    (a retried pass feeds the covered ids again before the same new tokens).
    """

    host: list[int]
    device: torch.Tensor | None = None  # [k] long

    def __len__(self) -> int:
        return len(self.host) + (0 if self.device is None else self.device.shape[0])

    def __radd__(self, ids: list[int]) -> PassIds:
        return PassIds(ids + self.host, self.device)

    def tensor(self, device: torch.device) -> torch.Tensor:
        """All the ids as one [1, n] long tensor on ``device``."""
        parts = [to_device(self.host, device)] if self.host else []
        if self.device is not None:
            parts.append(self.device.to(device=device, dtype=torch.long).reshape(-1))
        return (parts[0] if len(parts) == 1 else torch.cat(parts))[None]


Segments = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [1, H, n, D]


def cache_segments(cache: Any, length: int) -> Segments:
    """The first ``length`` positions' keys and values of each layer of a transformers cache (views)."""
    return [(layer.keys[:, :, :length], layer.values[:, :, :length]) for layer in cache.layers]


class GrowingLayer(DynamicLayer):
    """transformers' ``DynamicLayer`` with its keys and values in buffers it grows: a pass writes its
    rows in place, where ``DynamicLayer.update`` copies the whole layer with ``torch.cat`` (15% of a
    float32 one-row step after 400 tokens on a CPU), and a roll-back moves the length.

    ``keys``/``values`` stay views of the first ``length`` rows, so every reader of a
    ``DynamicLayer`` (transformers, ``cache_segments``, the prefix cache, which copies what it saves)
    reads them as before. Adopted tensors (``adopt``: a prefix-cache restore's, the tree's own) are
    never written: the first update copies them into a buffer of the layer's own. Buffers grow by
    half again what is needed, so a call's appends copy its cache a logarithmic number of times, and
    hold whole key blocks (``blocks``), their memory untouched until written or read.
    """

    def __init__(self) -> None:
        super().__init__()
        self._k: torch.Tensor | None = None  # [B, H, capacity, D], the layer's own
        self._v: torch.Tensor | None = None
        self._clean = 0  # the buffers' positions before this hold values: written, or zeroed (``blocks``)

    def adopt(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Hold ``keys``/``values`` (not copied; never written) as the cached positions."""
        self.lazy_initialization(keys, values)
        self.keys, self.values, self._k, self._v = keys, values, None, None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        held = self.get_seq_length()
        need = held + key_states.shape[-2]
        if self._k is None or need > self._k.shape[-2]:
            self._grow(need, key_states, value_states)
        self._k[:, :, held:need] = key_states
        self._v[:, :, held:need] = value_states
        self._clean = max(self._clean, need)
        self.keys, self.values = self._k[:, :, :need], self._v[:, :, :need]
        return self.keys, self.values

    def blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [B, H, n, D] through the end of the ``KEY_BLOCK`` that holds the last cached
        position (``attention.blocked_attention``). Past the cached length they hold what a pass wrote
        before a roll-back, or zeros: finite values, which a mask hides (never the buffer's unwritten
        memory: a NaN there would survive the mask, as 0 x NaN is NaN). Only after an update."""
        end = round_up(self.get_seq_length(), KEY_BLOCK)
        if end > self._clean:  # zeroed here, not when allocated: only the blocked path reads past the length
            self._k[:, :, self._clean : end].zero_()
            self._v[:, :, self._clean : end].zero_()
            self._clean = end
        return self._k[:, :, :end], self._v[:, :, :end]

    def _grow(self, need: int, k: torch.Tensor, v: torch.Tensor) -> None:
        capacity = round_up(need + need // 2, KEY_BLOCK)
        held = self.get_seq_length()
        new_k = k.new_empty(k.shape[0], k.shape[1], capacity, k.shape[3])
        new_v = v.new_empty(v.shape[0], v.shape[1], capacity, v.shape[3])
        if held:
            new_k[:, :, :held] = self.keys
            new_v[:, :, :held] = self.values
        self._k, self._v, self._clean = new_k, new_v, held
        self.keys, self.values = new_k[:, :, :held], new_v[:, :, :held]

    def reset(self) -> None:
        self._k = self._v = None
        self._clean = 0
        super().reset()


# A layer's buffer holds whole blocks of this many keys: the block SDPA's CPU kernel splits keys
# into, over which ``attention.blocked_attention`` attends (``GrowingLayer.blocks``)
KEY_BLOCK = 512


def round_up(n: int, block: int) -> int:
    """``n`` rounded up to a whole number of ``block``s."""
    return -(-n // block) * block


def crop_layers(cache: DynamicCache, held: int) -> None:
    """Crop each layer of ``cache`` back to its first ``held`` positions, after a pass that may have
    extended some layers only (one that failed part way) or whose rows are not to stay."""
    for layer in cache.layers:
        extra = layer.get_seq_length() - held  # the tensor's shape: no read of its values
        if extra > 0:
            layer.crop(-extra)  # transformers 5.x: a negative count removes that many


def growing_cache(config: Any) -> DynamicCache:
    """transformers' ``DynamicCache`` for ``config``, its plain layers ``GrowingLayer``s (a sliding
    window's or any other kind stay transformers' own)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class KVState(Protocol):
    """A model's KV state as the prefix cache reads it (``ModelState``, ``static_kv.StaticState``)."""

    model: Any
    ids: list[int]  # the ids whose keys and values it holds

    @property
    def reusable(self) -> bool:
        """Every layer keeps every position of ``ids`` as plain keys and values: a prefix of it can
        be saved and restored (a sliding window, a linear-attention state or a quantized form cannot)."""
        ...

    def segments(self, length: int) -> Segments:
        """The first ``length`` positions' keys and values, per layer (views, not copies)."""
        ...


class ModelState:
    """One model's DynamicCache and the ids whose keys and values it holds, fed through ``model_forward``.

    The last ``unread`` cached positions were fed from the device (``PassIds.device``): their ids
    are not in ``ids`` until ``settle`` gives them; ``truncate`` and ``sync`` roll them back.

    ``forward``: the pair's forward of the model (``ModelPair.target_forward``, ``draft_forward``);
    a bare model runs transformers' own (``PlainForward``).
    """

    def __init__(
        self,
        forward: Forward | torch.nn.Module,
        cache: DynamicCache | None = None,
        ids: list[int] | None = None,
    ):
        self.model_forward: Forward = (
            PlainForward(forward) if isinstance(forward, torch.nn.Module) else forward
        )
        self.model = self.model_forward.model
        self.cache = cache if cache is not None else growing_cache(self.model.config)
        self.ids: list[int] = list(ids or [])
        self.unread = 0  # cached positions after ``ids`` whose ids are still on the device
        self.check()

    def check(self) -> None:
        n_cache = self.cache.get_seq_length()
        assert n_cache == len(self.ids) + self.unread, (
            f"KV cache out of step: {n_cache=} {len(self.ids)=} {self.unread=}"
        )

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens of ``ids`` (roll back the rest, unread ones too)."""
        length = min(length, len(self.ids))
        extra = len(self.ids) + self.unread - length
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5.x: a negative count removes that many
            del self.ids[length:]
            self.unread = 0
        self.check()

    def settle(self, ids: list[int]) -> None:
        """The first unread positions hold ``ids`` (read back after the pass): they join ``ids``;
        the unread positions after them are rolled back."""
        assert len(ids) <= self.unread, f"{len(ids)=} {self.unread=}"
        extra = self.unread - len(ids)
        if extra:
            self.cache.crop(-extra)
        self.ids.extend(ids)
        self.unread = 0
        self.check()

    def sync(self, seq: list[int], start: int = 0, end: int | None = None) -> list[int]:
        """Roll back to the longest common prefix with ``seq[:end]``; return the ids still to feed.

        ``start``: how many leading ids the caller knows already agree with ``seq`` (a drafter's
        count of verified ones: the verified sequence only grows within a call), so a pass
        compares only the tokens after them.
        """
        end = len(seq) if end is None else end
        self.truncate(min(common_prefix_len(self.ids, seq, start), end))
        return seq[len(self.ids) : end]

    @torch.inference_mode()
    def forward(self, new_ids: list[int] | PassIds, keep: int, features: tuple[int, ...] = ()):
        """Feed ``new_ids`` after the cached ones; return the last ``keep`` logits rows [keep, V].

        ``PassIds`` with device ids: those positions are ``unread`` after the pass (no host read).
        With ``features`` (``agentspec.forward``'s numbering), return (logits, those features of
        ``new_ids`` side by side [len(new_ids), n x H]): what an EAGLE head drafts from
        (``agentspec.drafters.eagle``).
        """
        new = new_ids if isinstance(new_ids, PassIds) else PassIds(new_ids)
        assert len(new), "forward needs at least one new token"
        assert not (self.unread and new.host), "host ids cannot follow unread positions: settle first"
        x = new.tensor(self.model.device)
        held = len(self.ids) + self.unread
        try:
            out = self.model_forward(x, keep, cache=self.cache, features=features)
        except BaseException:
            self._roll_back(held)
            raise
        self.advance(new)
        logits = out.logits[-keep:]
        return (logits, side_by_side(out.features, slice(-len(new), None))) if features else logits

    def advance(self, new: PassIds) -> None:
        """A pass fed ``new`` after the cached positions (this state's own, or a packed one): its
        host ids join ``ids``, its device ids are ``unread``."""
        self.ids.extend(new.host)
        self.unread += len(new) - len(new.host)
        self.check()

    @property
    def reusable(self) -> bool:
        # transformers declares no "keeps every position" capability: DynamicLayer itself is the
        # layer that does (and ours, growing in place); its other subclasses keep a window, an
        # indexer or a quantized form
        layers = self.cache.layers
        return bool(layers) and all(type(layer) in (DynamicLayer, GrowingLayer) for layer in layers)

    def segments(self, length: int) -> Segments:
        return cache_segments(self.cache, length)

    @torch.inference_mode()
    def take_rows(self, other: ModelState, end: int) -> int:
        """Copy ``other``'s keys and values of positions ``len(self.ids)`` to ``end`` instead of
        computing them, where ``other.ids[:end]`` continues this state's ids (the caller compared
        them: the same tokens after the same prefix have the same rows). Returns how many were
        taken: none where either state keeps other than plain keys and values, or they are of two
        models. A copy that fails (out of memory) leaves this state as it was, and raises."""
        start = len(self.ids)
        if end <= start or self.unread or other.model is not self.model:
            return 0
        if not (self.reusable and other.reusable) or end > len(other.ids):
            return 0
        try:
            for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
                mine.update(theirs.keys[:, :, start:end], theirs.values[:, :, start:end])
        except BaseException:
            self._roll_back(start)
            raise
        self.ids.extend(other.ids[start:end])
        self.check()
        return end - start

    def take(self, state: ModelState) -> ModelState:
        """The state to continue from after a prefix-cache restore gave ``state``: that one itself
        (a preallocated ``StaticState`` copies it into its own buffers instead)."""
        return state

    def _roll_back(self, held: int) -> None:
        """Undo a failed pass, which may have extended some layers only: each layer is cropped back to
        the ``held`` positions it had, so a retry feeds only that pass's tokens again (on an
        out-of-memory error, ``agentspec.memory``). A cache that cannot be cropped starts clean."""
        try:
            crop_layers(self.cache, held)
            self.check()
        except Exception:
            self.reset()

    def reset(self) -> None:
        self.cache = growing_cache(self.model.config)
        self.ids = []
        self.unread = 0
