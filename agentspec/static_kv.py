"""A model's preallocated (static) KV cache together with the token ids it covers.

``StaticState`` has ``ModelState``'s interface (``agentspec.kv``) over transformers' static
cache layers: every layer's keys and values live in buffers [1, H, capacity, D] allocated once,
and position p of the sequence is row p of each buffer. A pass writes its rows in place; rolling
back moves the length and nothing else (the rows past it are overwritten by the next pass), as in
gpt-fast. That fixed layout is what lets a pass be compiled once (``compiled=True``:
``torch.compile(mode="reduce-overhead")``, CUDA graphs on a GPU): its input ids, positions, mask
and cache have the same shapes on every call, so it attends over every row of the buffers
(masked past the length). The compiled pass is ``width`` tokens wide: 1 for a draft's step;
k + 1 for a target's verify pass, where a shorter feed is padded to the width and the padded rows
rolled back after it. That is lossless: under the causal mask no real row reads a padded one, so
the real rows' logits are those of the unpadded pass (up to the rounding of another GEMM shape,
as between a verify pass and one-token steps). An eager pass attends over the rows it needs only
(``RowsLayer``): otherwise every step would read the whole capacity, which on a CPU costs more
than the draft's weights.

Invariant (asserted by ``check``): ``length == len(ids) <= capacity``; the first ``length`` rows
of every layer hold the keys and values of ``ids``. The length is kept here as a Python int,
mirrored in place into each layer's ``cumulative_length`` (the device tensor from which
transformers' layers take their write positions) and handed to the layers for eager passes'
masks (``RowsLayer.length``); it is never read back from the device, which would wait for the
device on every pass.
"""

from __future__ import annotations

import functools

import torch
from transformers import Cache, StaticCache
from transformers.cache_utils import StaticLayer

from agentspec.forward import PlainForward, side_by_side
from agentspec.kv import KVState, PassIds, Segments, cache_segments, common_prefix_len
from agentspec.steps import Job, Steps

MAX_CAPACITY = 8192  # default capacity: the model's context, at most this many tokens


class CapacityError(ValueError):
    """A feed past the preallocated capacity of a ``StaticState``."""


class RowsLayer(StaticLayer):
    """transformers' ``StaticLayer``, told by ``StaticState`` what each pass reads.

    An eager pass reads the first ``rows`` rows of the buffers only, and its offset is the host's
    ``length`` (transformers' mask builder compares the offset with 0: on the device tensor that
    is a sync per pass). A compiled pass (``length`` None) reads every row and the device tensor,
    so its shapes and code are the same on every call.
    """

    def __init__(self, max_cache_len: int):
        super().__init__(max_cache_len=max_cache_len)
        self.rows = max_cache_len  # rows a pass reads
        self.length: int | None = 0  # positions held, on the host; None during a compiled pass

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        return keys[:, :, : self.rows], values[:, :, : self.rows]

    def get_seq_length(self):
        return self.cumulative_length if self.length is None else self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.rows, 0  # mask columns: the rows read, from position 0


def static_cache(config, capacity: int) -> Cache:
    """A cache of ``RowsLayer``s, one per layer; every layer must be a full-attention one."""
    layers = StaticCache(config=config, max_cache_len=capacity).layers  # allocated lazily: nothing yet
    kinds = {type(layer) for layer in layers}  # StaticLayer itself: its subclasses keep a window
    if kinds != {StaticLayer}:
        names = sorted(kind.__name__ for kind in kinds)
        raise ValueError(f"a static KV state needs full-attention layers only; this model has {names}")
    return Cache(layers=[RowsLayer(capacity) for _ in layers])


