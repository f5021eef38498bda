"""The drafter interface: ``propose`` and ``feedback`` (after transformers' CandidateGenerator)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from agentspec.config import GenerationConfig


@dataclass
class Draft:
    """Proposed tokens, and the distributions they were sampled from.

    ``q`` is [len(tokens), V] when the drafter sampled from a distribution (temperature > 0), and
    None for greedy or model-free drafts (verification then treats the draft as one-hot).
    ``source`` names where the tokens came from when a drafter has several sources (``drafter="auto"``:
    "suffix" or "model"); None means the drafter's own name. The stats count passes per source.
    """

    tokens: list[int]
    q: torch.Tensor | None = None
    source: str | None = None


@runtime_checkable
class Drafter(Protocol):
    """A drafter may also set ``draft_cap``, its most draft tokens per pass when a call sets none."""

    name: str

    def propose(
        self, seq: list[int], k: int, config: GenerationConfig, generator: torch.Generator | None
    ) -> Draft:
        """Up to ``k`` tokens likely to follow ``seq`` (the verified prompt + output so far)."""
        ...

    def feedback(self, seq: list[int], n_accepted: int, n_drafted: int) -> None:
        """Called after each verify pass with the new verified sequence; may be a no-op."""
        ...

    def reset(self) -> None:
        """Drop any per-request state (called after a failure, and at the start of a call)."""
        ...
