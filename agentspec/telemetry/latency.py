"""Latency saved: the estimated time of the same call with plain decoding and no cache, minus the measured.

The baseline a call is compared with is what ``speculative=False, prefix_cache=False`` would do with
the same prompt and the same output: one target pass over all ``P`` prompt tokens (giving the first
output token), then one single-token pass per further output token, after ``P``, ``P + 1``, ...
cached tokens. Its cost comes from a ``CostModel`` of the target on this machine:

- ``prefill_s(n) = p0 + p1 n + p2 n^2``: a pass over ``n`` tokens from an empty cache (the squared
  term is attention); after ``c`` cached tokens the new ones also attend to those:
  ``p0 + p1 n + p2 (n^2 + 2 n c)``;
- ``decode_s(c) = d0 + d1 c``: a one-token pass after ``c`` cached tokens.

Telemetry observes and never runs the model: a pair's cost model (``ModelPair.latency``, one per
torch thread count) starts from a prior for its device kind, a curve whose shape is plausible and
whose size is a guess, and learns this target on this machine from the passes the decoding loop
timed anyway (``Step.fed``, ``Step.cached``, ``Step.seconds``). Two scale factors follow them:
one-token passes (no draft: exactly a baseline decode pass) move ``decode_scale``; passes over 16
tokens or more (a prompt's uncached part, with any drafts on top) move ``prefill_scale``. Verify
passes over k+1 < 16 tokens move nothing: besides costing more than a one-token pass (the one-token
pass has a faster kernel), they carry per-pass work a plain pass does not (drafting, k+1 rows of
verification and grammar masks), which pushed estimates high when they were tried. On a prior the
first pass a term sees sets its scale (the prior's size means nothing), later ones average in;
until a term has seen a pass it borrows the other term's scale (one model on one machine: both are
off by a similar factor), and the span says ``agentspec.latency.cost_source = "prior"``; once both
have, ``"observed"``. A call is refreshed before its estimate is made, so a call that is itself plain
decoding without cache estimates a saving near zero.

``calibrate`` is the explicit alternative (``agentspec calibrate`` on the command line): it times
the target up front, a pass from scratch over 3 prompt sizes and 4 single-token passes after each,
and installs the fitted curve (``cost_source = "calibrated"``, as for any curve a caller installs
with ``set_cost_model``); traced calls then move its scales as above, each pass by a fixed weight.

``latency_saved = baseline - measured``, where measured is the time spent inside the decoder for
this call (lock wait, cache restore and save, drafting, verification), not time the caller spent
between chunks. Tokens a grammar forced count as baseline passes like any other: plain decoding
has no jump-forward, so it spends a pass on each. Not modelled: tokens decoded past a stop string or
past a complete tool call (counted as output, though the baseline would stop at the string or the
call), and time lost waiting for the pair's lock (counted as measured: it lowers the estimate). The
benchmark ``benchmarks/bench_telemetry.py`` compares the summed estimate with a measured baseline
run of the same agent.

This is not the drafting schedule's ``agentspec.drafters.schedule.VerifyCost``: that one prices a
verify pass of k+1 tokens against one token to choose draft lengths (and keeps a frozen curve for
sampled calls, so a seed reproduces its output); this one prices plain decoding's passes in seconds.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from agentspec.kv import ModelState
from agentspec.stats import DecodeStats

if TYPE_CHECKING:  # models.py imports this module (ModelPair.latency): annotations only
    from agentspec.decode import Step
    from agentspec.models import ModelPair

CALIBRATION_SIZES = (32, 256, 512)  # prompt sizes of the from-scratch passes (capped to the context)
DECODE_PASSES = 4  # one-token passes timed after each of them (median per context)
MIN_PREFILL_SAMPLE = 16  # passes over fewer tokens are mostly fixed cost or verify passes: not used
DECODE_RATE = 0.1  # EWMA weight of one plain decode pass
PREFILL_RATE = 0.3  # EWMA weight of one prefill pass (rarer)
SCALE_RANGE = (0.2, 5.0)  # one pass's ratio outside this (of the scale so far) is clipped: a pause, a burst

# the curves a pair starts from, by device type; an unlisted accelerator uses "cuda"'s
PRIORS: dict[str, dict[str, float]] = {
    # the embedded model's calibration on one CPU thread (benchmarks/results/telemetry.json)
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
        return cls(**PRIORS.get(device_type, PRIORS["cuda"]), prior=True)

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

    def refresh(self, steps: Iterable[Step]) -> None:
        """Move the scales toward what a call's baseline-like passes measured (its Steps' own times)."""
        with self._lock:
            for s in steps:
                if not s.target_pass:  # the grammar alone added these tokens
                    continue
                if s.fed == 1 and s.cached > 0:  # no draft: exactly a baseline decode pass
                    predicted = max(0.0, self.d0 + self.d1 * s.cached)
                    if predicted > 0:
                        ratio = s.seconds / predicted
                        self.decode_scale = self._moved(
                            self.decode_scale, self.decode_passes, ratio, DECODE_RATE
                        )
                        self.decode_passes += 1
                elif s.fed >= MIN_PREFILL_SAMPLE:  # a prefill (drafts or not): a pass over n tokens
                    predicted = max(0.0, self._prefill_fit(s.fed, s.cached))
                    if predicted > 0:
                        ratio = s.seconds / predicted
                        self.prefill_scale = self._moved(
                            self.prefill_scale, self.prefill_passes, ratio, PREFILL_RATE
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


class LatencyModel:
    """A pair's ``CostModel`` per torch thread count (a CPU pass's time depends on it): ``ModelPair.latency``.

    Starts from the device type's prior; traced calls refresh it from their passes; ``calibrate``
    or ``set_cost_model`` replace it.
    """

    def __init__(self) -> None:
        self._models: dict[int, CostModel] = {}
        self._lock = threading.Lock()

    def get(self, device_type: str) -> CostModel:
        """The model for the current thread count (the device type's prior when there is none yet)."""
        threads = torch.get_num_threads()
        with self._lock:
            found = self._models.get(threads)
            if found is None:
                found = self._models[threads] = CostModel.for_device(device_type)
            return found

    def set(self, cost: CostModel | None) -> None:
        """Install (or, with None, forget: back to the prior) the model for the current thread count."""
        threads = torch.get_num_threads()
        with self._lock:
            if cost is None:
                self._models.pop(threads, None)
            else:
                self._models[threads] = cost


def cost_model(pair: ModelPair) -> CostModel:
    """The pair's CostModel for the current thread count: a lookup, never a model pass."""
    return pair.latency.get(pair.device.type)


def set_cost_model(pair: ModelPair, cost: CostModel | None) -> None:
    """Install (or, with None, forget) the pair's CostModel for the current thread count."""
    pair.latency.set(cost)


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


def calibrate(pair: ModelPair, sizes: tuple[int, ...] = CALIBRATION_SIZES) -> CostModel:
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
        _timed_pass(ModelState(pair.target), ids[:4])  # first-pass costs (allocation, kernels)
        for n in sizes:
            states.append(ModelState(pair.target))
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
    set_cost_model(pair, fitted)
    return fitted
