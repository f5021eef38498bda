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

What drafting learns about a pair's calls (the suffix tree of earlier outputs, the calibrations)
lives in a ``DraftMemory`` held by the pair's store of tenants (``ModelPair.tenants``, one per
namespace: calls of one namespace share it, other namespaces never see it, and the least recently
used are dropped over the store's byte budget, see ``agentspec.drafters.tenants``); what a verify
pass costs is the pair's (``agentspec.cost.VerifyCost``, ``ModelPair.cost.verify``), the same
whatever the namespace. Greedy calls read and update both; sampled calls only add their outputs to
the tree, and draft from fresh calibrations and the default cost curve, so a seeded call never
depends on earlier calls or on timing. Every choice is a function of the verified context (and,
for sampled model drafts, of the draft's own distributions before each token is drawn): the output
is the target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agentspec.config import GenerationConfig
from agentspec.cost import VerifyCost
from agentspec.drafters.base import Draft, Drafter
from agentspec.drafters.model import ModelDrafter
from agentspec.drafters.prompt_lookup import lookup_prior
from agentspec.drafters.schedule import (
    Calibration,
    Judged,
    best_length,
    pass_yield,
    survival,
)
from agentspec.drafters.suffix import SuffixDrafter, SuffixStore, suffix_groups, suffix_prior
from agentspec.grammar import Constraint
from agentspec.kv import ModelState
from agentspec.steps import Steps, run_alone

# auto's suffix candidates may run 3x the match length (the suffix drafter alone: 1x). Auto cuts
# every candidate to its best prefix by calibrated survival and verify cost, so a longer candidate
# costs nothing when unsure and pays when a short match continues with certainty; replaying the
# agent traces offline favoured it over 1x in every domain, 2-4 alike (docs/benchmarks.md, "Design
# probes", has the figures).
CANDIDATE_FACTOR = 3.0
MODEL_RECALIBRATE = 16.0  # the draft model's calibration: a second stage per position (Calibration)


@dataclass
class DraftMemory:
    """What drafting learns about one namespace's calls (read and updated by greedy calls)."""

    store: SuffixStore = field(default_factory=SuffixStore)  # earlier outputs
    suffix_calibration: Calibration = field(default_factory=lambda: Calibration(suffix_prior))
    lookup_calibration: Calibration = field(default_factory=lambda: Calibration(lookup_prior))
    model_calibration: Calibration = field(default_factory=lambda: Calibration(recalibrate=MODEL_RECALIBRATE))
    # what a verify pass costs: in a pair's memories, the pair's one VerifyCost (TenantStore.verify)
    cost: VerifyCost = field(default_factory=VerifyCost)


class HybridDrafter(Drafter):
    """Suffix drafts, scored against a cost model, and an optional draft model behind them.

    ``model`` is a ``ModelDrafter`` with a ``ConfidenceSchedule`` (``build_drafter`` makes one over
    the memory's model calibration and cost). The hybrid hands the prefix cache the model's KV
    state (``kv_state``), exactly as ``drafter="model"`` does; while the suffix drafts, the draft
    model is fed the verified tokens in batches (``ModelDrafter.keep_up``).
    """

    name = "auto"
    draft_cap = 16  # the schedule picks each draft's length; this only bounds it
    masks_own_draft = True  # the draft model's tokens are drawn under the grammar's mask

    def __init__(
        self,
        memory: DraftMemory | None = None,
        suffix: SuffixDrafter | None = None,
        model: ModelDrafter | None = None,
    ):
        if model is not None and model.schedule is None:
            raise ValueError("HybridDrafter: the model drafter needs a ConfidenceSchedule to weigh drafts")
        self.memory = memory if memory is not None else DraftMemory()
        if suffix is None:
            suffix = SuffixDrafter(self.memory.store, factor=CANDIDATE_FACTOR)
        self.suffix = suffix
        self.model = model
        self.feature_layers = model.feature_layers if model is not None else ()
        self.context_rows = model.context_rows if model is not None else 0
        self._begin_call()

    def _begin_call(self) -> None:
        self.calibration: Calibration | None = None  # this call's (set at its first proposal)
        self.cost: VerifyCost | None = None
        self.choice: str | None = None  # source of the last proposal
        self._judged: Judged | None = None  # the last suffix draft's branch frequencies and groups

    def _begin(self, greedy: bool) -> None:
        m = self.memory
        self.calibration = m.suffix_calibration if greedy else m.suffix_calibration.fresh()
        self.cost = m.cost if greedy else m.cost.frozen()
        if self.model is not None:
            self.model.schedule.begin(greedy, self.cost)

    def suffix_draft(self, seq: list[int], k: int, greedy: bool) -> tuple[Draft, Judged, float]:
        """The suffix candidate's best prefix: the draft (its calibrated acceptances as its survival
        estimates), its branch frequencies and groups to learn from, its yield per cost."""
        cand = self.suffix.candidate(seq, k, use_store=greedy)
        judged = Judged(
            self.calibration, list(cand.branches), suffix_groups(cand.match_len, len(cand.branches))
        )
        acceptance = judged.estimates()
        s = survival(acceptance)
        d = best_length(s, self.cost.verify)
        judged.trim(d)
        return (
            Draft(cand.tokens[:d], survival=acceptance[:d]),
            judged,
            pass_yield(s, d, self.cost.verify, 0.0),
        )

    def model_yield(self, k: int) -> float:
        """Expected tokens per unit cost of a model draft now (0: no draft model)."""
        return 0.0 if self.model is None else self.model.schedule.projected_yield(k)

    def propose(
        self, seq, k, config: GenerationConfig, generator, constraint: Constraint | None = None
    ) -> Draft:
        return run_alone(self.propose_steps(seq, k, config, generator, constraint))

    def propose_steps(
        self, seq, k, config: GenerationConfig, generator, constraint: Constraint | None = None
    ) -> Steps[Draft]:
        if self.calibration is None:
            self._begin(config.greedy)
        suffix, judged, y_suffix = self.suffix_draft(seq, k, config.greedy)
        if suffix.tokens and y_suffix >= self.model_yield(k):
            draft, self.choice, self._judged = suffix, "suffix", judged
        elif self.model is not None:
            draft = yield from self.model.propose_steps(seq, k, config, generator, constraint)
            self.choice = "model" if len(draft.tokens) else "none"
        else:
            draft, self.choice = Draft([]), "none"
        draft.source = self.choice
        return draft

    def feedback(self, seq, n_accepted, n_drafted) -> None:
        if self.choice == "suffix":
            self._judged.observe(n_accepted, n_drafted)
        elif self.choice == "model":
            self.model.schedule.observe(n_accepted, n_drafted)
        self.suffix.record(seq)
        if self.model is not None:
            self.model.settle(seq, n_accepted if self.choice == "model" else 0)
            self.model.keep_up(seq)  # while the suffix drafts, the draft model must not fall far behind
        self.choice = None

    def trimmed(self, n: int) -> None:
        if self.choice == "suffix":
            self._judged.trim(n)
        elif self.choice == "model":
            self.model.trimmed(n)

    def reset(self) -> None:
        self.suffix.reset()
        self._begin_call()
        if self.model is not None:
            self.model.reset()

    def observe_confidences(self, confidences: list[float]) -> None:
        self.model.observe_confidences(confidences)  # only a model draft carries confidences

    def observe_features(self, position: int, features: torch.Tensor) -> None:
        self.model.observe_features(position, features)  # called only with feature_layers: a model

    def kv_state(self) -> ModelState | None:
        return None if self.model is None else self.model.kv_state()

    def adopt_kv_state(self, state: ModelState) -> None:
        self.model.adopt_kv_state(state)  # only a state restored for kv_state().model comes back

    def catch_up(self, ids: list[int]) -> None:
        if self.model is not None:
            self.model.catch_up(ids)
