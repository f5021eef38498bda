"""``drafter="auto"``: per verify pass, the suffix draft or the draft model's, whichever is worth more.

Each step the suffix drafter's candidate (free: microseconds) is scored the way the confidence
schedule scores a model draft: every position's branch frequency, calibrated online per match
length, gives a conditional acceptance a_i, the survivals S_i = a_1...a_i give the expected tokens
of each prefix, and the verify-cost curve gives its price (``schedule.best_length``). Its best
prefix is taken when its expected tokens per unit cost beat what the draft model is expected to
yield (``ConfidenceSchedule.projected_yield``, draft passes included); otherwise the draft model
drafts under its confidence schedule, which may itself decide a draft is not worth it; with no
draft model (or neither worth it) the pass verifies no draft. ``DecodeStats.source_steps`` counts
the choices ("suffix", "model", "none").

What drafting learns about a pair (the suffix tree of earlier outputs, the calibrations, the
verify-cost curve) lives in one ``DraftMemory`` per pair (``memory_for``), shared by its calls.
Greedy calls read and update it; sampled calls only add their outputs to the tree, and draft from
fresh calibrations and the default cost curve, so a seeded call never depends on earlier calls or
on timing. Every choice is a function of the verified context (and, for sampled model drafts, of
the draft's own distributions before each token is drawn): the output is the target's.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import torch

from agentspec.config import GenerationConfig
from agentspec.drafters.base import Draft
from agentspec.drafters.model import ModelDrafter
from agentspec.drafters.schedule import (
    Calibration,
    ConfidenceSchedule,
    PassTimer,
    VerifyCost,
    best_length,
    pass_yield,
    survival,
)
from agentspec.drafters.suffix import SuffixDrafter, SuffixStore
from agentspec.grammar import Constraint

# auto's suffix candidates may run 3x the match length (the suffix drafter alone: 1x). Auto cuts
# every candidate to its best prefix by calibrated survival and verify cost, so a longer candidate
# costs nothing when unsure and pays when a short match continues with certainty; replaying the
# agent traces (benchmarks/sim_drafters.py) gave +6-10% over 1x in every domain, with 2-4 alike.
CANDIDATE_FACTOR = 3.0
MATCH_GROUPS = (3, 6, 12)  # match-length buckets for the suffix calibration: 1-2, 3-5, 6-11, 12+


def match_group(match_len: int) -> int:
    return sum(match_len >= b for b in MATCH_GROUPS)


SUFFIX_PRIOR = (0.6, 0.75, 0.85, 0.92)  # per match group: acceptance of a continuation seen every time


def _suffix_prior(branch: float, group: int) -> float:
    return SUFFIX_PRIOR[group] * branch  # before evidence (the calibration replaces it as passes verify)


@dataclass
class DraftMemory:
    """What drafting learns about one pair across calls (read and updated by greedy calls)."""

    store: SuffixStore = field(default_factory=SuffixStore)  # earlier outputs
    suffix_calibration: Calibration = field(default_factory=lambda: Calibration(_suffix_prior))
    model_calibration: Calibration = field(default_factory=Calibration)
    cost: VerifyCost = field(default_factory=VerifyCost)


_MEMORIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {id(draft): (ref, memory)}
_MEMORIES_LOCK = threading.Lock()


def memory_for(pair) -> DraftMemory:
    """The DraftMemory of the pair's (target, draft model), kept as long as the target lives.

    Pairs that share a target share its tree of earlier outputs; calibrations and costs, which
    describe a draft model, are per draft model.
    """
    with _MEMORIES_LOCK:
        per_target = _MEMORIES.setdefault(pair.target, {})
        key = None if pair.draft is None else id(pair.draft)
        ref, memory = per_target.get(key, (None, None))
        if memory is None or (ref is not None and ref() is not pair.draft):  # absent, or its id reused
            others = [m for _, m in per_target.values()]
            memory = DraftMemory(store=others[0].store) if others else DraftMemory()
            per_target[key] = (None if pair.draft is None else weakref.ref(pair.draft), memory)
        return memory


class HybridDrafter:
    """Suffix drafts, scored against a cost model; with a draft model see ``HybridModelDrafter``."""

    name = "auto"
    draft_cap = 16  # the schedule picks each draft's length; this only bounds it

    def __init__(self, memory: DraftMemory | None = None, suffix: SuffixDrafter | None = None):
        self.memory = memory if memory is not None else DraftMemory()
        if suffix is None:
            suffix = SuffixDrafter(self.memory.store, factor=CANDIDATE_FACTOR)
        self.suffix = suffix
        self.timer = PassTimer()
        self._begin_call()

    def _begin_call(self) -> None:
        self.calibration: Calibration | None = None  # this call's (set at its first proposal)
        self.cost: VerifyCost | None = None
        self.choice: str | None = None  # source of the last proposal
        self._branches: list[float] = []
        self._group = 0

    def _begin(self, greedy: bool) -> None:
        m = self.memory
        self.calibration = m.suffix_calibration if greedy else m.suffix_calibration.fresh()
        self.cost = m.cost if greedy else m.cost.frozen()

    def suffix_draft(self, seq: list[int], k: int, greedy: bool) -> tuple[list[int], list[float], int, float]:
        """The suffix candidate's best prefix: tokens, branch frequencies, match group, yield per cost."""
        cand = self.suffix.candidate(seq, k, use_store=greedy)
        group = match_group(cand.match_len)
        s = survival([self.calibration(b, group) for b in cand.branches])
        d = best_length(s, self.cost.verify)
        return cand.tokens[:d], cand.branches[:d], group, pass_yield(s, d, self.cost.verify, 0.0)

    def model_yield(self, k: int) -> float:
        """Expected tokens per unit cost of a model draft now (0: no draft model)."""
        return 0.0

    def model_draft(self, seq, k, config, generator, constraint) -> Draft:
        return Draft([])

    def model_feedback(self, n_accepted: int, n_drafted: int) -> None:
        pass

    def propose(
        self,
        seq: list[int],
        k: int,
        config: GenerationConfig,
        generator: torch.Generator | None,
        constraint: Constraint | None = None,
    ) -> Draft:
        if self.calibration is None:
            self._begin(config.greedy)
        tokens, branches, group, y_suffix = self.suffix_draft(seq, k, config.greedy)
        if tokens and y_suffix >= self.model_yield(k):
            draft, self.choice = Draft(tokens), "suffix"
            self._branches, self._group = branches, group
        else:
            draft = self.model_draft(seq, k, config, generator, constraint)
            self.choice = "model" if draft.tokens else "none"
        draft.source = self.choice
        self.timer.proposed()
        return draft

    def feedback(self, seq, n_accepted, n_drafted) -> None:
        if self.cost is not None:
            self.timer.verified(self.cost, n_drafted)
        if self.choice == "suffix" and n_drafted == len(self._branches):  # else a grammar changed it
            self.calibration.observe(self._branches, n_accepted, [self._group] * n_drafted)
        elif self.choice == "model":
            self.model_feedback(n_accepted, n_drafted)
        self.choice = None
        self.suffix.record(seq)

    def reset(self) -> None:
        self.suffix.reset()
        self.timer.reset()
        self._begin_call()


