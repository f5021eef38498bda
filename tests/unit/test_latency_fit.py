"""The calibration's prefill fit keeps every coefficient >= 0, whatever noise the timed passes carry."""

from __future__ import annotations

import pytest

from agentspec.cost import CostModel, _fit_prefill


@pytest.mark.parametrize(
    "points",
    [
        [(8, 0.0001), (32, 0.003), (64, 0.005)],  # a busy machine: the line's intercept comes out < 0
        [(8, 0.002), (32, 0.001), (64, 0.008)],  # the square's slope < 0, the line's intercept < 0
        [(16, 0.004), (128, 0.02), (256, 0.05)],  # a clean quadratic: kept as fitted
    ],
)
def test_the_prefill_fit_never_goes_negative(points):
    p0, p1, p2 = _fit_prefill(points)
    assert min(p0, p1, p2) >= 0, (p0, p1, p2)
    cost = CostModel(p0, p1, p2, d0=0.001, d1=0.0)
    assert 0 < cost.prefill_s(8) <= cost.prefill_s(64), cost


def test_a_fit_through_the_origin_matches_the_points_scale():
    points = [(8, 0.0001), (32, 0.003), (64, 0.005)]
    p0, p1, _ = _fit_prefill(points)
    assert p0 == 0 and 0.00005 < p1 < 0.0001, p1  # about 5 ms / 64 tokens


def test_a_pass_is_priced_by_its_rows():
    """PairCost.pass_s: one row is a decode pass, a few rows that times the verify curve's V(rows),
    MIN_PREFILL_SAMPLE rows or more the prefill curve after the cached ones."""
    from agentspec.cost import MIN_PREFILL_SAMPLE, PairCost, VerifyCost

    cost = PairCost("cpu")
    cost.verify = VerifyCost(prior=((1, 1.0), (4, 2.0), (16, 3.0)))
    curve = CostModel(p0=0.1, p1=0.01, p2=1e-5, d0=0.05, d1=0.001)
    cost.install(curve)
    assert cost.pass_s(1, 100) == pytest.approx(curve.decode_s(100))
    assert cost.pass_s(4, 100) == pytest.approx(2.0 * curve.decode_s(100))
    rows = MIN_PREFILL_SAMPLE + 4
    assert cost.pass_s(rows, 100) == pytest.approx(curve.prefill_s(rows, 100))
