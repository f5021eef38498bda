"""Latency saved: the estimated time of the same call with plain decoding and no cache, minus the measured.

The baseline a call is compared with is what ``speculative=False, prefix_cache=False`` would do with
the same prompt and the same output: one target pass over all ``P`` prompt tokens (giving the first
output token), then one single-token pass per further output token, after ``P``, ``P + 1``, ...
cached tokens. Its cost comes from a ``CostModel`` of the target on this machine:

- ``prefill_s(n) = p0 + p1 n + p2 n^2``: a pass over ``n`` tokens from an empty cache (the squared
  term is attention; on a 2-core CPU, SmolLM2-135M measured 0.28 s for 32 tokens, 1.14 s for 256,
  2.71 s for 512, 7.1 s for 1,024); after ``c`` cached tokens the new ones also attend to those:
  ``p0 + p1 n + p2 (n^2 + 2 n c)``;
- ``decode_s(c) = d0 + d1 c``: a one-token pass after ``c`` cached tokens (105 ms at 32, 130 ms at
  1,024 there).

``calibrate`` fits both on first use of a pair (once per target model and torch thread count): a
pass from scratch over 3 prompt sizes and 4 single-token passes after each, round-robin (about 6 s
for SmolLM2-135M on one CPU thread, milliseconds on a GPU). The machine's speed drifts
with its load, so every traced call then refreshes two scale factors from its own passes
(exponential moving averages of measured / predicted): one-token passes (no draft: exactly a
baseline decode pass) refresh ``decode_scale``; passes over 16 tokens or more (a prompt's uncached
part, with any drafts on top) refresh ``prefill_scale``. Verify passes over k+1 < 16 tokens refresh
nothing: besides costing more than a one-token pass (on that CPU 2 tokens cost 1.7x one token, the
one-token pass has a faster kernel), they carry per-pass work a plain pass does not (drafting, k+1
rows of verification and grammar masks); tried, they pushed one answer's estimate 18% high. A
speculative call that drafts on every pass therefore keeps the calibration's decode speed. A call
is refreshed from before its estimate is made, so a call that is itself plain decoding without
cache estimates a saving near zero.

``latency_saved = baseline - measured``, where measured is the time spent inside the decoder for
this call (lock wait, cache restore and save, drafting, verification), not time the caller spent
between chunks. Tokens a grammar forced count as baseline passes like any other: plain decoding
has no jump-forward, so it spends a pass on each. Not modelled: tokens decoded past a stop string or
past a complete tool call (counted as output, though the baseline would stop at the string or the
call), and time lost waiting for the pair's lock (counted as measured: it lowers the estimate). The
benchmark ``benchmarks/bench_telemetry.py`` compares the summed estimate with a measured baseline
run of the same agent.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from agentspec.kv import ModelState
from agentspec.models import ModelPair
from agentspec.stats import DecodeStats

CALIBRATION_SIZES = (32, 256, 512)  # prompt sizes of the from-scratch passes (capped to the context)
DECODE_PASSES = 4  # one-token passes timed after each of them (median per context)
MIN_PREFILL_SAMPLE = 16  # from-scratch passes shorter than this are mostly fixed cost: not used
DECODE_RATE = 0.1  # EWMA weight of one plain decode pass
PREFILL_RATE = 0.3  # EWMA weight of one from-scratch pass (rarer)
SCALE_RANGE = (0.2, 5.0)  # a single ratio outside this is clipped (a pause, a burst of load)


@dataclass(frozen=True)
class Pass:
    """One target forward pass of a call, as the telemetry saw it."""

    new_tokens: int  # tokens fed: the uncached prompt (first pass) or the pending token, plus drafts
    cached: int  # tokens already in the target's cache before the pass
    drafted: int  # draft tokens among the new ones
    seconds: float  # wall time of the pass (drafting included)


@dataclass(frozen=True)
class Observed:
    """What the telemetry saw of one Step (the fields of ``agentspec.decode.Step`` it needs)."""

    passed: bool  # a target pass ran (the call's verify_steps went up); False: grammar-forced tokens only
    prefill: int  # Step.prefill: uncached prompt tokens fed in this pass, the last prompt token excepted
    drafted: int  # draft tokens verified in this pass
    forced: int  # tokens a grammar appended without a model guess (fed with the next pass)
    tokens: int  # tokens this step added to the output
    seconds: float  # Step.seconds


def passes_of(stats: DecodeStats, steps: list[Observed]) -> list[Pass]:
    """The target passes of a call, from its Steps.

    The first pass feeds the uncached prompt (``prefill`` + the last prompt token); every later one
    feeds what the cache lacks: the token the last pass added, and any tokens a grammar forced
    since. Tokens forced in a step are fed by its pass, drafts come on top. The cache before a
    pass holds the prompt and the output so far, less those unfed tokens.
    """
    out: list[Pass] = []
    emitted = 0  # output tokens before the step
    unfed = 0  # of those, not yet in the target's cache
    first = True
    for s in steps:
        if s.passed:
            if first:
                new = s.prefill + 1 + s.forced + s.drafted
                cached = stats.prompt_tokens - s.prefill - 1
            else:
                new = unfed + s.forced + s.drafted
                cached = stats.prompt_tokens + emitted - unfed
            out.append(Pass(new, cached, s.drafted, s.seconds))
            first, unfed = False, 1  # the pass's own last token is fed by the next one
        else:
            unfed += s.tokens
        emitted += s.tokens
    return out


@dataclass
class CostModel:
    """Seconds of target forward passes on one pair, as fitted by ``calibrate``, scaled by refreshes."""

    p0: float  # prefill_s(n) = (p0 + p1 n + p2 n^2) * prefill_scale
    p1: float
    p2: float
    d0: float  # decode_s(c) = (d0 + d1 c) * decode_scale
    d1: float
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    refreshed_passes: int = 0  # passes that refreshed a scale so far
    _lock: threading.Lock = dataclasses.field(
        default_factory=threading.Lock, init=False, repr=False, compare=False
    )

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def prefill_s(self, n: int, cached: int = 0) -> float:
        """A pass over ``n`` tokens after ``cached`` ones (a prefill: n of 16 or more).

        The square counts attention pairs: from scratch n^2 (halved into p2), after c cached tokens
        the new tokens also attend to those, n^2 + 2nc: the increment prefill_s(c + n) - prefill_s(c).
        """
        return max(0.0, self._prefill_fit(n, cached)) * self.prefill_scale

    def _prefill_fit(self, n: int, cached: int) -> float:
        return self.p0 + self.p1 * n + self.p2 * (n * n + 2 * n * cached)

    def decode_s(self, cached: int) -> float:
        """A one-token pass after ``cached`` tokens."""
        return max(0.0, self.d0 + self.d1 * cached) * self.decode_scale

    def decode_sum_s(self, cached: int, passes: int) -> float:
        """``passes`` one-token passes after ``cached``, ``cached + 1``, ... tokens."""
        if passes <= 0:
            return 0.0
        contexts = passes * cached + passes * (passes - 1) / 2  # sum of the cache lengths
        return max(0.0, self.d0 * passes + self.d1 * contexts) * self.decode_scale

    def refresh(self, passes: list[Pass]) -> None:
        """Move the scales toward what this call's baseline-like passes measured."""
        lo, hi = SCALE_RANGE
        with self._lock:
            for p in passes:
                if p.new_tokens == 1 and p.cached > 0:  # no draft: exactly a baseline decode pass
                    predicted = max(0.0, self.d0 + self.d1 * p.cached)
                    rate, attr = DECODE_RATE, "decode_scale"
                elif p.new_tokens < MIN_PREFILL_SAMPLE:  # a verify pass over k+1 tokens, or a short one
                    continue
                else:  # a prefill (drafts or not): a pass over n tokens
                    predicted = max(0.0, self._prefill_fit(p.new_tokens, p.cached))
                    rate, attr = PREFILL_RATE, "prefill_scale"
                if predicted <= 0:
                    continue
                ratio = min(hi, max(lo, p.seconds / predicted))
                setattr(self, attr, getattr(self, attr) + rate * (ratio - getattr(self, attr)))
                self.refreshed_passes += 1