class HybridModelDrafter(HybridDrafter, ModelDrafter):
    """``HybridDrafter`` with a confidence-scheduled draft model behind the suffix drafts.

    It is a ``ModelDrafter`` (its ``state`` is the draft model's KV state), so ``stream()`` restores
    and saves the draft's cache with the prefix cache exactly as for ``drafter="model"``. While the
    suffix drafts, the draft model is fed the verified tokens in batches (``keep_up``).
    """

    def __init__(
        self, model, vocab_size: int, memory: DraftMemory | None = None, suffix: SuffixDrafter | None = None
    ):
        memory = memory if memory is not None else DraftMemory()
        schedule = ConfidenceSchedule(memory.model_calibration, memory.cost)
        ModelDrafter.__init__(self, model, vocab_size, schedule)
        HybridDrafter.__init__(self, memory, suffix)

    def _begin(self, greedy: bool) -> None:
        super()._begin(greedy)
        self.schedule.begin(greedy, self.cost)

    def model_yield(self, k: int) -> float:
        return self.schedule.projected_yield(k)

    def model_draft(self, seq, k, config, generator, constraint) -> Draft:
        return self._draft(seq, k, config, generator, constraint)

    def model_feedback(self, n_accepted: int, n_drafted: int) -> None:
        self.schedule.observe(n_accepted, n_drafted)

    def feedback(self, seq, n_accepted, n_drafted) -> None:
        HybridDrafter.feedback(self, seq, n_accepted, n_drafted)
        self.keep_up(seq)  # while the suffix drafts, the draft model must not fall far behind

    def reset(self) -> None:
        HybridDrafter.reset(self)
        ModelDrafter.reset(self)


def build_drafter(pair, name: str, memory: DraftMemory | None = None):
    """The drafter called ``name`` for ``pair`` ("auto", "suffix", "model", "model_scheduled",
    "prompt_lookup"); learned state comes from ``memory`` (default: the pair's own)."""
    from agentspec.drafters.prompt_lookup import PromptLookupDrafter

    if name == "prompt_lookup":
        return PromptLookupDrafter()
    memory = memory if memory is not None else memory_for(pair)
    vocab = pair.target.config.vocab_size
    if name == "suffix":
        return SuffixDrafter(memory.store)
    if name == "auto":
        if pair.draft is None:
            return HybridDrafter(memory)
        return HybridModelDrafter(pair.draft, vocab, memory)
    if name in ("model", "model_scheduled"):
        if pair.draft is None:
            raise ValueError(f"drafter={name!r} needs a pair loaded with a draft_model")
        if name == "model":
            return ModelDrafter(pair.draft, vocab_size=vocab)
        schedule = ConfidenceSchedule(memory.model_calibration, memory.cost)
        return ModelDrafter(pair.draft, vocab, schedule, name="model_scheduled")
    raise ValueError(f"drafter: unknown name {name!r}")
