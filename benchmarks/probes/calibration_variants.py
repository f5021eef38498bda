"""Calibrator variants replayed on a traces run's recorded evidence (its ``observations``), scored as
the run's estimates are (``agentspec.bench.calibration``): ECE and Brier per configuration, source
and draft position, so that designs are compared on the same evidence without running a model.

    python benchmarks/probes/calibration_variants.py benchmarks/results/traces_calibration_rounds.json

Variants: the production ``Calibration`` (histogram cells per confidence bin, pooled over positions,
pulled toward a prior), its weight, decay and bin count changed, pooling by position instead of by
kind, a logistic fit per group on logit(prior) (Platt scaling), a logistic fit as the pooled level's
prior, and a second stage per position over the first stage's estimate (``recal``; production's
``recalibrate``), alone or over the logistic fit. Writes calibration_variants.json beside the run.
"""

from __future__ import annotations

import functools
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from agentspec.bench import calibration
from agentspec.drafters.prompt_lookup import lookup_prior
from agentspec.drafters.schedule import POSITIONS, Calibration
from agentspec.drafters.suffix import suffix_prior

PRIORS = {"suffix": suffix_prior, "lookup": lookup_prior, "model": lambda c, g: c}


def logit(p: float) -> float:
    p = min(max(p, 1e-4), 1 - 1e-4)
    return math.log(p / (1 - p))


def fit(points: list[tuple[float, float, float]], strength: float, iters: int = 8) -> tuple[float, float]:
    """Logistic a + b x on (x, hits, trials), Newton steps, an L2 pull of ``strength`` toward (0, 1)."""
    a, b = 0.0, 1.0
    for _ in range(iters):
        ga, gb = -strength * a, -strength * (b - 1)
        haa, hab, hbb = strength, 0.0, strength
        for x, h, t in points:
            p = 1 / (1 + math.exp(-(a + b * x)))
            r, w = h - t * p, t * p * (1 - p)
            ga, gb, haa, hab, hbb = ga + r, gb + r * x, haa + w, hab + w * x, hbb + w * x * x
        det = haa * hbb - hab * hab
        a, b = a + (hbb * ga - hab * gb) / det, b + (haa * gb - hab * ga) / det
    return a, b


@dataclass
class ByPosition(Calibration):
    """Cells pooled over kinds at each position, instead of over positions of each kind."""

    def _first(self, confidence, group):
        b = self._bin(confidence)
        hits, trials = self.pooled.get((group % POSITIONS, b), (0.0, 0.0))
        base = (hits + self.weight * self.prior(confidence, group)) / (trials + self.weight)
        hits, trials = self.cells.get((group, b), (0.0, 0.0))
        return (hits + self.weight * base) / (trials + self.weight)

    def observe(self, confidences, n_accepted, groups=None):
        for i, c in enumerate(confidences[: n_accepted + 1]):
            group, b, hit = groups[i] if groups else 0, self._bin(c), float(i < n_accepted)
            cell = self.cells.setdefault((group, b), [0.0, 0.0])
            for counts in (cell, self.pooled.setdefault((group % POSITIONS, b), [0.0, 0.0]), self.total):
                counts[0], counts[1] = counts[0] * self.decay + hit, counts[1] * self.decay + 1.0


@dataclass
class Platt(Calibration):
    """A logistic curve in logit(prior) per group, fit on the group's decayed counts per bin."""

    strength: float = 4.0
    fits: dict = field(default_factory=dict)

    def _first(self, confidence, group):
        if group not in self.fits:
            points = [(logit(self.prior((b + 0.5) / self.bins, group)), h, t)
                      for (g, b), (h, t) in self.cells.items() if g == group]  # fmt: skip
            self.fits[group] = fit(points, self.strength)
        a, b = self.fits[group]
        return 1 / (1 + math.exp(-(a + b * logit(self.prior(confidence, group)))))

    def observe(self, confidences, n_accepted, groups=None):
        super().observe(confidences, n_accepted, groups)
        self.fits.clear()


@dataclass
class FittedPrior(Calibration):
    """Production's cells, the pooled level pulled toward a logistic fit over the kind's bins."""

    strength: float = 4.0
    fits: dict = field(default_factory=dict)

    def _first(self, confidence, group):
        kind, b = group // POSITIONS, self._bin(confidence)
        if kind not in self.fits:
            points = [(logit(self.prior((j + 0.5) / self.bins, kind * POSITIONS)), h, t)
                      for (k, j), (h, t) in self.pooled.items() if k == kind]  # fmt: skip
            self.fits[kind] = fit(points, self.strength)
        a, slope = self.fits[kind]
        curve = 1 / (1 + math.exp(-(a + slope * logit(self.prior(confidence, group)))))
        hits, trials = self.pooled.get((kind, b), (0.0, 0.0))
        base = (hits + self.weight * curve) / (trials + self.weight)
        hits, trials = self.cells.get((group, b), (0.0, 0.0))
        return (hits + self.weight * base) / (trials + self.weight)

    def observe(self, confidences, n_accepted, groups=None):
        super().observe(confidences, n_accepted, groups)
        self.fits.clear()


VARIANTS = {
    "production": lambda p: Calibration(p),
    "weight_8": lambda p: Calibration(p, weight=8),
    "weight_16": lambda p: Calibration(p, weight=16),
    "decay_0.999": lambda p: Calibration(p, decay=0.999),
    "no_decay": lambda p: Calibration(p, decay=1.0),
    **{f"bins_{n}": functools.partial(lambda p, n: Calibration(p, bins=n), n=n) for n in (3, 4, 5, 6, 8)},
    "pooled_by_position": lambda p: ByPosition(p),
    "platt": lambda p: Platt(p),
    "platt_16": lambda p: Platt(p, strength=16),
    "fitted_prior": lambda p: FittedPrior(p),
    "recal_16": lambda p: Calibration(p, recalibrate=16),
    "recal_32": lambda p: Calibration(p, recalibrate=32),
    "platt_recal_16": lambda p: Platt(p, recalibrate=16),
}


def main(path: str) -> None:
    run, out = json.loads(Path(path).read_text()), {}
    for config, kinds in run["observations"].items():
        for kind, log in kinds.items():
            for name, make in VARIANTS.items():
                report = calibration.report(calibration.replay(log, make(PRIORS[kind]), kind))[kind]
                out.setdefault(f"{config}:{kind}", {})[name] = report
                cells = [f"{j}: {s['ece']:.3f}" for j, s in report["by_position"].items() if j in "0123"]
                ece, noise = report["ece"], report["ece_noise"]
                print(f"{config}:{kind:7s} {name:18s} ECE {ece:.3f} (noise {noise:.3f})"
                      f" Brier {report['brier']:.4f}  by position {', '.join(cells)}")  # fmt: skip
    target = Path(path).with_name("calibration_variants.json")
    result = {"evidence": path, "environment": run["environment"], "variants": out}
    target.write_text(json.dumps(result, indent=1))
    print(f"wrote {target}")


if __name__ == "__main__":
    main(sys.argv[1])
