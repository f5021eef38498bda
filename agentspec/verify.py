"""Pure tensor functions: which draft tokens the target accepts, and the token it adds.

Names follow the papers: ``p`` is the target's distribution, ``q`` the draft's, ``k`` (gamma in
Leviathan et al.) the number of draft tokens. Both functions return ``(n, token)``: the first
``n`` draft tokens are accepted and ``token`` (the target's correction, or the bonus token when
all ``k`` were accepted) follows them, so every verify pass yields ``n + 1`` tokens.
"""

from __future__ import annotations

import torch


def greedy_accept(draft: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """Temperature 0: keep draft tokens while they equal the target's argmax. Returns [2] on the
    logits' device: (n, token), so the host reads both in one copy (``greedy_verify`` reads it).

    draft [k] (long), target_logits [k+1, V]: row i scores the position of draft[i]; row k is the
    bonus position after the whole draft.
    """
    k = draft.shape[0]
    choice = target_logits.argmax(dim=-1)  # [k+1] the target's own greedy tokens
    agree = (draft.to(choice.device) == choice[:k]).long()  # [k]
    n = torch.cumprod(agree, dim=0).sum()  # [] length of the agreeing prefix (0 for an empty draft)
    return torch.stack([n, _row(choice, n)])


def greedy_verify(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """``greedy_accept`` read to the host: (n, token)."""
    n, token = greedy_accept(draft, target_logits).tolist()
    return n, token


def speculative_accept(
    draft: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023). Returns [2] on p's device:
    (n, token), read by the host in one copy (``speculative_verify`` reads it).

    draft [k]; p [k+1, V] the target's distributions (already warped by temperature/top-k/top-p);
    q [k, V] the distributions the draft tokens were sampled from, or None for a model-free draft,
    which is treated as one-hot: accept x with probability p(x), else resample from p without x.

    The generator draws k uniforms, then one token: the same calls whatever n turns out to be, so
    the branch on n is taken on the device (``torch.where``) and the host never waits for n.
    """
    k = draft.shape[0]
    if not k:
        return torch.stack([torch.zeros((), dtype=torch.long, device=p.device), _draw(p[0], generator)])
    draft = draft.to(p.device)
    rows = torch.arange(k, device=p.device)
    p_x = p[rows, draft]  # [k] target probability of each draft token
    q_x = q[rows, draft] if q is not None else torch.ones_like(p_x)  # [k]
    r = torch.rand(k, generator=generator, device=p.device)  # [k] one uniform per position
    accepted = (r * q_x < p_x).long()  # r < min(1, p/q), written without dividing by q
    n = torch.cumprod(accepted, dim=0).sum()  # []
    at = n.clamp(max=k - 1)  # the rejected position when n < k (q and draft have k rows)
    p_n = _row(p, n)  # [V]
    # rejected at position n: sample from norm(max(0, p - q))
    if q is not None:
        residual = torch.clamp(p_n - _row(q, at), min=0.0)
    else:
        residual = p_n.scatter(0, draft.index_select(0, at[None]), 0.0)
    total = residual.sum()
    # p == q up to rounding (total 0): the rejection was a float artefact, p itself is right
    rejected = torch.where(total <= 0, p_n / p_n.sum(), residual / total)
    # every draft token accepted: the bonus token comes straight from p
    return torch.stack([n, _draw(torch.where(n == k, p[k], rejected), generator)])


def _row(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``t[i]`` for a 0-d index tensor, as a device gather (an index read on the host would wait)."""
    return t.index_select(0, i[None])[0]


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=generator)[0]


def speculative_verify(
    draft: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """``speculative_accept`` read to the host: (n, token)."""
    n, token = speculative_accept(draft, p, q, generator).tolist()
    return n, token
