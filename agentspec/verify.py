"""Pure tensor functions: which draft tokens the target accepts, and the token it adds.

Names follow the papers: ``p`` is the target's distribution, ``q`` the draft's, ``k`` (gamma in
Leviathan et al.) the number of draft tokens. Both functions return ``(n, token)``: the first
``n`` draft tokens are accepted and ``token`` (the target's correction, or the bonus token when
all ``k`` were accepted) follows them, so every verify pass yields ``n + 1`` tokens.
"""

from __future__ import annotations

import torch


def greedy_verify(draft: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Temperature 0: keep draft tokens while they equal the target's argmax.

    draft [k] (long), target_logits [k+1, V]: row i scores the position of draft[i]; row k is the
    bonus position after the whole draft.
    """
    k = draft.shape[0]
    choice = target_logits.argmax(dim=-1)  # [k+1] the target's own greedy tokens
    agree = (draft == choice[:k]).long()  # [k]
    n = int(torch.cumprod(agree, dim=0).sum().item()) if k else 0  # length of agreeing prefix
    return n, int(choice[n].item())


def speculative_verify(
    draft: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

    draft [k]; p [k+1, V] the target's distributions (already warped by temperature/top-k/top-p);
    q [k, V] the distributions the draft tokens were sampled from, or None for a model-free draft,
    which is treated as one-hot: accept x with probability p(x), else resample from p without x.
    """
    k = draft.shape[0]
    if k:
        rows = torch.arange(k, device=p.device)
        p_x = p[rows, draft]  # [k] target probability of each draft token
        q_x = q[rows, draft] if q is not None else torch.ones_like(p_x)  # [k]
        r = torch.rand(k, generator=generator, device=p.device)  # [k] one uniform per position
        accepted = (r * q_x < p_x).long()  # r < min(1, p/q), written without dividing by q
        n = int(torch.cumprod(accepted, dim=0).sum().item())
    else:
        n = 0
    if n == k:  # every draft token accepted: the bonus token comes straight from p
        return n, int(torch.multinomial(p[k], 1, generator=generator).item())
    # rejected at position n: sample from norm(max(0, p - q))
    if q is not None:
        residual = torch.clamp(p[n] - q[n], min=0.0)
    else:
        residual = p[n].clone()
        residual[draft[n]] = 0.0
    total = residual.sum()
    if total <= 0:  # p == q up to rounding: rejection was a float artefact, p itself is right
        residual, total = p[n], p[n].sum()
    return n, int(torch.multinomial(residual / total, 1, generator=generator).item())
