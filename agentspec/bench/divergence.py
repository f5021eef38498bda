"""Where two greedy outputs part, and how near a tie the target's choice was there.

Two correct computations of the same model (bfloat16 kernels that sum in another order, a verify
pass over k rows against ``generate()``'s one row) can pick different argmaxes only where the top two
logits nearly tie; a bug flips choices whatever the margin. ``logit_margin`` at the first divergent
position tells the two apart: the gpu-check suite reports it with each divergence, and
``tests/model/test_dtype_lossless.py`` bounds it in bfloat16.
"""

from __future__ import annotations

import torch


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where ``a`` and ``b`` differ (the shorter's length where one extends the
    other); None when they are equal."""
    return next(
        (i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b))
    )


@torch.inference_mode()
def top_two(model, ids: list[int]) -> tuple[int, int, float]:
    """``model``'s two likeliest tokens after ``ids`` and their logits' margin (top1 - top2): one plain
    forward pass of transformers over the whole sequence, the logits compared in float32."""
    logits = model(torch.tensor([ids], device=model.device), logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2)
    return int(top.indices[0]), int(top.indices[1]), float(top.values[0] - top.values[1])


def logit_margin(model, ids: list[int]) -> float:
    """``top_two``'s margin."""
    return top_two(model, ids)[2]