class StaticState:
    """One model's static KV cache and the ids whose keys and values it holds (``ModelState``'s interface)."""

    def __init__(self, model, capacity: int | None = None, compiled: bool = False, width: int = 1):
        self.model = model
        # an eager pass: transformers' own forward over the static layers (the lean one feeds growing ones)
        self.model_forward = PlainForward(model)
        context = model.config.get_text_config(decoder=True).max_position_embeddings
        self.capacity = capacity if capacity is not None else min(context, MAX_CAPACITY)
        if self.capacity < 1:
            raise ValueError(f"capacity must be positive, got {self.capacity}")
        self.cache = static_cache(model.config, self.capacity)
        if not 1 <= width <= self.capacity:
            raise ValueError(f"width must be in 1..capacity ({self.capacity}), got {width}")
        self.compiled = compiled  # compile passes of up to ``width`` tokens (CUDA graphs on a GPU)
        self.width = width  # the compiled pass's tokens: shorter feeds are padded to it
        self._step = None  # the compiled forward, built on its first use
        self.length = 0  # positions held: the cache's length, kept on the host
        self.ids: list[int] = []
        self.unread = 0  # held positions after ``ids`` fed from the device (``ModelState.unread``)

    def check(self) -> None:
        n = self.length
        assert n == len(self.ids) + self.unread <= self.capacity, (
            f"KV cache out of step: {n=} {len(self.ids)=} {self.unread=} {self.capacity=}"
        )

    @torch.inference_mode()  # the buffers are inference tensors once a pass has made them
    def _set_length(self, length: int) -> None:
        """Move the cache's length to ``length``; the buffers stay where they are (no copies)."""
        for layer in self.cache.layers:
            if layer.is_initialized:
                layer.cumulative_length.fill_(length)  # in place: a compiled step keeps its address
        self.length = length
        self._place(self.capacity, length)

    def _place(self, rows: int, length: int | None) -> None:
        """Tell every layer the rows the next pass reads and the length it starts from (``RowsLayer``)."""
        for layer in self.cache.layers:
            layer.rows, layer.length = rows, length

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens of ``ids`` (roll back the rest, unread ones too)."""
        length = min(length, len(self.ids))
        if length < self.length:
            self._set_length(length)
            del self.ids[length:]
            self.unread = 0
        self.check()

    def settle(self, ids: list[int]) -> None:
        """The first unread positions hold ``ids`` (``ModelState.settle``); the rest are rolled back."""
        assert len(ids) <= self.unread, f"{len(ids)=} {self.unread=}"
        self._set_length(self.length - (self.unread - len(ids)))
        self.ids.extend(ids)
        self.unread = 0
        self.check()

    def sync(self, seq: list[int], start: int = 0, end: int | None = None) -> list[int]:
        """Roll back to the longest common prefix with ``seq[:end]``; return the ids still to feed
        (``start``: leading ids known to agree, as for ``ModelState.sync``)."""
        end = len(seq) if end is None else end
        self.truncate(min(common_prefix_len(self.ids, seq, start), end))
        return seq[len(self.ids) : end]

    @torch.inference_mode()
    def load(self, segments: Segments, ids: list[int]) -> None:
        """Hold ``ids``, whose keys and values per layer are ``segments`` ([1, H, len(ids), D] each).

        The segments are copied into the preallocated buffers (a prefix-cache restore): the state
        owns its memory, so the segments may be freed or reused afterwards.
        """
        n = len(ids)
        self._fits(n, 0)
        layers = self.cache.layers
        assert len(segments) == len(layers), f"{len(segments)=} {len(layers)=}"
        for layer, (k, v) in zip(layers, segments, strict=True):
            assert k.shape[2] == v.shape[2] == n, f"segment of {k.shape[2]} rows for {n} ids"
            if not layer.is_initialized:
                layer.lazy_initialization(k, v)
            layer.keys[:, :, :n].copy_(k)
            layer.values[:, :, :n].copy_(v)
        self._set_length(n)
        self.ids = list(ids)
        self.unread = 0
        self.check()

    # every layer is a RowsLayer over its buffers (``static_cache`` admits no other): each keeps every
    # position, so a prefix of the state can be saved and restored (``agentspec.kv.KVState``)
    reusable = True

    def segments(self, length: int) -> Segments:
        return cache_segments(self.cache, length)

    def take(self, state: KVState) -> StaticState:
        """This state, now holding what ``state`` (a restored ``ModelState``) holds: copied into the
        buffers, so the buffers and a compiled step over them stay the ones in use."""
        if not state.ids:
            self.reset()
        else:
            self.load(state.segments(len(state.ids)), state.ids)
        return self

    def _fits(self, n: int, start: int) -> None:
        if start + n > self.capacity:
            raise CapacityError(
                f"{n} tokens after {start} exceed the static KV cache's capacity of {self.capacity}; "
                "build the StaticState with a larger capacity"
            )

    def forward_steps(self, new_ids: list[int] | PassIds, keep: int) -> Steps[torch.Tensor]:
        """``forward`` as a drafter's step (``agentspec.steps``), run by itself: the pair's one
        static draft state drafts for one call at a time (``Scheduler.batch_drafts``)."""
        return (yield Job(id(self), functools.partial(self.forward, new_ids, keep)))

    @torch.inference_mode()
    def forward(self, new_ids: list[int] | PassIds, keep: int, features: tuple[int, ...] = ()):
        """Feed ``new_ids`` after the cached ones; return the last ``keep`` logits rows [keep, V].

        With ``features``, return (logits, those features of ``new_ids`` side by side [len(new_ids), n x H]).
        A compiled state runs feeds of up to ``width`` tokens without ``features`` through the compiled
        pass (padded to ``width``; the padded rows are rolled back).
        """
        new = new_ids if isinstance(new_ids, PassIds) else PassIds(new_ids)
        assert len(new), "forward needs at least one new token"
        assert not (self.unread and new.host), "host ids cannot follow unread positions: settle first"
        n, start = len(new), self.length
        # near the capacity, a feed that fits only unpadded runs eager
        fixed = self.compiled and n <= self.width and not features and start + self.width <= self.capacity
        width = self.width if fixed else n
        self._fits(width, start)
        device = self.model.device
        x = new.tensor(device)
        if width > n:  # any id pads: no real row reads a padded one
            x = torch.cat([x, x[:, -1:].expand(1, width - n)], dim=1)
        positions = torch.arange(start, start + width, device=device)[None]  # [1, width]
        if fixed:
            self._place(self.capacity, None)
        else:
            self._place(start + n, start)
        try:
            if fixed:
                logits, captured = self._compiled_pass(x, positions, n), None
            else:
                logits, captured = self._eager(x, positions, keep, features)
        except BaseException:
            self._set_length(start)  # the rows a failed pass wrote lie past the length: rolled back
            raise
        if width > n:
            self._set_length(start + n)  # the padded rows: rolled back like a rejected draft
        else:
            self.length = start + n  # each layer's cumulative_length advanced on the device already
        self._place(self.capacity, self.length)
        self.ids.extend(new.host)
        self.unread += n - len(new.host)
        self.check()
        if captured is not None:
            return logits[-keep:], captured[-n:]
        return logits[-keep:]

    def _eager(self, x: torch.Tensor, positions: torch.Tensor, keep: int, features: tuple[int, ...]):
        """Logits [keep, V] and the ``features`` side by side [n, n x H] (None without)."""
        out = self.model_forward(x, keep, cache=self.cache, positions=positions, features=features)
        return out.logits, side_by_side(out.features) if features else None

    def _compiled_pass(self, x: torch.Tensor, positions: torch.Tensor, n: int) -> torch.Tensor:
        """The ``width``-token forward, compiled on first use for these fixed shapes; logits [n, V]."""
        if self._step is None:
            self._step = torch.compile(self.model.forward, mode="reduce-overhead", dynamic=False)
        out = self._step(input_ids=x, position_ids=positions, cache=self.cache, use_cache=True)
        # the real rows, copied: a CUDA graph's outputs are overwritten by its next replay
        return out.logits[0, :n].clone()

    def reset(self) -> None:
        """Hold nothing; the buffers (and a compiled step's graph over them) are kept for reuse."""
        self._set_length(0)
        self.ids = []
        self.unread = 0
