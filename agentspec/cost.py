"""What the target's passes cost on this machine: one owner per pair (``PairCost``), below the loop.

The engine tells it every whole pass it ran (``PairCost.observe``), traced or not: its rows over all
its requests and its time. Three questions are answered from those passes:

- the scheduler asks what a pass over so many rows costs (``PairCost.pricer``: DSpark's verify
  lengths of a shared pass, ``rows_within``), and the drafting schedule what it costs against a
  one-row pass (``VerifyCost``: ``V(n) = T(n) / T(1)``, and the draft step's share). Both read one
  record, ``PassTimes``: recent pass times by rows;
- telemetry and the server ask what the same call would have cost with plain decoding and no prefix
  cache, for latency saved (``CostModel`` in seconds, ``baseline_seconds``), a curve of the context
  length too, taught by the passes of one request.

``PairCost`` (``ModelPair.cost``) holds them for one pair: one ``PassTimes`` and ``VerifyCost`` shared
by every namespace (what a pass costs does not depend on the tenant), and a ``CostModel`` per torch
thread count (a CPU pass's time depends on it); telemetry only reads it.

The latency baseline: what ``speculative=False, prefix_cache=False`` would do with the same prompt and
output: one pass over all ``P`` prompt tokens (giving the first output token), then one single-token
pass per further output token, after ``P``, ``P + 1``, ... cached tokens, priced by the ``CostModel``:

- ``prefill_s(n) = p0 + p1 n + p2 n^2``: a pass over ``n`` tokens from an empty cache (the squared
  term is attention); after ``c`` cached tokens the new ones also attend to those:
  ``p0 + p1 n + p2 (n^2 + 2 n c)``;
- ``decode_s(c) = d0 + d1 c``: a one-token pass after ``c`` cached tokens.

It starts from a prior for its device kind (a plausible shape, a guessed size) and learns this target
on this machine from the passes of one request (a pass shared by several has no one context):
one-token passes (no draft: exactly a baseline decode pass) move ``decode_scale``; passes over 16
tokens or more (a prompt's uncached part, with any drafts on top) move ``prefill_scale``. Verify
passes over k+1 < 16 tokens move nothing: besides costing more than a one-token pass, they carry
per-pass work a plain pass does not (drafting, k+1 rows of verification and grammar masks), which
pushed estimates high when they were tried. On a prior the first pass a term
sees sets its scale, later ones average in; until a term has seen a pass it borrows the other term's
scale, and the span says ``agentspec.latency.cost_source = "prior"``; once both have, ``"observed"``.
Every pass of a call is observed before its estimate is made, so a call that is itself plain decoding
without cache estimates a saving near zero.

``calibrate`` is the explicit alternative (``agentspec calibrate``): it times the target up front, a
pass from scratch over 3 prompt sizes and 4 single-token passes after each, and installs the fitted
curve (``cost_source = "calibrated"``, as for any curve installed with ``set_cost_model``); later
passes move its scales by a fixed weight.

``latency_saved = baseline - measured``, where measured is the time spent inside the decoder for the
call (lock wait, cache restore and save, drafting, verification), not time the caller spent between
chunks. Tokens a grammar forced count as baseline passes like any other: plain decoding has no
jump-forward. Not modelled: tokens decoded past a stop string or a complete tool call, and time lost
waiting for the pair's lock (counted as measured: it lowers the estimate). ``python -m benchmarks loop
--part telemetry`` compares the summed estimate with a measured baseline run.
"""

from __future__ import annotations

import bisect
import dataclasses
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from agentspec.kv import ModelState
from agentspec.stats import DecodeStats


class CostOwner(Protocol):
    """What ``calibrate`` and the helpers below read of a pair (``agentspec.models.ModelPair``)."""

    target: Any  # the target model
    target_forward: Any  # what its passes call (agentspec.forward.Forward)
    lock: Any  # the pair's lock: calibration times passes no other call shares
    cost: PairCost

    @property
    def max_context(self) -> int: ...


# --- verify cost: the schedule's price of a pass, in one-row steps --------------------------------------

