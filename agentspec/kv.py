"""A model's KV cache together with the token ids it covers.

Invariant (asserted): ``cache.get_seq_length() == len(ids)``. Roll-back is one call to
``truncate``; ``sync`` crops to the longest common prefix with a new sequence, so a state that is
reused across steps (or calls) only ever re-reads the tokens that changed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from functools import partial

import torch
from transformers import DynamicCache

# A CPU pass over 2..FEW_ROWS new tokens computes its large float32 linears weight-first
# (``WeightFirst``): those whose weight holds at least MIN_WEIGHT_BYTES (more than CPU caches hold).
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


# Set by ModelState.forward around a pass of 2..FEW_ROWS new tokens, in its own thread (and task) only
_FEW_ROWS_PASS: ContextVar[bool] = ContextVar("agentspec_few_rows_pass", default=False)


def _pass_forward(linear: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward``, except inside an agentspec pass of a few rows on a CPU float32 weight."""
    w = linear.weight
    if _FEW_ROWS_PASS.get() and w.device.type == "cpu" and w.dtype in WEIGHT_FIRST_DTYPES:
        return _weight_first(linear, x)
    return torch.nn.functional.linear(x, w, linear.bias)


class WeightFirst:
    """The large float32 CPU linears of a pair's models, which compute few-row passes weight-first.

    ``F.linear`` computes ``x @ W.T``. On a CPU, in float32, for a few rows against a weight larger
    than the caches (an LM head; every projection of a 7B model), that kernel runs 2-4x slower than
    for one row, while ``W @ x.T`` costs little more than one row (``benchmarks/bench_verify_cost.py``;
    in bfloat16 it does not pay, so those are left alone). A verify pass has 2-17 rows, so this is
    much of its extra cost. Same product, another summation order; one-row passes (plain decoding)
    and prefills keep ``F.linear``.

    Decided once, when the pair is built: each ``nn.Linear`` whose weight holds at least
    MIN_WEIGHT_BYTES gets an instance ``forward`` that is ``F.linear`` (exactly ``nn.Linear``'s own)
    unless its thread is inside ``ModelState.forward`` over 2..FEW_ROWS new tokens. So any other
    caller (transformers' ``generate()``, another thread, a user's own code) gets the numbers it
    got before, even while a verify pass runs on the same model; what is left in a model passed in
    is that instance attribute. PyTorch has no switch for the product order, and a
    ``TorchFunctionMode`` doing this costs more in Python dispatch than it saves. A module with an
    instance ``forward`` already (accelerate's hooks, or this one from an earlier pair of the same
    model) keeps it; a linear put into a model later keeps ``F.linear`` (only speed is lost).
    """

    def __init__(self, *models: torch.nn.Module):
        self.linears: list[torch.nn.Linear] = []  # those given the forward here
        for model in models:
            for m in model.modules():
                if type(m) is torch.nn.Linear and "forward" not in vars(m) and _large(m):
                    m.forward = partial(_pass_forward, m)
                    self.linears.append(m)


def _large(linear: torch.nn.Linear) -> bool:
    w = linear.weight
    big = w.numel() * w.element_size() >= MIN_WEIGHT_BYTES
    return big and w.device.type == "cpu" and w.dtype in WEIGHT_FIRST_DTYPES


@contextmanager
def few_rows_pass(rows: int) -> Iterator[None]:
    """Within the block, this thread's passes over ``rows`` new tokens run ``WeightFirst`` linears
    weight-first (when 2 <= rows <= FEW_ROWS)."""
    token = _FEW_ROWS_PASS.set(2 <= rows <= FEW_ROWS)
    try:
        yield
    finally:
        _FEW_ROWS_PASS.reset(token)


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
                stack.enter_context(few_rows_pass(len(new_ids)))
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
