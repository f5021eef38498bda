"""Pure tensor functions: logits -> the distribution a token is drawn from, and drawing it.

Every sampled token in agentspec, drafted or verified, comes from ``probabilities``; the draft's q
passed to verification is exactly the tensor its token was drawn from (transformers issues #32867
and #47932 were losslessness bugs where it was not).
"""

from __future__ import annotations

import torch


def probabilities(
    logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] (float32) after temperature, top-k and top-p.

    temperature must be > 0 (greedy decoding takes the argmax and never calls this).
    top-k keeps the k largest logits; top-p keeps the smallest set of most likely tokens whose mass
    reaches top_p (the most likely token is always kept). Removed tokens get probability 0.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 to build a distribution, got {temperature}")
    scores = logits.float()
    # subtract the max first: with a tiny temperature the division would overflow to inf - inf = NaN;
    # this way the argmax gets score 0 and the distribution tends to one-hot, as it should
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass of strictly better tokens
        drop_sorted = mass_before >= top_p  # the first token always has mass_before 0: kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def keyed_scores(probs: torch.Tensor, seed: int, first: int) -> torch.Tensor:
    """probs [rows, V] -> scores whose row-wise argmax is a draw from each row's distribution, drawn
    with noise keyed by (``seed``, position ``first + row``) alone.

    The exponential form of the Gumbel-max trick: with E_i ~ Exp(1) independent, argmax_i p_i / E_i
    is token i with probability p_i exactly. Keyed by position, a call's draw at an output position
    is a function of the seed, the position and the distribution there, and of nothing else: not of
    how many tokens were drafted before it, nor of what ran beside it (``GenerationConfig.reproducible``).
    """
    noise = torch.empty_like(probs, dtype=torch.float32)
    for row in range(probs.shape[0]):  # one short-lived generator per position (a pass has a few rows)
        key = (seed * 0x9E3779B97F4A7C15 + first + row) % 2**64
        gen = torch.Generator(device=probs.device).manual_seed(key)
        noise[row].exponential_(generator=gen)
    return probs / noise


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    """A generator on the logits' device; seeded when seed is given, else from fresh entropy."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