# the CPU prior of T(n)/T(1), n new tokens in one target pass: the core suite's curve on the embedded
# pair (docs/benchmarks.md, core: verify_cost), until the pair's own passes teach it
DEFAULT_VERIFY_COST: tuple[tuple[int, float], ...] = ((1, 1.0), (2, 1.64), (4, 1.79), (8, 2.68), (16, 3.05))
DEFAULT_DRAFT_STEP = 0.1  # one draft-model step / one target step, until measured (a 1/10-size draft)
# On a GPU a batch-1 pass of up to 16 tokens is bound by reading the weights, not by arithmetic (a
# 7B model in bfloat16: 15 GB read at ~4.8 TB/s is ~3 ms; 16 tokens' 0.24 TFLOP at ~790 TFLOP/s is
# ~0.3 ms), so verifying costs one step; an eager 0.5B draft step is launch-bound at about 0.3 of an
# eager 7B step (about 500 kernel launches of 5-7 us each from Python against ~1.3 ms of device work:
# the launch arithmetic gpt-fast's and vLLM's CUDA graphs remove). The gpu-check suite measures both.
CUDA_VERIFY_COST: tuple[tuple[int, float], ...] = ((1, 1.0), (16, 1.0))
CUDA_DRAFT_STEP = 0.3
# the priors of each device kind: what a sampled call's schedule uses whatever ran before it
VERIFY_PRIORS: dict[str, tuple[tuple[tuple[int, float], ...], float]] = {
    "cpu": (DEFAULT_VERIFY_COST, DEFAULT_DRAFT_STEP),
    "cuda": (CUDA_VERIFY_COST, CUDA_DRAFT_STEP),
}


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


def rows_bucket(rows: int) -> int:
    """The row count a pass is filed under: itself up to 64, else the power of two at or above it."""
    return rows if rows <= 64 else 1 << (rows - 1).bit_length()


@dataclass
class PassTimes:
    """Seconds of the target passes a pair's engine ran, by their rows: the one record that prices a
    pass by its rows, for the drafting schedule (``VerifyCost``) and the scheduler (``PairCost.pricer``).

    Every whole pass is observed with all its requests' rows (a drafter sees only its share of a
    shared pass). Each bucket (``rows_bucket``) keeps its last ``window`` passes; its time is their
    median (robust to a pass that another process delayed; recent, so the buckets come from similar
    context lengths). ``points`` reads the buckets with ``min_samples`` passes.
    """

    window: int = 32
    min_samples: int = 3
    observed: int = 0  # passes seen
    _times: dict[int, deque] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, rows: int, seconds: float) -> None:
        if rows < 1 or seconds <= 0:
            return
        with self._lock:
            self.observed += 1
            self._times.setdefault(rows_bucket(rows), deque(maxlen=self.window)).append(seconds)

    def points(self) -> list[tuple[int, float]]:
        """(bucket, seconds) of the buckets with enough passes, by rows: their medians, fitted
        non-decreasing (weighted isotonic regression: a pass of more rows never costs less, and a
        running maximum of noisy medians would inflate the curve)."""
        with self._lock:
            seen = [(n, list(t)) for n, t in self._times.items() if len(t) >= self.min_samples]
        return isotonic(sorted((n, statistics.median(t), len(t)) for n, t in seen))


