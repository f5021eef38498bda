"""A small draft model of the target's tokenizer, with its own KV cache kept in step.

Before each proposal the draft's cache is synced to the verified sequence (rolled back to the
longest common prefix, then fed what is missing), so after a full accept the last draft token and
the bonus token are fed together in one pass, and a restored prefix is reused as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentspec.config import GenerationConfig
from agentspec.drafters.base import Draft
from agentspec.grammar import Constraint, apply_mask
from agentspec.kv import ModelState
from agentspec.sampling import probabilities


def fit_vocab(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Pad (with -inf) or cut logits [..., V'] to the target's width V.

    Target and draft of one tokenizer can still have different embedding sizes (Qwen2.5-7B pads
    to 152,064 rows, 0.5B to 151,936); ids past the tokenizer never occur in either.
    """
    extra = width - logits.shape[-1]
    if extra > 0:
        return F.pad(logits, (0, extra), value=float("-inf"))
    return logits[..., :width]


class ModelDrafter:
    name = "model"

    def __init__(self, model, vocab_size: int):
        self.state = ModelState(model)
        self.vocab_size = vocab_size  # the target's logits width

    def propose(
        self, seq, k, config: GenerationConfig, generator, constraint: Constraint | None = None
    ) -> Draft:
        """Up to ``k`` tokens; with a ``constraint``, drawn under its mask and pushed onto its path."""
        if k <= 0:
            return Draft([])
        pending = self.state.sync(seq[:-1]) + seq[-1:]
        tokens: list[int] = []
        qs: list[torch.Tensor] = []
        for _ in range(k):
            logits = fit_vocab(self.state.forward(pending, keep=1)[-1], self.vocab_size)  # [V]
            if constraint is not None:
                allowed = constraint.allowed()
                if constraint.terminated or not bool(allowed.any()):
                    break
                logits = apply_mask(logits, allowed)
            if config.greedy:
                token = int(logits.argmax().item())
            else:
                q = probabilities(logits, config.temperature, config.top_k, config.top_p)
                token = int(torch.multinomial(q, 1, generator=generator).item())
                qs.append(q)
            if constraint is not None and not constraint.push(token):
                qs = qs[: len(tokens)]
                break
            tokens.append(token)
            pending = [token]
        return Draft(tokens, torch.stack(qs) if qs else None)

    def catch_up(self, ids: list[int], limit: int = 16) -> None:
        """Feed the few verified tokens the draft has not seen, so it covers ``ids`` like the target.

        Called when a call ends, before its state is saved to the prefix cache. A longer gap (the
        draft was reset after a failure) is left alone: the cache then keeps the draft's shorter part.
        """
        pending = self.state.sync(ids)
        if 0 < len(pending) <= limit:
            self.state.forward(pending, keep=1)

    def feedback(self, seq, n_accepted, n_drafted) -> None:
        pass  # the next propose() syncs the cache to the verified sequence

    def reset(self) -> None:
        self.state.reset()
