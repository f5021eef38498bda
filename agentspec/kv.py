"""A model's KV cache together with the token ids it covers.

Invariant (asserted): ``cache.get_seq_length() == len(ids)``. Roll-back is one call to
``truncate``; ``sync`` crops to the longest common prefix with a new sequence, so a state that is
reused across steps (or calls) only ever re-reads the tokens that changed.
"""

from __future__ import annotations

import threading
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from functools import partial

import torch
from transformers import DynamicCache

# A CPU pass over 2..FEW_ROWS new tokens computes its large float32 linears weight-first
# (``few_rows_linears``): those whose weight holds at least MIN_WEIGHT_BYTES (more than CPU caches hold).
FEW_ROWS = 64
MIN_WEIGHT_BYTES = 16 << 20
WEIGHT_FIRST_DTYPES = {torch.float32}


def final_norm(model) -> torch.nn.Module:
    """The model's final norm: its output is the hidden state an EAGLE head reads."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, torch.nn.Module):
        raise ValueError(
            f"{type(model).__name__}: no final norm (model.norm) to read hidden states from; an EAGLE "
            "draft needs a decoder-only model with one"
        )
    return norm


@contextmanager
def final_hidden(model) -> Iterator[list[torch.Tensor]]:
    """Within the block, the model's passes append their final-norm output [B, T, H] to the list."""
    captured: list[torch.Tensor] = []
    hook = final_norm(model).register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        yield captured
    finally:
        hook.remove()


def _weight_first(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    if not 2 <= rows.shape[0] <= FEW_ROWS:
        return torch.nn.functional.linear(x, linear.weight, linear.bias)
    out = (linear.weight @ rows.T).T.contiguous()
    if linear.bias is not None:
        out += linear.bias
    return out.reshape(*x.shape[:-1], out.shape[-1])


_LINEAR_LOCK = threading.Lock()
_LINEAR_USERS: Counter[int] = Counter()
_LARGE_LINEARS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _large_linears(model) -> list[torch.nn.Linear]:
    """The model's ``nn.Linear`` modules whose weight holds at least MIN_WEIGHT_BYTES.

    Found once per model (and dtype and threshold), not on every pass: walking the ~400 modules of
    even a 135M model costs ~3 ms, a seventh of what the swap saves on a verify pass. A linear put
    into the model later is not seen (it keeps ``F.linear``: only speed is lost).
    """
    key = (MIN_WEIGHT_BYTES, getattr(model, "dtype", None))
    found = _LARGE_LINEARS.get(model)
    if found is None or found[0] != key:
        found = (
            key,
            [
                m
                for m in model.modules()
                if type(m) is torch.nn.Linear
                and m.weight.numel() * m.weight.element_size() >= MIN_WEIGHT_BYTES
            ],
        )
        _LARGE_LINEARS[model] = found
    return found[1]


@contextmanager
def few_rows_linears(model, rows: int) -> Iterator[None]:
    """Within the block, a CPU model's large float32 linears compute 2-64 rows as ``W @ x.T``.

    ``F.linear`` computes ``x @ W.T``. On a CPU, in float32, for a few rows against a weight larger
    than the caches (an LM head; every projection of a 7B model), that kernel runs 2-4x slower than
    for one row, while ``W @ x.T`` costs little more than one row (``benchmarks/bench_verify_cost.py``;
    in bfloat16 it does not pay, so those are left alone). A verify pass has 2-17 rows, so this is
    much of its extra cost. Same product, another summation order; one-row passes (plain decoding)
    and prefills keep ``F.linear``. PyTorch has no switch for it, and a ``TorchFunctionMode`` doing
    this costs ~20 ms a pass in Python dispatch, hence swapping the ``forward`` of those modules
    while any pass on the model is inside the block (counted, so threads can share a model). A
    module with an instance ``forward`` of someone else's (accelerate's hooks) is left alone.
    """
    if not 2 <= rows <= FEW_ROWS:
        yield
        return
    linears = [
        m
        for m in _large_linears(model)
        if m.weight.device.type == "cpu" and m.weight.dtype in WEIGHT_FIRST_DTYPES
    ]
    with _LINEAR_LOCK:
        ours = [m for m in linears if _LINEAR_USERS[id(m)] or "forward" not in vars(m)]
        for m in ours:
            if not _LINEAR_USERS[id(m)]:
                m.forward = partial(_weight_first, m)
            _LINEAR_USERS[id(m)] += 1
    try:
        yield
    finally:
        with _LINEAR_LOCK:
            for m in ours:
                _LINEAR_USERS[id(m)] -= 1
                if not _LINEAR_USERS[id(m)]:
                    del _LINEAR_USERS[id(m)], m.forward


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ModelState:
    """One model's DynamicCache and the ids whose keys and values it holds."""

    def __init__(self, model, cache: DynamicCache | None = None, ids: list[int] | None = None):
        self.model = model
        self.cache = cache if cache is not None else DynamicCache(config=model.config)
        self.ids: list[int] = list(ids or [])
        self.check()

    def check(self) -> None:
        n_cache = self.cache.get_seq_length()
        assert n_cache == len(self.ids), f"KV cache out of step: {n_cache=} {len(self.ids)=}"

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (roll back the rest)."""
        extra = len(self.ids) - length
        if extra > 0:
            self.cache.crop(-extra)  # transformers 5.x: a negative count removes that many
            del self.ids[length:]
        self.check()

    def sync(self, seq: list[int]) -> list[int]:
        """Roll back to the longest common prefix with ``seq``; return the ids still to feed."""
        self.truncate(common_prefix_len(self.ids, seq))
        return seq[len(self.ids) :]

    @torch.inference_mode()
    def forward(self, new_ids: list[int], keep: int, hidden: bool = False):
        """Feed ``new_ids`` after the cached ones; return the last ``keep`` logits rows [keep, V].

        With ``hidden``, return (logits, the final norm's output for ``new_ids`` [len(new_ids), H]):
        the features an EAGLE head drafts from (``agentspec.drafters.eagle``).
        """
        assert new_ids, "forward needs at least one new token"
        device = self.model.device
        x = torch.tensor([new_ids], dtype=torch.long, device=device)
        try:
            with ExitStack() as stack:
                stack.enter_context(few_rows_linears(self.model, len(new_ids)))
                captured = stack.enter_context(final_hidden(self.model)) if hidden else None
                out = self.model(input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=keep)
        except BaseException:
            self.reset()  # a failed pass may have updated some layers only: start clean
            raise
        self.ids.extend(new_ids)
        self.check()
        if captured is not None:
            return out.logits[0, -keep:], captured[-1][0, -len(new_ids) :]
        return out.logits[0, -keep:]

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.ids = []