@dataclass
class VerifyCost:
    """V(n) = T(n)/T(1) and the draft step's cost, the drafting schedule's price of a pass.

    Read from the pair's ``PassTimes`` where they have passes of a size: between measured sizes
    interpolated, beyond the largest one following the prior curve's shape; T(1) is measured, or
    inferred from other sizes through the prior. With no ``times`` (a sampled call's frozen copy) or
    none measured yet, it is the prior. The draft step's share is learned from the draft model's
    steps (``observe_draft``), timed by the drafter on the device's clock (``schedule.DraftStepTimer``).
    """

    prior: tuple[tuple[int, float], ...] = DEFAULT_VERIFY_COST
    draft_step_prior: float = DEFAULT_DRAFT_STEP
    times: PassTimes | None = None  # None: the prior alone, learning nothing
    draft_times: deque = field(default_factory=lambda: deque(maxlen=32))  # recent draft steps (seconds)
    min_samples: int = 3  # draft steps before their median replaces the prior's share
    _curve: tuple[tuple[int, float], ...] | None = None
    _t1: float | None = None  # T(1) in seconds as ``times`` gave it at ``_seen``
    _seen: int = -1  # ``times.observed`` when ``_curve`` and ``_t1`` were read

    def observe_draft(self, seconds_per_step: float) -> None:
        if self.times is not None and seconds_per_step > 0:
            self.draft_times.append(seconds_per_step)

    def _read(self) -> None:
        """``_curve`` and ``_t1`` from ``times``, once per pass they saw (the schedule asks per token)."""
        if self.times is None or self._seen == self.times.observed:
            return
        self._seen = self.times.observed
        points = self.times.points()
        t1 = None  # measured, or inferred from the other sizes through the prior
        if points and points[0][0] == 1:
            t1 = points[0][1]
        elif points:
            t1 = sum(t / interpolate(self.prior, n) for n, t in points) / len(points)
        self._t1 = t1
        data = [(1, 1.0)] + [(n, max(1.0, t / t1)) for n, t in points if n > 1] if t1 else []
        if len(data) < 2:
            self._curve = None
            return
        last_n, last_v = data[-1]  # past the last measured size: the prior's growth from there
        base = interpolate(self.prior, last_n)
        self._curve = tuple(data + [(n, last_v * v / base) for n, v in self.prior if n > last_n])

    def curve(self) -> tuple[tuple[int, float], ...]:
        """The current (n, V(n)) points."""
        self._read()
        return self._curve if self._curve is not None else tuple(self.prior)

    def verify(self, n: int) -> float:
        """V(n): a pass over n new tokens in one-token steps."""
        return max(1.0, interpolate(self.curve(), n)) if n > 1 else 1.0

    @property
    def draft_step(self) -> float:
        self._read()
        if len(self.draft_times) < self.min_samples or not self._t1:
            return self.draft_step_prior
        return statistics.median(self.draft_times) / self._t1

    def frozen(self) -> VerifyCost:
        """The prior alone, learning nothing (for sampled calls: no dependence on timing)."""
        return VerifyCost(self.prior, self.draft_step_prior)

    @classmethod
    def for_device(cls, device: torch.device | str | None, times: PassTimes | None = None) -> VerifyCost:
        """A cost starting from the priors of ``device``'s kind (``VERIFY_PRIORS``; others: the CPU's),
        read from ``times`` once they hold passes.

        Per kind, not per dtype: the curves' shape comes from where a pass is bound (memory on a
        GPU; on a CPU the kernels' row handling), which the dtype does not change.
        """
        kind = torch.device(device).type if device is not None else "cpu"
        curve, step = VERIFY_PRIORS.get(kind, VERIFY_PRIORS["cpu"])
        return cls(curve, step, times)


# --- latency: plain decoding's passes in seconds ------------------------------------------------------

CALIBRATION_SIZES = (32, 256, 512)  # prompt sizes of the from-scratch passes (capped to the context)
DECODE_PASSES = 4  # one-token passes timed after each of them (median per context)
MIN_PREFILL_SAMPLE = 16  # passes over fewer tokens are mostly fixed cost or verify passes: not used
DECODE_RATE = 0.1  # EWMA weight of one plain decode pass
PREFILL_RATE = 0.3  # EWMA weight of one prefill pass (rarer)
SCALE_RANGE = (0.2, 5.0)  # one pass's ratio outside this (of the scale so far) is clipped: a pause, a burst

# the curves a pair starts from, by device type; an unlisted accelerator uses "cuda"'s
LATENCY_PRIORS: dict[str, dict[str, float]] = {
    # the embedded model's calibration on one CPU thread (the loop suite's: docs/benchmarks.md, loop)
    "cpu": {"p0": 0.2, "p1": 2.9e-3, "p2": 5.4e-6, "d0": 0.12, "d1": 2e-5},
    # no accelerator calibration is recorded yet: a launch-bound pass, nearly flat in its tokens
    "cuda": {"p0": 0.012, "p1": 2e-5, "p2": 0.0, "d0": 0.01, "d1": 1e-6},
}


