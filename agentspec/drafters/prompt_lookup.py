"""Prompt lookup decoding (Saxena 2023): continue the latest earlier occurrence of the last n-gram.

Model-free: it costs microseconds per step and shines where the output copies its context (tool
results, code edits, JSON that repeats keys), which is most of an agent's traffic.

The drafter keeps an n-gram index of the call's sequence (``NgramIndex``), grown by the tokens each
pass adds and rolled back where a proposal's unverified tail changed: a proposal costs O(new
tokens + n), not a scan of the context, and stays in Python (no host tensors).
"""

from __future__ import annotations

from agentspec.config import GenerationConfig
from agentspec.drafters.base import Draft, Drafter
from agentspec.drafters.schedule import POSITIONS, Calibration, Judged, positioned
from agentspec.kv import common_prefix_len


class NgramIndex:
    """One sequence and, per n-gram (``min_ngram <= n <= max_ngram``) with a token after it, the
    positions where it starts, in increasing order (so the latest match is the last)."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.seq: list[int] = []
        self.starts: dict[tuple[int, ...], list[int]] = {}

    def _grams(self, length: int):
        """The n-grams that gained their continuation when the sequence reached ``length``: those
        ending at position ``length - 2``, as (key, start)."""
        seq = self.seq
        for n in range(self.min_ngram, self.max_ngram + 1):
            start = length - 1 - n
            if start >= 0:
                yield tuple(seq[start : start + n]), start

    def sync(self, seq: list[int], start: int = 0) -> None:
        """Become ``seq``; its first ``start`` tokens are known to be the index's already."""
        n = common_prefix_len(self.seq, seq, start)
        for length in range(len(self.seq), n, -1):  # roll back, newest first
            for key, _ in self._grams(length):
                self.starts[key].pop()
        del self.seq[n:]
        for t in seq[n:]:
            self.seq.append(t)
            for key, s in self._grams(len(self.seq)):
                self.starts.setdefault(key, []).append(s)

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens following the latest earlier match of the last n-gram (longest n first)."""
        return self.match(k)[0]

    def match(self, k: int) -> tuple[list[int], int]:
        """``lookup``'s tokens, and the length of the n-gram they follow (0: none matched)."""
        seq = self.seq
        if k <= 0 or len(seq) < 2:
            return [], 0
        for n in range(min(self.max_ngram, len(seq) - 1), self.min_ngram - 1, -1):
            hits = self.starts.get(tuple(seq[-n:]))
            if hits:
                start = hits[-1] + n  # the latest match: its continuation starts here
                return seq[start : start + k], n
        return [], 0


def lookup(seq: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Up to k tokens following the latest earlier match of seq's last n-gram (longest n first)."""
    index = NgramIndex(max_ngram, min_ngram)
    index.sync(seq)
    return index.lookup(k)


# a prompt-lookup draft token's acceptance before evidence, by the length of the n-gram matched (1,
# 2, 3+): what its ``Calibration`` starts from, and replaces as greedy calls' passes verify
LOOKUP_PRIOR = (0.3, 0.45, 0.6)


def lookup_group(ngram: int, position: int) -> int:
    """The calibration group of a draft token at ``position`` after an ``ngram``-token match."""
    return positioned(min(ngram, len(LOOKUP_PRIOR)) - 1, position)


def lookup_prior(confidence: float, group: int) -> float:
    return LOOKUP_PRIOR[group // POSITIONS]


class PromptLookupDrafter(Drafter):
    """Prompt lookup; with a ``Calibration`` (the namespace's, ``DraftMemory.lookup_calibration``),
    each greedy draft carries its tokens' estimated acceptance, learned per matched n-gram length
    and draft position from the passes verified (``Draft.survival``: a scheduler sharing the pass
    verifies the tokens likely to survive)."""

    name = "prompt_lookup"
    draft_cap = 4

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, calibration: Calibration | None = None):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram=} {max_ngram=}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.calibration = calibration
        self.reset()

    def reset(self) -> None:
        self.index = NgramIndex(self.max_ngram, self.min_ngram)
        self.verified = 0  # leading tokens of the index known to be this call's verified sequence
        self._judged: Judged | None = None  # the last draft's calibration groups (None: not judged)

    def propose(self, seq, k, config: GenerationConfig, generator) -> Draft:
        self.index.sync(seq, min(self.verified, len(self.index.seq)))
        tokens, ngram = self.index.match(k)
        self._judged = None
        if self.calibration is None or not config.greedy or not tokens:
            return Draft(tokens)
        # no confidence to bin: every token sits in its group's one cell (bin of 1.0)
        groups = [lookup_group(ngram, j) for j in range(len(tokens))]
        self._judged = Judged(self.calibration, [1.0] * len(tokens), groups)
        return Draft(tokens, survival=self._judged.estimates())

    def trimmed(self, n: int) -> None:
        if self._judged is not None:
            self._judged.trim(n)

    def feedback(self, seq, n_accepted, n_drafted) -> None:
        if self._judged is not None:
            self._judged.observe(n_accepted, n_drafted)
        self._judged = None
        index = self.index
        self.verified = common_prefix_len(index.seq, seq, min(self.verified, len(index.seq)))
