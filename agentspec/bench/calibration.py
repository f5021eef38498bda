"""How well drafts' survival estimates predict their verification: expected calibration error (ECE)
and Brier score, per draft source and per draft position.

A draft token's estimate ``a_j`` (``Step.acceptance``) is the chance it is accepted given that the
tokens before it were. So token j is judged only where every token before it was accepted: a pass
that accepted n of its d draft tokens gives outcome 1 for j < n, 0 for j = n (where n < d), and
no outcome after. The estimates are made before their pass is verified (the calibrations learn
from passes already verified), so every outcome is held out from the estimate it scores.

The Brier score is compared with that of predicting each group's base rate (its share of accepted
tokens, the best constant): an estimate that knows something beats it. ECE is over ``BINS`` equal
bins of the estimate, weighted by their counts. A few hundred outcomes leave ECE well above 0 even
for perfect estimates (a bin of 50 at 0.8 is off by 0.045 on average), so each score carries
``ece_noise``: the mean ECE of outcomes drawn from the estimates themselves (``NOISE_DRAWS``
seeded draws), the ECE that perfect estimates would show on this many outcomes, and ``ece_p``: the
share of those draws with an ECE at least the one observed (a small p: miscalibrated beyond noise).
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

BINS = 10
NOISE_DRAWS = 200
POSITIONS = 8  # positions reported one by one; later ones together ("8+")


def outcomes(steps: Iterable[Any]) -> list[tuple[str, int, float, bool]]:
    """(source, position, estimate, accepted) for every judged draft token of ``steps`` (``Step``s)
    whose draft carried estimates."""
    out = []
    for step in steps:
        if step.acceptance is None or not step.drafted:
            continue
        a = step.acceptance
        estimates = a.tolist() if hasattr(a, "tolist") else list(a)
        for j, a in enumerate(estimates[: step.accepted + 1]):
            out.append((step.source or "none", j, float(a), j < step.accepted))
    return out


def replay(log: Iterable[Any], calibration: Any, source: str) -> list[tuple[str, int, float, bool]]:
    """``outcomes``' records for recorded evidence replayed through ``calibration`` (a ``Calibration``):
    ``log`` holds [confidences, accepted, groups] per verified draft, in order; each draft's
    estimates are read before its verification is learnt, as in a run."""
    out = []
    for confidences, accepted, groups in log:
        groups = groups or [0] * len(confidences)
        estimates = [calibration(c, g) for c, g in zip(confidences, groups)]
        out += [(source, j, a, j < accepted) for j, a in enumerate(estimates[: accepted + 1])]
        calibration.observe(confidences, accepted, groups)
    return out


def scores(pairs: list[tuple[float, bool]]) -> dict[str, Any]:
    """Count, base rate, mean estimate, Brier score, the base rate's Brier score, ECE and its noise
    floor of (estimate, accepted) pairs."""
    n = len(pairs)
    if not n:
        return {"n": 0}
    rate = sum(y for _, y in pairs) / n
    brier = sum((p - y) ** 2 for p, y in pairs) / n
    observed, draw = ece(pairs), random.Random(0).random
    perfect = [ece([(p, draw() < p) for p, _ in pairs]) for _ in range(NOISE_DRAWS)]
    return {
        "n": n,
        "base_rate": round(rate, 4),
        "mean_estimate": round(sum(p for p, _ in pairs) / n, 4),
        "brier": round(brier, 4),
        "base_rate_brier": round(rate * (1 - rate), 4),
        "ece": round(observed, 4),
        "ece_noise": round(sum(perfect) / NOISE_DRAWS, 4),
        "ece_p": round(sum(e >= observed for e in perfect) / NOISE_DRAWS, 3),
    }


def ece(pairs: list[tuple[float, bool]]) -> float:
    """Expected calibration error of (estimate, outcome) pairs over ``BINS`` bins of the estimate."""
    bins: dict[int, list[float]] = {}
    for p, y in pairs:
        b = bins.setdefault(min(BINS - 1, int(p * BINS)), [0.0, 0.0])
        b[0], b[1] = b[0] + p, b[1] + y
    return sum(abs(est - hit) for est, hit in bins.values()) / len(pairs)


def report(records: list[tuple[str, int, float, bool]]) -> dict[str, Any]:
    """Per source: its scores over every position, and per position (``POSITIONS`` and later together)."""
    out: dict[str, Any] = {}
    for source in sorted({r[0] for r in records}):
        mine = [r for r in records if r[0] == source]
        by_position: dict[str, Any] = {}
        for j in range(POSITIONS + 1):
            at = [(a, y) for _, pos, a, y in mine if (pos == j if j < POSITIONS else pos >= j)]
            if at:
                by_position[str(j) if j < POSITIONS else f"{j}+"] = scores(at)
        out[source] = {**scores([(a, y) for _, _, a, y in mine]), "by_position": by_position}
    return out
