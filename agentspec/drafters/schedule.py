"""How many draft tokens one verify pass is worth: survival from calibrated confidence, cost from timing.

A pass that verifies ``d`` draft tokens feeds ``d + 1`` tokens to the target and costs ``V(d + 1)``
one-token steps, ``V(n) = T(n) / T(1)`` (the verify-cost curve). Draft position ``i`` carries a
confidence ``c_i`` (the draft model's top probability, or a suffix match's branch frequency); a
``Calibration`` maps it to ``a_i = P(token i accepted | tokens before it accepted)``, learned online
from what verification reveals. The survival of the prefix is ``S_i = a_1 ... a_i`` (DSpark's
cumulative confidence), so a pass yields ``1 + S_1 + ... + S_d`` tokens in expectation (the target
always adds one) and costs ``V(d + 1) + d * c`` steps, ``c`` = one draft-model step / one target step
(0 for model-free drafts). ``best_length`` picks the ``d`` with the most tokens per unit cost; a
drafter stops drafting once no longer draft could beat the best prefix so far (``worth_extending``).
On a CPU ``V(2)`` is well above 1 (the CPU prior, ``cost.DEFAULT_VERIFY_COST``): a single draft token
must then be accepted ``V(2) - 1`` of the time just to break even.

Lossless: the length of a sampled draft is decided before each token is sampled, from the
confidences of the positions before it (a function of the output prefix, not of the token itself);
only a deterministic draft is cut after the fact (``trim``).

The schedule reads the pair's ``agentspec.cost.VerifyCost`` (``V(n)`` and the draft step's share,
from its device kind's prior until the pair's own passes are timed: the target's by the engine, a
draft model's steps on the device's clock by ``DraftStepTimer`` here; no separate calibration run).
Sampled calls use a frozen copy of the prior and fresh calibrations, so a seeded call never depends
on timing or on earlier calls.

Pure functions first, then the stateful pieces: ``Calibration``, ``ConfidenceSchedule``, the timers.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from agentspec.cost import VerifyCost

TYPICAL_ACCEPTANCE = 0.7  # a draft model's acceptance per position before any evidence (Leviathan: 0.6-0.8)


# --- pure functions --------------------------------------------------------------------------------


def survival(acceptance: Sequence[float]) -> list[float]:
    """S_i = a_1 * ... * a_i: the probability that the first i draft tokens are all accepted."""
    out, s = [], 1.0
    for a in acceptance:
        s *= a
        out.append(s)
    return out


def pass_yield(
    survivals: Sequence[float], d: int, verify: Callable[[int], float], draft_step: float
) -> float:
    """Expected tokens per unit cost of a pass verifying the first d draft tokens."""
    return (1.0 + sum(survivals[:d])) / (verify(d + 1) + d * draft_step)


def best_length(survivals: Sequence[float], verify: Callable[[int], float], draft_step: float = 0.0) -> int:
    """The d in 0..len(survivals) with the best expected tokens per unit cost (0: verify no draft)."""
    best, best_y, total = 0, 1.0 / verify(1), 1.0
    for d, s in enumerate(survivals, start=1):
        total += s
        y = total / (verify(d + 1) + d * draft_step)
        if y > best_y:
            best, best_y = d, y
    return best


def worth_extending(
    survivals: Sequence[float], a_next: float, k: int, verify: Callable[[int], float], draft_step: float
) -> bool:
    """Whether drafting position ``len(survivals) + 1`` (acceptance ``a_next``) can pay.

    Later positions are projected with the same conditional acceptance ``a_next``; the answer is
    yes when some length up to ``k`` then beats the best length among those already drafted.
    """
    j = len(survivals)
    best = max(pass_yield(survivals, d, verify, draft_step) for d in range(j + 1))
    total, s = 1.0 + sum(survivals), survivals[-1] if survivals else 1.0
    for d in range(j + 1, k + 1):
        s *= a_next
        total += s
        if total / (verify(d + 1) + d * draft_step) > best:
            return True
    return False


# --- calibration -----------------------------------------------------------------------------------


POSITIONS = 4  # draft positions calibrated apart (DSpark calibrates position by position); the rest as one


def positioned(group: int, position: int) -> int:
    """The calibration group of a draft token at ``position`` (0: the first) whose evidence is of
    kind ``group`` (a match length's, an n-gram's): a prior reads the kind as ``group // POSITIONS``."""
    return group * POSITIONS + min(position, POSITIONS - 1)