@dataclass
class CostModel:
    """Seconds of target forward passes on one pair: a curve (fitted, given, or a prior) times two scales."""

    p0: float  # prefill_s(n) = (p0 + p1 n + p2 n^2) * prefill scale
    p1: float
    p2: float
    d0: float  # decode_s(c) = (d0 + d1 c) * decode scale
    d1: float
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    prior: bool = False  # the curve is a device type's prior, not fitted on this target
    prefill_passes: int = 0  # passes that moved prefill_scale so far
    decode_passes: int = 0  # passes that moved decode_scale so far
    _lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    @classmethod
    def for_device(cls, device_type: str) -> CostModel:
        """The prior of a device type (``torch.device.type``)."""
        return cls(**LATENCY_PRIORS.get(device_type, LATENCY_PRIORS["cuda"]), prior=True)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    @property
    def source(self) -> str:
        """``agentspec.latency.cost_source``: "prior" while a term has seen no pass, then "observed";
        "calibrated" for a fitted (or given) curve."""
        if not self.prior:
            return "calibrated"
        return "observed" if self.prefill_passes and self.decode_passes else "prior"

    def scales(self) -> tuple[float, float]:
        """(prefill, decode) scales in use: on a prior, a term no pass has moved borrows the other's."""
        prefill, decode = self.prefill_scale, self.decode_scale
        if self.prior and not self.prefill_passes:
            prefill = decode
        if self.prior and not self.decode_passes:
            decode = prefill
        return prefill, decode

    def prefill_s(self, n: int, cached: int = 0) -> float:
        """A pass over ``n`` tokens after ``cached`` ones (a prefill: n of 16 or more).

        The square counts attention pairs: from scratch n^2 (halved into p2), after c cached tokens
        the new tokens also attend to those, n^2 + 2nc: the increment prefill_s(c + n) - prefill_s(c).
        """
        return max(0.0, self._prefill_fit(n, cached)) * self.scales()[0]

    def _prefill_fit(self, n: int, cached: int) -> float:
        return self.p0 + self.p1 * n + self.p2 * (n * n + 2 * n * cached)

    def decode_s(self, cached: int) -> float:
        """A one-token pass after ``cached`` tokens."""
        return max(0.0, self.d0 + self.d1 * cached) * self.scales()[1]

    def decode_sum_s(self, cached: int, passes: int) -> float:
        """``passes`` one-token passes after ``cached``, ``cached + 1``, ... tokens."""
        if passes <= 0:
            return 0.0
        contexts = passes * cached + passes * (passes - 1) / 2  # sum of the cache lengths
        return max(0.0, self.d0 * passes + self.d1 * contexts) * self.scales()[1]

    def observe_pass(self, fed: int, cached: int, seconds: float) -> None:
        """Move the scales toward one target pass the loop timed: ``fed`` rows after ``cached`` ones.

        Only baseline-like passes teach it (see the module docstring): one row with no draft (a plain
        decode pass) moves the decode scale, ``MIN_PREFILL_SAMPLE`` rows or more the prefill scale.
        """
        with self._lock:
            if fed == 1 and cached > 0:
                predicted = max(0.0, self.d0 + self.d1 * cached)
                if predicted > 0:
                    self.decode_scale = self._moved(
                        self.decode_scale, self.decode_passes, seconds / predicted, DECODE_RATE
                    )
                    self.decode_passes += 1
            elif fed >= MIN_PREFILL_SAMPLE:
                predicted = max(0.0, self._prefill_fit(fed, cached))
                if predicted > 0:
                    self.prefill_scale = self._moved(
                        self.prefill_scale, self.prefill_passes, seconds / predicted, PREFILL_RATE
                    )
                    self.prefill_passes += 1

    def _moved(self, scale: float, seen: int, ratio: float, rate: float) -> float:
        """``scale`` after one more pass measured at ``ratio`` times the curve (``seen`` passes before)."""
        lo, hi = SCALE_RANGE
        if not self.prior:  # judged against the calibration, at a fixed weight
            return scale + rate * (min(hi, max(lo, ratio)) - scale)
        if not seen:  # the first pass sets a prior's scale
            return ratio
        ratio = min(hi * scale, max(lo * scale, ratio))  # judged against what was seen so far
        return scale + max(rate, 1 / (seen + 1)) * (ratio - scale)  # a running mean, then the EWMA


