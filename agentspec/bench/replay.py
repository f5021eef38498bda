"""A drafter of known acceptance, for measuring the loop's speed apart from how good a draft is.

``ReplayDrafter`` proposes the reference tokens (a plain greedy run's) with each position
corrupted, independently with probability ``1 - acceptance`` (seeded), so every system measured
with it sees the same acceptance whatever its weights are. It pays what a model drafter pays on
the device: one forward of a real draft model per draft token, its KV state (``packed.DraftState``, whose
ids go to a GPU from pinned memory without blocking) kept in step with the verified sequence. It
reads none of those logits back, so it costs no host sync: the cost of a draft kept on the device.
"""

from __future__ import annotations

import random

from agentspec.config import GenerationConfig
from agentspec.drafters.base import Draft, Drafter
from agentspec.packed import DraftState
from agentspec.steps import Steps, run_alone


def corrupted_positions(n: int, acceptance: float, seed: int) -> list[bool]:
    """For positions 0..n-1: True where the draft proposes a wrong token (probability 1 - acceptance)."""
    rng = random.Random(seed)
    return [rng.random() >= acceptance for _ in range(n)]


def expected_tokens_per_pass(acceptance: float, k: int) -> float:
    """E(a, k) = (1 - a^(k+1)) / (1 - a): tokens one verify pass adds (the bonus token included)
    when each of k draft tokens is accepted independently with probability a, up to the first miss."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


class ReplayDrafter(Drafter):
    """Proposes ``reference[len(seq):]`` (``reference``: prompt ids then the greedy output), each
    position wrong where ``corrupted_positions`` says; ``draft`` (a pair's ``draft_forward``, or a
    model: transformers' forward) runs one step per token."""

    name = "replay"

    def __init__(self, draft, reference: list[int], acceptance: float, seed: int, k: int, width: int):
        self.state = DraftState(draft)
        self.reference = reference
        self.acceptance = acceptance
        self.wrong = corrupted_positions(len(reference), acceptance, seed)
        self.draft_cap = k
        self.width = width  # the draft's vocabulary: a wrong token is another id below it

    def _token(self, position: int) -> int | None:
        if position >= len(self.reference):
            return None
        token = self.reference[position]
        return (token + 1) % self.width if self.wrong[position] else token

    def propose(self, seq, k, config: GenerationConfig, generator, constraint=None) -> Draft:
        return run_alone(self.propose_steps(seq, k, config, generator))

    def propose_steps(self, seq, k, config: GenerationConfig, generator, constraint=None) -> Steps[Draft]:
        pending = self.state.sync(seq[:-1]) + seq[-1:]  # as the model drafter: the last id is fed
        tokens: list[int] = []
        for j in range(k):
            token = self._token(len(seq) + j)
            if token is None:
                break
            yield from self.state.forward_steps(
                pending, keep=1
            )  # the step whose logits would give this token
            tokens.append(token)
            pending = [token]
        return Draft(tokens)

    def reset(self) -> None:
        self.state.reset()
