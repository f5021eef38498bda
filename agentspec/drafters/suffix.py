"""Suffix decoding (Oliaro et al., arXiv 2411.04975): continue the context the way earlier text did.

Two trees per call: one over this request's prompt and output, one (``SuffixStore``, one per
pair) over the outputs of earlier requests, bounded in tokens, oldest output evicted first. Agent
traffic repeats itself (tool-call JSON, identifiers copied from tool results, the same plans across
runs), and these are free to query: microseconds per step, against milliseconds for a target pass.

The tree. A suffix tree cut at depth D over some token sequences has one node per substring of
length <= D, counting its occurrences. We keep the equivalent implicit form: the sequences, and
for each token id the positions where it occurs. Walking from the root along the context's last m
tokens is filtering the occurrences of the last token by the m - 1 tokens before it; a node's
children and their counts are the tokens that follow the surviving occurrences. Appending a token
costs O(1) (a tree adds up to D nodes), and a removed sequence's entries are dropped lazily.

Speculation, as Arctic Inference's ``SuffixTree::speculate`` (path mode): for each match length
m = 1, 2, ... up to D while the context's last m tokens occur with a continuation, follow the most
frequent continuation (ties: the most recent), multiplying the branch frequencies
count(child) / count(node) into each token's probability; stop after min(k, factor * m + offset)
tokens (the draft grows with the match) or when the probability falls below ``floor``. The
candidate with the highest score (the sum of its probabilities: the expected accepted tokens if
frequencies were probabilities) wins, the longer match on ties. One difference: a count here
covers only occurrences that have a continuation, so a node's branch frequencies sum to 1 (Arctic
also counts the occurrence at the very end of a sequence, the context itself among them).

Why not Arctic's own code: ``arctic-inference`` (0.3.0, Snowflake, Apache-2.0) publishes only a
source distribution, whose build imports torch >= 2.10 and needs cmake, a C++20 compiler,
nanobind 2.9.2, grpcio-tools and protobuf 5.29.6 in the build environment (pip's isolated build
fetches the CUDA torch wheel for that); the package is a vLLM plugin. Its C++ suffix tree alone
compiles by hand (cmake + nanobind), which is not an installable dependency for ``make test`` on a
fresh machine. This file is ~200 lines of Python.

A model-free draft is deterministic (q = None): lossless under greedy and speculative sampling.
Sampled calls do not read the global tree, so a seeded call never depends on earlier calls.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from agentspec.config import GenerationConfig
from agentspec.drafters.base import Draft, Drafter
from agentspec.drafters.schedule import POSITIONS, Calibration, Judged, positioned
from agentspec.kv import common_prefix_len

MAX_DEPTH = 32  # longest match considered (tree depth)
FACTOR, OFFSET = 1.0, 0.0  # draft at most FACTOR * match length + OFFSET tokens (vLLM's defaults)
FLOOR = 0.1  # candidates whose estimated probability falls below this are cut (vLLM's default)
STORE_TOKENS = 1 << 16  # output tokens the global tree keeps per pair
# occurrences of the context's last token a speculation starts from (the latest): bounds a pass's
# work whatever the context's length (a common token occurs thousands of times in a long context)
MAX_MATCHES = 512


MATCH_GROUPS = (3, 6, 12)  # match-length buckets for the suffix calibration: 1-2, 3-5, 6-11, 12+
SUFFIX_PRIOR = (0.6, 0.75, 0.85, 0.92)  # per match group: acceptance of a continuation seen every time


def match_group(match_len: int) -> int:
    return sum(match_len >= b for b in MATCH_GROUPS)


def suffix_groups(match_len: int, n: int) -> list[int]:
    """The calibration groups of a suffix draft's ``n`` tokens: its match group, by position."""
    return [positioned(match_group(match_len), j) for j in range(n)]


