"""The drafter interface: ``propose`` and ``feedback`` (after transformers' CandidateGenerator).

Everything the decoding loop reads of a drafter is declared on ``Drafter``, with a default that
means "not used": the loop never probes a drafter for what it can do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from agentspec.config import GenerationConfig
from agentspec.steps import Steps

if TYPE_CHECKING:
    from agentspec.grammar import Constraint
    from agentspec.kv import ModelState


@dataclass
class Draft:
    """Proposed tokens, and the distributions they were sampled from.

    ``tokens`` are host ids, or a [k] long tensor on the model's device (a draft model's tokens,
    which then reach the host only with the verification's one read: ``request._verdict``).
    ``q`` is [len(tokens), V] when the drafter sampled from a distribution (temperature > 0), and
    None for greedy or model-free drafts (verification then treats the draft as one-hot).
    ``source`` names where the tokens came from when a drafter has several sources (``drafter="auto"``:
    "suffix" or "model"); None means the drafter's own name. The stats count passes per source.
    """

    tokens: list[int] | torch.Tensor
    q: torch.Tensor | None = None
    source: str | None = None
    # each token's estimated chance of surviving verification given that those before it did: host
    # floats (a calibration's), or a [len(tokens)] tensor on the drafter's device (a DSpark head's
    # confidence head, read only where a scheduler needs it); None where the drafter has no estimate
    survival: list[float] | torch.Tensor | None = None
    # values the drafter reads back after verification without a read of its own: a [len(tokens)]
    # float tensor in [0, 1] on the device (a scheduled draft model's confidences), read with the
    # verification's result and handed to ``Drafter.observe_confidences`` before ``feedback``
    confidence: torch.Tensor | None = None


class Drafter:
    """A drafter proposes tokens for the target to verify; subclass it and define ``name`` and ``propose``.

    The rest has defaults that a drafter overrides only for what it does:

    - ``draft_cap``: the most draft tokens per pass when the call sets none (None: the loop's
      ``DEFAULT_DRAFT_CAP``).
    - ``masks_own_draft``: True when ``propose`` takes ``constraint=`` and draws its draft under
      the grammar's mask, pushing its tokens onto the constraint's path. Only then does the loop
      pass a constraint; otherwise it fits the draft to the grammar itself, and ``propose`` may
      leave ``constraint`` out of its signature.
    - ``feedback`` after each verify pass, ``reset`` at the start of a call and after a failure;
      ``trimmed(n)`` before the pass, when a scheduler verifies only the first ``n`` tokens of the
      last proposal (its survival estimates said the rest would not pay in a shared pass).
    - ``feature_layers``: the target's features the drafter reads (``agentspec.forward``'s numbering:
      an EAGLE head's layers; () for none); the verify pass then computes them too, and the loop
      hands the verified positions' rows to ``observe_features``; ``context_rows``: how many positions
      of a restored prefix it wants computed again for their features.
    - The KV-state handover with the prefix cache, for a drafter that keeps a model's KV cache in
      step with the verified sequence: ``kv_state()`` is that state (None: nothing to cache; its
      ``model`` keys the prefix cache's "draft" entries), ``adopt_kv_state(state)`` takes a
      state restored from the cache in its place, and ``catch_up(ids)`` feeds what the state lacks
      of ``ids`` before it is saved.
    - ``propose_steps``: ``propose`` as a generator of its model's forwards (``agentspec.steps``), for
      a drafter that runs a model: a scheduler then runs the forwards of calls drafting at once as
      one pass (``agentspec.packed.DraftRound``). By default ``propose`` runs whole, no step yielded.
    """

    name: str
    draft_cap: int | None = None
    masks_own_draft: bool = False
    feature_layers: tuple[int, ...] = ()
    # the last positions of a prefix restored from the prefix cache the target computes again, for
    # their features: a head's context in a call's first drafts (the cache keeps no features)
    context_rows: int = 0

    def propose(
        self,
        seq: list[int],
        k: int,
        config: GenerationConfig,
        generator: torch.Generator | None,
        constraint: Constraint | None = None,
    ) -> Draft:
        """Up to ``k`` tokens likely to follow ``seq`` (the verified prompt + output so far)."""
        raise NotImplementedError(f"{type(self).__name__} must define propose()")

    def propose_steps(
        self,
        seq: list[int],
        k: int,
        config: GenerationConfig,
        generator: torch.Generator | None,
        constraint: Constraint | None = None,
    ) -> Steps[Draft]:
        """``propose``, yielding each forward of a model it runs as a ``Job`` (see ``agentspec.steps``)."""
        yield from ()  # by default no step: ``propose`` runs whole
        if constraint is None:  # ``propose`` takes one only where it masks its own draft
            return self.propose(seq, k, config, generator)
        return self.propose(seq, k, config, generator, constraint=constraint)

    def feedback(self, seq: list[int], n_accepted: int, n_drafted: int) -> None:
        """Called after each verify pass with the new verified sequence."""

    def trimmed(self, n: int) -> None:
        """Only the first ``n`` tokens of the last proposal are verified (before the pass)."""

    def reset(self) -> None:
        """Drop any per-request state (called at the start of a call, and after a failure)."""

    def observe_confidences(self, confidences: list[float]) -> None:
        """The last draft's ``Draft.confidence`` on the host (of its verified tokens), read with the
        verification's result; called before ``feedback``."""

    def observe_features(self, position: int, features: torch.Tensor) -> None:
        """The target's ``feature_layers`` side by side [n, k x H] at the verified positions
        ``[position, position + n)``."""

    def kv_state(self) -> ModelState | None:
        """The KV state the prefix cache saves and restores for this drafter (None: it keeps none)."""
        return None

    def adopt_kv_state(self, state: ModelState) -> None:
        """Continue from ``state`` (restored from the prefix cache for ``kv_state().model``)."""

    def catch_up(self, ids: list[int]) -> None:
        """Bring ``kv_state()`` up to ``ids`` (the target's cached ids) before it is saved."""
