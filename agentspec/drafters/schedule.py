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
On this CPU ``V(2) = 1.64``: a single draft token must be accepted 64% of the time just to break even.

Lossless: the length of a sampled draft is decided before each token is sampled, from the
confidences of the positions before it (a function of the output prefix, not of the token itself);
only a deterministic draft is cut after the fact (``trim``).

``VerifyCost`` starts from its device kind's prior (``PRIORS``: on a CPU ``DEFAULT_VERIFY_COST``,
``benchmarks/results/core.json``: SmolLM2-135M, float32, 2 CPU cores, 300-token cache; on a GPU one
step for a pass of up to 16 tokens) and learns the pair's own curve from the verify passes of
greedy calls, timed on the device's clock (``DeviceClock``; no separate calibration run). Sampled
calls keep the fixed prior and fresh calibrations, so a seeded call never depends on timing or on
earlier calls.

Pure functions first, then the stateful pieces: ``Calibration``, ``VerifyCost``, ``ConfidenceSchedule``.
(``VerifyCost`` prices verify passes for drafting decisions; ``agentspec.telemetry.latency.CostModel``
estimates a whole plain call's time for the latency-saved metric: different questions.)
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

# T(n)/T(1) measured by benchmarks/bench_core.py (core.json): n new tokens in one target pass
DEFAULT_VERIFY_COST: tuple[tuple[int, float], ...] = ((1, 1.0), (2, 1.64), (4, 1.79), (8, 2.68), (16, 3.05))
DEFAULT_DRAFT_STEP = 0.1  # one draft-model step / one target step, until measured (a 1/10-size draft)
# On a GPU a batch-1 pass of up to 16 tokens is bound by reading the weights, not by arithmetic (a
# 7B model in bfloat16: 15 GB read at ~4.8 TB/s is ~3 ms; 16 tokens' 0.24 TFLOP at ~790 TFLOP/s is
# ~0.3 ms), so verifying costs one step; an eager 0.5B draft step is launch-bound at about 0.3 of an
# eager 7B step (anchors.md section 9). benchmarks/gpu_check.py measures both on the device.
CUDA_VERIFY_COST: tuple[tuple[int, float], ...] = ((1, 1.0), (16, 1.0))
CUDA_DRAFT_STEP = 0.3
# the priors of each device kind: what a sampled call's schedule uses whatever ran before it
PRIORS: dict[str, tuple[tuple[tuple[int, float], ...], float]] = {
    "cpu": (DEFAULT_VERIFY_COST, DEFAULT_DRAFT_STEP),
    "cuda": (CUDA_VERIFY_COST, CUDA_DRAFT_STEP),
}
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


def interpolate(points: Sequence[tuple[int, float]], n: float) -> float:
    """Piecewise-linear through sorted (n, value) points; past the last point, the last segment's slope."""
    xs = [p[0] for p in points]
    if n <= xs[0]:
        return points[0][1]
    i = bisect.bisect_left(xs, n)
    if i == len(xs):
        i -= 1
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (n - x0) / (x1 - x0)


# --- calibration -----------------------------------------------------------------------------------


@dataclass
class Calibration:
    """P(accepted | confidence), per (group, confidence bin), pulled toward a prior curve.

    Each cell holds decayed counts of hits and trials; its estimate at confidence c is
    ``(hits + weight * prior(c, group)) / (trials + weight)``. Verification of a d-token draft that
    accepted n tokens reveals n hits and, when n < d, one miss at position n + 1; later positions
    are unseen. ``group`` separates kinds of evidence (the suffix drafter groups by match length).
    """

    # what a confidence means before any evidence: prior(confidence, group)
    prior: Callable[[float, int], float] = lambda c, group: c  # noqa: E731
    bins: int = 10
    weight: float = 4.0  # pseudo-observations behind the prior
    decay: float = 0.995  # each update shrinks a cell's old counts: recent evidence counts more
    cells: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (group, bin) -> [hits, trials]
    total: list[float] = field(default_factory=lambda: [0.0, 0.0])  # every position: [hits, trials]
    first: list[float] = field(default_factory=lambda: [0.0, 0.0])  # calibrated a_1 of proposals: [sum, n]
    # a schedule's probing of a draft that does not pay: steps skipped since the last draft, and
    # the current interval between probes (0: not started); kept here so it lasts across calls
    idle: int = 0
    probe_interval: int = 0

    def _bin(self, c: float) -> int:
        return min(self.bins - 1, max(0, int(c * self.bins)))

    def __call__(self, confidence: float, group: int = 0) -> float:
        hits, trials = self.cells.get((group, self._bin(confidence)), (0.0, 0.0))
        return (hits + self.weight * self.prior(confidence, group)) / (trials + self.weight)

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
        for i, c in enumerate(confidences[: n_accepted + 1]):
            hit = 1.0 if i < n_accepted else 0.0
            cell = self.cells.setdefault((groups[i] if groups else 0, self._bin(c)), [0.0, 0.0])
            for counts in (cell, self.total):
                counts[0] = counts[0] * self.decay + hit
                counts[1] = counts[1] * self.decay + 1.0

    def fresh(self) -> Calibration:
        """The same prior with no evidence."""
        return Calibration(self.prior, self.bins, self.weight, self.decay)


# --- verify cost -----------------------------------------------------------------------------------


def isotonic(points: Sequence[tuple[int, float, float]]) -> list[tuple[int, float]]:
    """The non-decreasing fit of (x, y, weight) points sorted by x (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum of w*y, sum of w, number of points]
    for _, y, w in points:
        blocks.append([w * y, w, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            last = blocks.pop()
            blocks[-1] = [blocks[-1][0] + last[0], blocks[-1][1] + last[1], blocks[-1][2] + last[2]]
    fitted = [b[0] / b[1] for b in blocks for _ in range(int(b[2]))]
    return [(x, v) for (x, _, _), v in zip(points, fitted)]


@dataclass
class VerifyCost:
    """V(n) = T(n)/T(1) and the draft step's cost, learned from timed passes when ``learn`` is on.

    Each size n keeps its last ``window`` pass times; T(n) is their median (robust to a pass that
    another process delayed; recent, so T(1) and T(n) come from similar context lengths). V(n)
    comes from the sizes with at least ``min_samples`` passes, fitted non-decreasing (weighted
    isotonic regression: a running maximum of noisy estimates would inflate the curve),
    interpolated between them, and beyond the largest one follows the prior curve's shape; with no
    observations it is the prior. T(1) is observed directly, or inferred from other sizes through
    the prior.
    """

    prior: tuple[tuple[int, float], ...] = DEFAULT_VERIFY_COST
    draft_step_prior: float = DEFAULT_DRAFT_STEP
    learn: bool = True
    min_samples: int = 3
    window: int = 32
    times: dict[int, deque] = field(default_factory=dict)  # n -> recent pass times (seconds)
    draft_times: deque = field(default_factory=lambda: deque(maxlen=32))  # recent draft steps (seconds)
    _curve: tuple[tuple[int, float], ...] | None = None

    def observe_pass(self, n_new: int, seconds: float) -> None:
        if not self.learn or n_new < 1 or seconds <= 0:
            return
        self.times.setdefault(n_new, deque(maxlen=self.window)).append(seconds)
        self._curve = None

    def observe_draft(self, seconds_per_step: float) -> None:
        if self.learn and seconds_per_step > 0:
            self.draft_times.append(seconds_per_step)

    def _medians(self) -> dict[int, tuple[float, int]]:
        return {
            n: (statistics.median(t), len(t)) for n, t in self.times.items() if len(t) >= self.min_samples
        }

    def _t1(self) -> float | None:
        seen = self._medians()
        if 1 in seen:
            return seen[1][0]
        if not seen:
            return None
        return sum(t / interpolate(self.prior, n) for n, (t, _) in seen.items()) / len(seen)

    def curve(self) -> tuple[tuple[int, float], ...]:
        """The current (n, V(n)) points."""
        if self._curve is None:
            t1 = self._t1()
            seen = self._medians()
            data = [(n, t / t1, float(k)) for n, (t, k) in sorted(seen.items()) if n > 1] if t1 else []
            if not data:
                self._curve = tuple(self.prior)
                return self._curve
            points = [(1, 1.0)] + [(n, max(1.0, v)) for n, v in isotonic(data)]
            last_n, last_v = points[-1]  # past the last observed size: the prior's growth from there
            base = interpolate(self.prior, last_n)
            points += [(n, last_v * v / base) for n, v in self.prior if n > last_n]
            self._curve = tuple(points)
        return self._curve

    def verify(self, n: int) -> float:
        """V(n): a pass over n new tokens in one-token steps."""
        return max(1.0, interpolate(self.curve(), n)) if n > 1 else 1.0

    @property
    def draft_step(self) -> float:
        t1 = self._t1()
        if len(self.draft_times) < self.min_samples or not t1:
            return self.draft_step_prior
        return statistics.median(self.draft_times) / t1

    def frozen(self) -> VerifyCost:
        """The prior alone, learning nothing (for sampled calls: no dependence on timing)."""
        return VerifyCost(self.prior, self.draft_step_prior, learn=False)

    @classmethod
    def for_device(cls, device: torch.device | str | None) -> VerifyCost:
        """A cost model starting from the priors of ``device``'s kind (``PRIORS``; others: the CPU's).

        Per kind, not per dtype: the curves' shape comes from where a pass is bound (memory on a
        GPU; on a CPU the kernels' row handling), which the dtype does not change.
        """
        kind = torch.device(device).type if device is not None else "cpu"
        curve, step = PRIORS.get(kind, PRIORS["cpu"])
        return cls(curve, step)


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

    def include(self, confidence: float) -> bool:
        a = self.calibration(confidence)
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

    def observe(self, n_accepted: int, n_drafted: int) -> None:
        if n_drafted and n_drafted == len(self.confidences):  # else a grammar changed the draft: skip
            self.calibration.observe(self.confidences, n_accepted)
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


class PassTimer:
    """Times verify passes from a drafter's side, from the end of ``propose`` to ``feedback``, and a
    draft model's one-token steps, on the device's clock (``DeviceClock``).

    The first pass of a call also prefills the prompt's uncached part, so it is not timed. On a GPU
    an interval is read once the device has run it (a pass or two later), never waited for.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.clock = DeviceClock(device)
        self.reset()

    def reset(self) -> None:
        self._t: float | torch.cuda.Event | None = None
        self._passes = 0
        self._pending: deque = deque()  # (verified tokens or None for a draft step, start, end)

    def proposed(self) -> None:
        self._t = self.clock.mark()

    def verified(self, cost: VerifyCost, n_drafted: int) -> None:
        if self._t is not None and self._passes > 0:
            self._pending.append((n_drafted + 1, self._t, self.clock.mark()))
        self._passes += 1
        self._t = None
        self._read(cost)

    def draft_step(self, cost: VerifyCost, start: float | torch.cuda.Event) -> None:
        """One draft-model step ran from ``start`` (a ``clock.mark()``) to now."""
        self._pending.append((None, start, self.clock.mark()))
        self._read(cost)

    def _read(self, cost: VerifyCost) -> None:
        """Hand ``cost`` the intervals that have run, in order."""
        while self._pending:
            n, start, end = self._pending[0]
            seconds = self.clock.seconds(start, end)
            if seconds is None:
                return
            self._pending.popleft()
            if n is None:
                cost.observe_draft(seconds)
            else:
                cost.observe_pass(n, seconds)
