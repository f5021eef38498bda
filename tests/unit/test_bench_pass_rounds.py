"""``benchmarks.forward_pass``' interleaved rounds (``python -m benchmarks pass``): each side goes
first in turn, and each round's ratios are agentspec's step over each vLLM engine's."""

from __future__ import annotations

import pytest

from benchmarks import forward_pass as bench_pass


def test_two_sides_alternate_with_vllm_first_in_round_zero():
    seen: list[list[str]] = []

    def side(name):
        return lambda r: seen[-1].append(name) or (float(r), 0.0)

    sides = {"agentspec": side("agentspec"), "vllm": side("vllm")}
    for r in range(4):
        seen.append([])
        assert list(bench_pass._round(sides, r)) == seen[-1]
    assert seen == [["vllm", "agentspec"], ["agentspec", "vllm"]] * 2


def test_three_sides_each_go_first_once_in_three_rounds():
    sides = {name: (lambda r: (1.0, 0.0)) for name in ("agentspec", "vllm", "vllm_eager")}
    firsts = [next(iter(bench_pass._round(sides, r))) for r in range(3)]
    assert sorted(firsts) == sorted(sides)


def test_ratios_are_agentspecs_step_over_each_engines():
    out = bench_pass._ratios({"agentspec": 90.0, "vllm": 60.0, "vllm_eager": 120.0})
    assert out["ratio"] == pytest.approx(1.5)
    assert out["ratio_eager"] == pytest.approx(0.75)
    assert out["vllm_eager_step_ms"] == 120.0


def test_the_eager_engine_only_on_request():
    assert bench_pass.vllm_sides(bench_pass.parse([])) == ["vllm"]
    assert bench_pass.vllm_sides(bench_pass.parse(["--vllm-eager"])) == ["vllm", "vllm_eager"]