def baseline_seconds(cost: CostModel, stats: DecodeStats) -> float:
    """Estimated time of the same call with plain decoding and no prefix cache (see the module doc)."""
    prompt = stats.prompt_tokens
    passes = max(0, stats.output_tokens - 1)  # the first output token comes with the prefill
    return cost.prefill_s(prompt) + cost.decode_sum_s(prompt, passes)


# -- calibration ------------------------------------------------------------------------------------


def _fit_prefill(points: list[tuple[int, float]]) -> tuple[float, float, float]:
    """Least squares p0 + p1 n + p2 n^2 through (n, seconds); linear when the square comes out < 0."""
    ns = torch.tensor([float(n) for n, _ in points], dtype=torch.float64)
    ts = torch.tensor([t for _, t in points], dtype=torch.float64)
    if len(points) >= 3:
        a = torch.stack([torch.ones_like(ns), ns, ns * ns], dim=1)
        p0, p1, p2 = torch.linalg.lstsq(a, ts[:, None]).solution[:, 0].tolist()
        if p2 >= 0 and p1 >= 0:
            return p0, p1, p2
    a = torch.stack([torch.ones_like(ns), ns], dim=1)
    p0, p1 = torch.linalg.lstsq(a, ts[:, None]).solution[:, 0].tolist()
    return p0, max(p1, 0.0), 0.0


def _timed_pass(state: ModelState, ids: list[int]) -> float:
    t0 = time.perf_counter()
    logits = state.forward(ids, keep=1)
    float(logits[0, 0])  # waits for the device
    return time.perf_counter() - t0


def calibrate(pair: ModelPair, sizes: tuple[int, ...] = CALIBRATION_SIZES) -> CostModel:
    """Time the target on this machine and fit a fresh ``CostModel`` (holds the pair's lock).

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
    if d1 < 0:  # noise: attention over a longer context does not get cheaper
        d0, d1 = float(medians.mean()), 0.0
    return CostModel(p0, p1, p2, d0, d1)


# one CostModel per target model (weights, dtype, device) and torch thread count, for the process
_MODELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_MODELS_LOCK = threading.Lock()


def cost_model(pair: ModelPair, create: bool = True) -> CostModel | None:
    """The pair's CostModel, calibrated now if there is none yet (None when ``create`` is False)."""
    threads = torch.get_num_threads()
    with _MODELS_LOCK:
        found = _MODELS.get(pair.target, {}).get(threads)
    if found is not None or not create:
        return found
    fresh = calibrate(pair)
    with _MODELS_LOCK:
        return _MODELS.setdefault(pair.target, {}).setdefault(threads, fresh)


def set_cost_model(pair: ModelPair, cost: CostModel | None) -> None:
    """Install (or, with None, forget) the pair's CostModel for the current thread count."""
    threads = torch.get_num_threads()
    with _MODELS_LOCK:
        models = _MODELS.setdefault(pair.target, {})
        if cost is None:
            models.pop(threads, None)
        else:
            models[threads] = cost
