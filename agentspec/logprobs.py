"""The target's log-probabilities of a call's output tokens (``GenerationConfig.logprobs``).

A call that asks for them keeps, in each verify pass, the logits rows of the tokens the grammar
forced as well as the draft's and the bonus row (``request.Share.keep``), so every output token's row
comes from the pass that verified it: no extra target pass. On the device, ``scores`` turns the rows
into each row's emitted token's log-probability and the ``top`` most likely tokens with theirs; the
host reads them in one more read per pass (``agentspec.packed.read_verdicts``), and ``entries`` pairs
them with the tokens the pass kept. A call that does not ask computes none of it.

The log-probabilities are the target's raw ones: the log-softmax of its logits before temperature,
top-k, top-p and grammar masks (vLLM's default, ``logprobs_mode="raw_logprobs"``), so a token that a
grammar or a sampler made likely can still show a low one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# JSON has no -inf: vLLM reports a token the model gives no chance as -9999.0, and so does agentspec
FLOOR = -9999.0


@dataclass(frozen=True)
class TokenLogprob:
    """One output token's log-probability under the target, and its most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, log-probability), most likely first


def emitted(forced: torch.Tensor, draft: torch.Tensor, verdict: torch.Tensor) -> torch.Tensor:
    """The token each row of a verify pass emits [F + k + 1], on the device: the forced tokens, the
    draft's, and at row F + n (n: the accepted count, ``verdict[0]``) the token drawn after them
    (``verdict[1]``); rows past it belong to rejected draft tokens (the host drops them)."""
    n, token = verdict[0], verdict[1]
    ids = torch.cat([forced, draft.to(forced.device), token.reshape(1).to(forced.device)])
    rows = torch.arange(ids.shape[0], device=ids.device)
    return torch.where(rows == forced.shape[0] + n.to(ids.device), token.to(ids.device), ids)


def scores(raw: torch.Tensor, tokens: torch.Tensor, top: int) -> torch.Tensor:
    """[rows, 1 + 2 * top] float32 on the device: each row's log-probability of its token, then the
    ``top`` largest log-probabilities and their token ids (exact as float32 below 2**24, far past
    any vocabulary). ``raw``: the rows' log-softmax [rows, V], float32."""
    chosen = raw.gather(1, tokens.to(raw.device)[:, None])
    if top == 0:
        return chosen.clamp_min(FLOOR)
    values, ids = raw.topk(top, dim=-1)
    return torch.cat([chosen.clamp_min(FLOOR), values.clamp_min(FLOOR), ids.float()], dim=1)


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """The raw log-probabilities [rows, V], in float32 whatever the model's dtype."""
    return torch.log_softmax(logits.float(), dim=-1)


def entries(tokens: list[int], rows: list[list[float]], top: int) -> list[TokenLogprob]:
    """``tokens`` (a pass's kept output, in order) with their rows as read: one row per token."""
    assert len(rows) >= len(tokens), f"{len(rows)=} {len(tokens)=}"
    out = []
    for token, row in zip(tokens, rows):
        alternatives = tuple(zip((int(i) for i in row[1 + top :]), row[1 : 1 + top]))
        out.append(TokenLogprob(token, row[0], alternatives))
    return out
