"""Prompt lookup decoding (Saxena 2023): continue the latest earlier occurrence of the last n-gram.

Model-free: it costs microseconds per step and shines where the output copies its context (tool
results, code edits, JSON that repeats keys), which is most of an agent's traffic.
"""

from __future__ import annotations

import torch

from agentspec.config import GenerationConfig
from agentspec.drafters.base import Draft, Drafter


def lookup(seq: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens following the latest earlier match of seq's last n-gram (longest n first)."""
    if k <= 0 or len(seq) < 2:
        return []
    t = torch.tensor(seq, dtype=torch.long)
    for n in range(min(max_ngram, len(seq) - 1), min_ngram - 1, -1):
        windows = t[:-1].unfold(0, n, 1)  # [L-n, n]: every n-gram that has a token after it
        hits = (windows == t[-n:]).all(dim=1).nonzero().flatten()
        if hits.numel():
            start = int(hits[-1]) + n  # the latest match: its continuation starts here
            return seq[start : start + k]
    return []


class PromptLookupDrafter(Drafter):
    name = "prompt_lookup"
    draft_cap = 4

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram=} {max_ngram=}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, seq, k, config: GenerationConfig, generator) -> Draft:
        return Draft(lookup(seq, k, self.max_ngram, self.min_ngram))