@dataclass
class Calibration:
    """P(accepted | confidence), per (group, confidence bin), pulled toward what the group's kind
    shows over every position, and that toward a prior curve.

    Each cell holds decayed counts of hits and trials. A group is a kind of evidence (the suffix
    drafter's match length) at a draft position (``positioned``); the kind's cell of a bin pools every
    position's evidence, ``base = (pooled hits + weight * prior(c, group)) / (pooled trials + weight)``,
    and a group's estimate is ``(hits + weight * base) / (trials + weight)``: a later position, which
    a short draft seldom reaches, starts from what the first positions showed and moves to its own
    rate as its evidence grows (DSpark calibrates position by position). Verification of a d-token
    draft that accepted n tokens reveals n hits and, when n < d, one miss at position n + 1; later
    positions are unseen.

    With ``recalibrate`` > 0 a second stage maps (draft position, bin of that estimate) to the
    acceptance seen where the first stage gave it, pulled toward the estimate by ``recalibrate``
    pseudo-observations. A draft model's schedule needs it: it drafts where a bin's running estimate
    is high, so the tokens it verifies are those whose estimate ran high by chance and their
    acceptance falls below it (a winner's curse the first stage, learning per confidence bin, does
    not see); the second stage learns from exactly the estimates the schedule acted on. Replayed on
    the draft model's evidence of three runs, its ECE went 0.065 -> 0.043, 0.047 -> 0.059 and, on
    the largest (1,403 tokens), 0.027 -> 0.023 (docs/benchmarks.md, traces). Suffix and lookup
    estimates, drafted whatever they say, are calibrated without it.
    """

    # what a confidence means before any evidence: prior(confidence, group)
    prior: Callable[[float, int], float] = lambda c, group: c  # noqa: E731
    bins: int = 10
    weight: float = 4.0  # pseudo-observations behind the prior
    decay: float = 0.995  # each update shrinks a cell's old counts: recent evidence counts more
    cells: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (group, bin) -> [hits, trials]
    pooled: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (kind, bin), every position
    total: list[float] = field(default_factory=lambda: [0.0, 0.0])  # every position: [hits, trials]
    first: list[float] = field(default_factory=lambda: [0.0, 0.0])  # calibrated a_1 of proposals: [sum, n]
    # a schedule's probing of a draft that does not pay: steps skipped since the last draft, and
    # the current interval between probes (0: not started); kept here so it lasts across calls
    idle: int = 0
    probe_interval: int = 0
    recalibrate: float = 0.0  # pseudo-observations behind the second stage's estimate (0: no stage)
    second: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (position, bin) -> counts

    def _bin(self, c: float) -> int:
        return min(self.bins - 1, max(0, int(c * self.bins)))

    def __call__(self, confidence: float, group: int = 0) -> float:
        a = self._first(confidence, group)
        if not self.recalibrate:
            return a
        hits, trials = self.second.get((group % POSITIONS, self._bin(a)), (0.0, 0.0))
        return (hits + self.recalibrate * a) / (trials + self.recalibrate)

    def _first(self, confidence: float, group: int) -> float:
        b = self._bin(confidence)
        hits, trials = self.pooled.get((group // POSITIONS, b), (0.0, 0.0))
        base = (hits + self.weight * self.prior(confidence, group)) / (trials + self.weight)
        hits, trials = self.cells.get((group, b), (0.0, 0.0))
        return (hits + self.weight * base) / (trials + self.weight)

    def trials(self, confidence: float, group: int = 0) -> float:
        """Evidence behind the estimate at this confidence (decayed count of verified positions)."""
        return self.cells.get((group, self._bin(confidence)), (0.0, 0.0))[1]

    def overall(self, prior: float = TYPICAL_ACCEPTANCE) -> float:
        """Acceptance per position over all evidence (for deciding before any confidence is known)."""
        hits, trials = self.total
        return (hits + self.weight * prior) / (trials + self.weight)

    def note_first(self, a: float) -> None:
        """Record the calibrated acceptance of a proposal's first position (drafted or not)."""
        self.first[0] = self.first[0] * self.decay + a
        self.first[1] = self.first[1] * self.decay + 1.0

    def expected_first(self, prior: float = TYPICAL_ACCEPTANCE) -> float:
        """What the first position of the next proposal is expected to be worth."""
        total, n = self.first
        return (total + self.weight * prior) / (n + self.weight)

    def observe(
        self, confidences: Sequence[float], n_accepted: int, groups: Sequence[int] | None = None
    ) -> None:
        judged = [(c, groups[i] if groups else 0) for i, c in enumerate(confidences[: n_accepted + 1])]
        # the second stage's cells: by the first stage's estimates as the schedule read them
        second = [(g % POSITIONS, self._bin(self._first(c, g))) for c, g in judged if self.recalibrate]
        for i, (c, group) in enumerate(judged):
            b = self._bin(c)
            stages = [self.cells.setdefault((group, b), [0.0, 0.0])]
            stages += [self.pooled.setdefault((group // POSITIONS, b), [0.0, 0.0]), self.total]
            if second:
                stages.append(self.second.setdefault(second[i], [0.0, 0.0]))
            hit = 1.0 if i < n_accepted else 0.0
            for counts in stages:
                counts[0] = counts[0] * self.decay + hit
                counts[1] = counts[1] * self.decay + 1.0

    def fresh(self) -> Calibration:
        """The same prior with no evidence."""
        return Calibration(self.prior, self.bins, self.weight, self.decay, recalibrate=self.recalibrate)


@dataclass
class Judged:
    """A proposal's confidences and calibration groups, kept until its pass is verified: its
    estimates come from ``calibration``, which learns from the positions verified (``trim``: a
    scheduler verified a prefix) and only where the draft was verified whole (a grammar may cut it)."""

    calibration: Calibration
    confidences: list[float]
    groups: list[int]

    def estimates(self) -> list[float]:
        return [self.calibration(c, g) for c, g in zip(self.confidences, self.groups)]

    def trim(self, n: int) -> None:
        del self.confidences[n:], self.groups[n:]

    def observe(self, n_accepted: int, n_drafted: int) -> None:
        if n_drafted == len(self.confidences):
            self.calibration.observe(self.confidences, n_accepted, self.groups)


# --- the schedule of a draft model ------------------------------------------------------------------


class ConfidenceSchedule:
    """Draft length for a draft model, decided token by token from calibrated confidence and cost.

    Per call, ``begin(greedy)`` picks what it learns into: a greedy call the shared calibration and
    cost model (the pair's, across calls), a sampled call fresh ones (see the module docstring).
    Per proposal: ``start(k)`` says whether drafting is worth a draft pass at all (the projected
    yield at the calibrated average acceptance beats plain decoding; else a probe after 4, 8, ...
    128 skipped steps, whose first token is always verified, so the estimate can recover; the
    back-off lives in the calibration, across calls, and ends when drafting pays again);
    ``include(confidence)``, before each token is drawn, whether that position still pays (a first
    position whose confidence bin has under ``explore_trials`` verified positions is drafted anyway:
    an uncalibrated confidence must not veto the draft forever);
    ``trim()`` cuts a deterministic draft to its best prefix; ``observe`` feeds the verification
    back to the calibration.
    """

    def __init__(
        self,
        calibration: Calibration | None = None,
        cost: VerifyCost | None = None,
        probe_every: int = 4,
        max_probe_every: int = 128,
        explore_trials: int = 3,
    ):
        self.shared_calibration = calibration if calibration is not None else Calibration()
        self.shared_cost = cost if cost is not None else VerifyCost()
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.explore_trials = explore_trials  # first positions verified per confidence bin regardless
        self.calibration: Calibration | None = None  # this call's (set by begin)
        self.cost: VerifyCost | None = None
        self.end_call()

    def begin(self, greedy: bool, cost: VerifyCost | None = None) -> None:
        self.calibration = self.shared_calibration if greedy else self.shared_calibration.fresh()
        self.cost = cost if cost is not None else self.shared_cost if greedy else self.shared_cost.frozen()

    def end_call(self) -> None:
        self.calibration = self.cost = None
        self._k, self.probing, self._explored = 0, False, False
        self.confidences: list[float] = []  # of the tokens included in the current proposal
        self.survivals: list[float] = []

    @property
    def backing_off(self) -> bool:
        """Whether the draft model has stopped paying and is only probed now and then."""
        cal = self.calibration if self.calibration is not None else self.shared_calibration
        return cal.probe_interval > self.probe_every

    def projected_yield(self, k: int) -> float:
        """Best expected tokens per unit cost of drafting now, before any confidence is known.

        The first position is worth what recent first positions were (their calibrated
        acceptance, whether drafted or not); later ones the average acceptance per position.
        """
        a = self.calibration.overall()
        s = survival([self.calibration.expected_first()] + [a] * (k - 1))
        d = best_length(s, self.cost.verify, self.cost.draft_step)
        return pass_yield(s, d, self.cost.verify, self.cost.draft_step)

    def start(self, k: int) -> bool:
        self.confidences, self.survivals, self._k, self.probing, self._explored = [], [], k, False, False
        cal = self.calibration
        if k > 0 and self.projected_yield(k) > 1.0:
            cal.idle, cal.probe_interval = 0, self.probe_every
            return True
        cal.idle += 1
        interval = cal.probe_interval or self.probe_every
        if k > 0 and cal.idle >= interval:  # probe: the calibration only learns from drafts
            cal.idle, cal.probe_interval = 0, min(2 * interval, self.max_probe_every)
            self.probing = True
            return True
        return False

    def planned(self, k: int) -> int:
        """The draft length decided before drafting, from what the calibration expects of each
        position (its first, then its average), for a draft that reads no confidence while it runs
        (on a GPU each read would stall the device's queue): the confidences come back with the
        verification's read (``observed``). A probe drafts at least one token."""
        cal = self.calibration
        s = survival([cal.expected_first()] + [cal.overall()] * (k - 1))
        d = best_length(s, self.cost.verify, self.cost.draft_step)
        d = max(d, min(1, k)) if self.probing else d
        self.confidences, self.survivals, self._explored = [], s[:d], self.probing
        return d

    def observed(self, confidences: list[float]) -> None:
        """A planned draft's confidences (of the tokens it verifies), read with the verification."""
        self.confidences = list(confidences[: len(self.survivals)])
        if self.confidences:
            self.calibration.note_first(self.calibration(self.confidences[0], positioned(0, 0)))

    def include(self, confidence: float) -> bool:
        a = self.calibration(confidence, positioned(0, len(self.survivals)))
        first = not self.survivals
        if first:
            self.calibration.note_first(a)
        # a probe, or a confidence with too little evidence yet: verify it, to learn what it means
        explore = first and (self.probing or self.calibration.trials(confidence) < self.explore_trials)
        self._explored = self._explored or explore
        cost = self.cost
        if not explore and not worth_extending(self.survivals, a, self._k, cost.verify, cost.draft_step):
            return False
        self.confidences.append(confidence)
        self.survivals.append((self.survivals[-1] if self.survivals else 1.0) * a)
        return True

    def trim(self) -> int:
        """The best prefix length of the current (deterministic) draft (an explored first token stays)."""
        d = best_length(self.survivals, self.cost.verify, self.cost.draft_step)
        if self._explored:
            d = max(d, min(1, len(self.survivals)))
        self.keep(d)
        return d

    def keep(self, n: int) -> None:
        del self.confidences[n:], self.survivals[n:]

    def acceptance(self) -> list[float]:
        """Each kept draft token's calibrated chance of acceptance given those before it."""
        before = [1.0] + self.survivals[:-1]
        return [s / b if b > 0 else 0.0 for s, b in zip(self.survivals, before)]

    def observe(self, n_accepted: int, n_drafted: int) -> None:
        if n_drafted and n_drafted == len(self.confidences):  # else a grammar changed the draft: skip
            groups = [positioned(0, j) for j in range(n_drafted)]
            self.calibration.observe(self.confidences, n_accepted, groups)
        self.confidences, self.survivals = [], []


class DeviceClock:
    """Marks on a device's timeline, and the seconds between two of them once both have passed.

    On CUDA a mark is an event recorded on the device's current stream: the host runs ahead of the
    GPU, so ``time.perf_counter()`` would time the queueing, and reading an interval that has not
    run yet would wait for it (a host sync): ``seconds`` answers None until its end has run
    (``Event.query``). Elsewhere a mark is ``time.perf_counter()``, already the device's time.
    """

    def __init__(self, device: torch.device | str | None = None):
        self.device = torch.device(device) if device is not None else None
        self.cuda = self.device is not None and self.device.type == "cuda"

    def mark(self) -> float | torch.cuda.Event:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, start, end) -> float | None:
        if not self.cuda:
            return end - start
        if not end.query():
            return None
        return start.elapsed_time(end) / 1000.0


class DraftStepTimer:
    """Times a draft model's one-token steps on the device's clock (``DeviceClock``), for the draft
    step's share of the schedule's cost (``VerifyCost.observe_draft``; the target's passes are timed
    by the engine, ``PairCost.observe``). On a GPU a step is read once the device has run it (a pass
    or two later), never waited for."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.clock = DeviceClock(device)
        self.reset()

    def reset(self) -> None:
        self._pending: deque = deque()  # (start, end) marks of steps not read yet

    def step(self, cost: VerifyCost, start: float | torch.cuda.Event) -> None:
        """One draft-model step ran from ``start`` (a ``clock.mark()``) to now."""
        self._pending.append((start, self.clock.mark()))
        while self._pending:  # hand ``cost`` the steps that have run, in order
            seconds = self.clock.seconds(*self._pending[0])
            if seconds is None:
                return
            self._pending.popleft()
            cost.observe_draft(seconds)
