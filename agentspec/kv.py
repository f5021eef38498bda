"""A model's KV cache together with the token ids it covers.

Invariant (asserted): ``cache.get_seq_length() == len(ids)``. Roll-back is one call to
``truncate``; ``sync`` crops to the longest common prefix with a new sequence, so a state that is
reused across steps (or calls) only ever re-reads the tokens that changed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import DynamicCache


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
            if hidden:
                with final_hidden(self.model) as captured:
                    out = self.model(input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=keep)
            else:
                out = self.model(input_ids=x, cache=self.cache, use_cache=True, logits_to_keep=keep)
        except BaseException:
            self.reset()  # a failed pass may have updated some layers only: start clean
            raise
        self.ids.extend(new_ids)
        self.check()
        if hidden:
            return out.logits[0, -keep:], captured[-1][0, -len(new_ids) :]
        return out.logits[0, -keep:]

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.ids = []