def suffix_prior(branch: float, group: int) -> float:
    """A suffix draft token's acceptance before evidence, from its branch frequency and match group
    (a ``Calibration``'s prior: verified passes replace it)."""
    return SUFFIX_PRIOR[group // POSITIONS] * branch


@dataclass
class Candidate:
    """A speculated continuation: its tokens, their estimated probabilities, the match behind it."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # probs[i]: branches[0] * ... * branches[i]
    branches: list[float] = field(default_factory=list)  # count(child) / count(node) at each step
    match_len: int = 0  # context tokens matched before the first draft token

    @property
    def score(self) -> float:
        return sum(self.probs)


class SuffixIndex:
    """Token sequences and, per token id, the (sequence id, position) pairs where it occurs.

    Invariant: ``where[t]`` lists every live occurrence of ``t`` in insertion order (entries of
    removed sequences linger until ``compact``). Not thread-safe: ``SuffixStore`` adds the lock.
    """

    def __init__(self) -> None:
        self.seqs: dict[int, list[int]] = {}  # insertion order = age
        self.where: dict[int, list[tuple[int, int]]] = {}
        self.live = self.dead = 0  # tokens in live sequences / entries of removed ones

    def extend(self, sid: int, tokens: Sequence[int]) -> None:
        seq = self.seqs.setdefault(sid, [])
        for i, t in enumerate(tokens, start=len(seq)):
            self.where.setdefault(t, []).append((sid, i))
        seq.extend(tokens)
        self.live += len(tokens)

    def truncate(self, sid: int, length: int) -> None:
        """Drop the tokens of ``sid`` from ``length`` on (its entries are the latest of their tokens)."""
        seq = self.seqs[sid]
        for pos in range(len(seq) - 1, length - 1, -1):
            entries = self.where[seq[pos]]
            if entries[-1] == (sid, pos):
                entries.pop()
            else:
                entries.remove((sid, pos))
        self.live -= max(0, len(seq) - length)
        del seq[length:]

    def remove(self, sid: int) -> None:
        n = len(self.seqs.pop(sid))
        self.live -= n
        self.dead += n
        if self.dead > self.live:
            self.compact()

    def compact(self) -> None:
        seqs, self.seqs, self.where, self.live, self.dead = self.seqs, {}, {}, 0, 0
        for sid, seq in seqs.items():
            self.extend(sid, seq)

    def speculate(
        self,
        context: Sequence[int],
        k: int,
        max_depth: int = MAX_DEPTH,
        factor: float = FACTOR,
        offset: float = OFFSET,
        floor: float = FLOOR,
        max_matches: int = MAX_MATCHES,
    ) -> Candidate:
        """The best-scoring continuation of ``context`` over every match length (module docstring),
        from the latest ``max_matches`` occurrences of its last token."""
        best = Candidate()
        if k <= 0 or not context:
            return best
        seqs = self.seqs
        # the latest MAX_MATCHES occurrences of the last token: a bounded scan, whatever the context
        latest = self.where.get(context[-1], [])[-max_matches:]
        ends = [(s, p + 1) for s, p in latest if s in seqs]  # matched [p+1-m, p+1)
        m = 1
        while ends:
            if not any(e < len(seqs[s]) for s, e in ends):
                break  # nothing continues: longer matches are subsets of these
            limit = min(k, int(m * factor + offset + 1e-6))
            tokens, probs, branches = self._walk(ends, limit, floor)
            if tokens and sum(probs) >= best.score:
                best = Candidate(tokens, probs, branches, m)
            if m >= min(max_depth, len(context)):
                break
            want = context[-m - 1]
            ends = [(s, e) for s, e in ends if e > m and seqs[s][e - m - 1] == want]
            m += 1
        return best

    def _walk(self, ends: list[tuple[int, int]], limit: int, floor: float):
        """Follow the most frequent continuation from the occurrences ``ends`` (one tree path)."""
        seqs = self.seqs
        tokens: list[int] = []
        probs: list[float] = []
        branches: list[float] = []
        prob = 1.0
        while len(tokens) < limit:
            counts: dict[int, int] = {}
            latest: dict[int, int] = {}
            for i, (s, e) in enumerate(ends):
                seq = seqs[s]
                if e < len(seq):
                    t = seq[e]
                    counts[t] = counts.get(t, 0) + 1
                    latest[t] = i
            if not counts:
                break
            token = max(counts, key=lambda t: (counts[t], latest[t]))
            branch = counts[token] / sum(counts.values())
            prob *= branch
            if prob < floor:
                break
            tokens.append(token)
            probs.append(prob)
            branches.append(branch)
            ends = [(s, e + 1) for s, e in ends if e < len(seqs[s]) and seqs[s][e] == token]
        return tokens, probs, branches


class SuffixStore:
    """Earlier outputs of one pair, for later requests: a SuffixIndex bounded to ``max_tokens``.

    Each request's output is one sequence, appended to as it is verified (so a stream closed early
    still leaves what it verified); when the total passes the bound the oldest outputs go first,
    never the one being written.
    """

    def __init__(self, max_tokens: int = STORE_TOKENS):
        self.index = SuffixIndex()
        self.max_tokens = max_tokens
        self.lock = threading.Lock()
        self._next = 0

    def open(self) -> int:
        with self.lock:
            self._next += 1
            return self._next

    def append(self, sid: int, tokens: Sequence[int]) -> None:
        with self.lock:
            self.index.extend(sid, tokens)
            while self.index.live > self.max_tokens and len(self.index.seqs) > 1:
                oldest = next(iter(self.index.seqs))
                self.index.remove(oldest if oldest != sid else list(self.index.seqs)[1])

    def speculate(self, context: Sequence[int], k: int, **options) -> Candidate:
        with self.lock:
            return self.index.speculate(context, k, **options)

    @property
    def tokens(self) -> int:
        return self.index.live


class SuffixDrafter(Drafter):
    """Drafts from a tree over this request (prompt + output) and the pair's tree of earlier outputs."""

    name = "suffix"
    draft_cap = 16  # drafts grow with the match (FACTOR * match length) up to this

    def __init__(
        self,
        store: SuffixStore | None = None,
        max_depth: int = MAX_DEPTH,
        factor: float = FACTOR,
        offset: float = OFFSET,
        floor: float = FLOOR,
        calibration: Calibration | None = None,
    ):
        self.store = store if store is not None else SuffixStore()
        self.options = {"max_depth": max_depth, "factor": factor, "offset": offset, "floor": floor}
        # acceptance per (match group, branch frequency), learned from greedy calls' passes: each
        # draft carries its estimates (``Draft.survival``) for a scheduler sharing the pass; None: none
        self.calibration = calibration
        self.reset()

    def reset(self) -> None:
        self.local = SuffixIndex()  # sequence 0: the request's verified tokens (and any proposal base)
        self._prompt_len: int | None = None
        self._sid: int | None = None  # this request's output in the store
        self._saved = 0  # output tokens already in the store
        self._verified = 0  # leading tokens of the request's sequence known to be verified
        self._judged: Judged | None = None  # the last draft's branch frequencies and groups

    def _sync(self, seq: list[int]) -> None:
        """Make the request's sequence ``seq``, comparing only past the tokens known verified."""
        mine = self.local.seqs.get(0, [])
        n = common_prefix_len(mine, seq, min(self._verified, len(mine)))
        if n < len(mine):
            self.local.truncate(0, n)
        self.local.extend(0, seq[n:])

    def candidate(self, seq: list[int], k: int, use_store: bool = True) -> Candidate:
        """The better of the request's and the store's candidates (the request's on ties)."""
        if self._prompt_len is None:
            self._prompt_len = len(seq)
        self._sync(seq)
        best = self.local.speculate(seq, k, **self.options)
        if use_store:
            other = self.store.speculate(seq[-self.options["max_depth"] :], k, **self.options)
            if other.score > best.score:
                best = other
        return best

    def propose(self, seq, k, config: GenerationConfig, generator) -> Draft:
        cand = self.candidate(seq, k, use_store=config.greedy)
        self._judged = None
        if self.calibration is None or not config.greedy or not cand.tokens:
            return Draft(cand.tokens)
        n = len(cand.tokens)
        self._judged = Judged(self.calibration, cand.branches[:n], suffix_groups(cand.match_len, n))
        return Draft(cand.tokens, survival=self._judged.estimates())

    def record(self, seq: list[int]) -> None:
        """Add the verified output past what the store has of this request."""
        if self._prompt_len is None:
            return
        mine = self.local.seqs.get(0, [])
        self._verified = common_prefix_len(mine, seq, min(self._verified, len(mine)))
        new = seq[self._prompt_len + self._saved :]
        if new:
            if self._sid is None:
                self._sid = self.store.open()
            self.store.append(self._sid, new)
            self._saved += len(new)

    def feedback(self, seq, n_accepted, n_drafted) -> None:
        if self._judged is not None:
            self._judged.observe(n_accepted, n_drafted)
        self._judged = None
        self.record(seq)

    def trimmed(self, n: int) -> None:
        if self._judged is not None:
            self._judged.trim(n)