# --- the pair's owner of both ---------------------------------------------------------------------------


class PairCost:
    """What one pair's target passes cost: ``ModelPair.cost``.

    The engine tells it every whole pass it ran (``observe``): its rows and time go to ``times``, the
    one record of passes by their rows, which prices a pass for the scheduler (``pricer``) and, as
    ``verify`` (a ``VerifyCost``, shared by every namespace's greedy calls), for the drafting
    schedule; a pass of one request also teaches ``latency()``, the latency baseline's ``CostModel``
    of the current torch thread count (which prices plain decoding by its context, a dimension
    ``times`` does not keep). ``calibrate`` or ``install`` replace the latency curve.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device_type = torch.device(device).type if device is not None else "cpu"
        self.times = PassTimes()  # every whole pass the engine ran, by its rows
        self.verify = VerifyCost.for_device(self.device_type, self.times)
        self._latency: dict[int, CostModel] = {}
        self._lock = threading.Lock()

    def latency(self) -> CostModel:
        """The model for the current thread count (the device kind's prior when there is none yet)."""
        threads = torch.get_num_threads()
        with self._lock:
            found = self._latency.get(threads)
            if found is None:
                found = self._latency[threads] = CostModel.for_device(self.device_type)
            return found

    def install(self, cost: CostModel | None) -> None:
        """Install (or, with None, forget: back to the prior) the model for the current thread count."""
        threads = torch.get_num_threads()
        with self._lock:
            if cost is None:
                self._latency.pop(threads, None)
            else:
                self._latency[threads] = cost

    def observe(self, rows: int, seconds: float, alone: tuple[int, float] | None = None) -> None:
        """One whole pass the engine ran: ``rows`` new rows over all its requests, its forward and
        verification in ``seconds``. ``alone``, for a pass of one request: (the positions cached
        before it, the request's step's seconds, its planning and landing included: what plain
        decoding's pass costs in this loop, the baseline's measure)."""
        self.times.observe(rows, seconds)
        if alone is not None:
            self.latency().observe_pass(rows, alone[0], alone[1])

    def pass_s(self, rows: int, cached: int) -> float:
        """Seconds of one target pass over ``rows`` new rows after ``cached`` ones (``pricer``)."""
        return self.pricer(cached)(rows)

    def pricer(self, cached: int) -> Callable[[int], float]:
        """Seconds of a pass by its rows after ``cached`` positions, the measured passes read once:
        ``times`` where they cover the rows; past their ends, the nearest point scaled by the priced
        curve's shape; with no measured point, the priced curve (``priced_s``)."""
        points = self.times.points()
        if not points:
            return lambda rows: self.priced_s(rows, cached)
        low, high = points[0], points[-1]
        low_s, high_s = self.priced_s(low[0], cached), self.priced_s(high[0], cached)

        def seconds(rows: int) -> float:
            if low[0] <= rows <= high[0]:
                return interpolate(points, rows)
            (at, measured), priced = (low, low_s) if rows < low[0] else (high, high_s)
            return measured * self.priced_s(rows, cached) / priced

        return seconds

    def priced_s(self, rows: int, cached: int) -> float:
        """A pass priced from the latency curve: a prefill's from ``MIN_PREFILL_SAMPLE`` rows, else
        a one-row pass times the verify curve's V(rows)."""
        latency = self.latency()
        if rows >= MIN_PREFILL_SAMPLE:
            return latency.prefill_s(rows, cached)
        return latency.decode_s(cached) * self.verify.verify(rows)

    def rows_within(self, factor: float, cached: int, most: int = 1024) -> int:
        """The most rows (a power of two, up to ``most``) one pass after ``cached`` positions can feed
        for at most ``factor`` times a one-row pass: where passes turn from reading the weights to
        computing, the budget a scheduler spends on its calls' drafts (``agentspec.scheduler``)."""
        limit = factor * self.pass_s(1, cached)
        rows = 1
        while rows < most and self.pass_s(2 * rows, cached) <= limit:
            rows *= 2
        return rows


def cost_model(pair: CostOwner) -> CostModel:
    """The pair's latency CostModel for the current thread count: a lookup, never a model pass."""
    return pair.cost.latency()


def set_cost_model(pair: CostOwner, cost: CostModel | None) -> None:
    """Install (or, with None, forget) the pair's latency CostModel for the current thread count."""
    pair.cost.install(cost)


def baseline_seconds(cost: CostModel, stats: DecodeStats) -> float:
    """Estimated time of the same call with plain decoding and no prefix cache (see the module doc)."""
    prompt = stats.prompt_tokens
    passes = max(0, stats.output_tokens - 1)  # the first output token comes with the prefill
    return cost.prefill_s(prompt) + cost.decode_sum_s(prompt, passes)


# -- calibration: an explicit call, never made by tracing ----------------------------------------------


def _fit_prefill(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """Least squares p0 + p1 n + p2 n^2 through (n, seconds), every coefficient >= 0: linear when the
    square comes out < 0, through the origin when the fixed cost does (noise: no pass costs < 0)."""
    ns = torch.tensor([float(n) for n, _ in points], dtype=torch.float64)
    ts = torch.tensor([t for _, t in points], dtype=torch.float64)
    if len(points) >= 3:
        a = torch.stack([torch.ones_like(ns), ns, ns * ns], dim=1)
        p0, p1, p2 = torch.linalg.lstsq(a, ts[:, None]).solution[:, 0].tolist()
        if min(p0, p1, p2) >= 0:
            return p0, p1, p2
    a = torch.stack([torch.ones_like(ns), ns], dim=1)
    p0, p1 = torch.linalg.lstsq(a, ts[:, None]).solution[:, 0].tolist()
    if p0 < 0:
        p0, p1 = 0.0, float((ns * ts).sum() / (ns * ns).sum())
    return p0, max(p1, 0.0), 0.0


def _timed_pass(state: ModelState, ids: list[int]) -> float:
    t0 = time.perf_counter()
    logits = state.forward(ids, keep=1)
    float(logits[0, 0])  # waits for the device
    return time.perf_counter() - t0


def calibrate(pair: CostOwner, sizes: tuple[int, ...] = CALIBRATION_SIZES) -> CostModel:
    """Time the target now, fit a ``CostModel`` and install it on the pair (holds the pair's lock).

    One pass from scratch over each prompt size, then one-token passes after each of them, taken in
    turn (round-robin, ``DECODE_PASSES`` rounds) so that a change in the machine's load hits every
    context alike instead of bending the fitted slope; the median per context is fitted.
    """
    room = pair.max_context - DECODE_PASSES - 1
    sizes = tuple(sorted({max(2, min(n, room)) for n in sizes}))
    vocab = pair.target.config.vocab_size
    ids = [(i * 7919 + 11) % vocab for i in range(max(sizes) + DECODE_PASSES + 1)]  # any ids will do
    prefill: list[tuple[int, float]] = []
    states: list[ModelState] = []
    with pair.lock:
        _timed_pass(ModelState(pair.target_forward), ids[:4])  # first-pass costs (allocation, kernels)
        for n in sizes:
            states.append(ModelState(pair.target_forward))
            prefill.append((n, _timed_pass(states[-1], ids[:n])))
        times: list[list[float]] = [[] for _ in sizes]
        for j in range(DECODE_PASSES):
            for n, state, row in zip(sizes, states, times):
                row.append(_timed_pass(state, [ids[n + j]]))
    p0, p1, p2 = _fit_prefill(prefill)
    contexts = torch.tensor([n + DECODE_PASSES / 2 for n in sizes], dtype=torch.float64)
    medians = torch.tensor([statistics.median(row) for row in times], dtype=torch.float64)
    if len(sizes) > 1:
        a = torch.stack([torch.ones_like(contexts), contexts], dim=1)
        d0, d1 = torch.linalg.lstsq(a, medians[:, None]).solution[:, 0].tolist()
    else:
        d0, d1 = float(medians[0]), 0.0
    if d1 < 0 or d0 < 0:  # noise: a longer context is not cheaper, and no pass costs < 0
        d0, d1 = float(medians.mean()), 0.0
    fitted = CostModel(p0, p1, p2, d0, d1)
    pair.cost.install(fitted)
    return fitted
