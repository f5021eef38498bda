"""The schedule's priors per device kind, draft steps timed on the device's clock without waiting, and
the pair's passes by their rows."""

import time

import pytest
import torch

from agentspec.cost import (
    CUDA_DRAFT_STEP,
    CUDA_VERIFY_COST,
    DEFAULT_DRAFT_STEP,
    DEFAULT_VERIFY_COST,
    PairCost,
    PassTimes,
    VerifyCost,
    rows_bucket,
)
from agentspec.drafters.schedule import DeviceClock, DraftStepTimer


def test_priors_follow_the_device_kind():
    cpu, cuda = VerifyCost.for_device("cpu"), VerifyCost.for_device(torch.device("cuda", 1))
    assert (cpu.prior, cpu.draft_step_prior) == (DEFAULT_VERIFY_COST, DEFAULT_DRAFT_STEP)
    assert (cuda.prior, cuda.draft_step_prior) == (CUDA_VERIFY_COST, CUDA_DRAFT_STEP)
    assert VerifyCost.for_device("meta").prior == DEFAULT_VERIFY_COST  # a kind without priors: the CPU's
    assert cuda.verify(5) == 1.0 and cpu.verify(2) > 1.5
    # a sampled call's frozen copy keeps its device's prior, learning nothing
    frozen = cuda.frozen()
    frozen.observe_draft(1.0)
    assert frozen.curve() == CUDA_VERIFY_COST and frozen.draft_step == CUDA_DRAFT_STEP


def test_a_cpu_timer_hands_over_each_draft_step():
    cost, timer = VerifyCost(times=PassTimes()), DraftStepTimer("cpu")
    start = timer.clock.mark() - 1.0  # a draft step begun a second ago (a CPU mark is perf_counter's)
    timer.step(cost, start)
    assert len(cost.draft_times) == 1 and 1.0 <= cost.draft_times[0] <= time.perf_counter() - start


class _Queued(DeviceClock):
    """A clock whose intervals have not run until ``run()``: what CUDA events look like to the host."""

    def __init__(self):
        super().__init__("cpu")
        self.ran = False

    def seconds(self, start, end):
        return end - start if self.ran else None


def test_timings_wait_for_the_device_and_keep_their_order():
    cost, timer = VerifyCost(times=PassTimes()), DraftStepTimer()
    timer.clock = _Queued()
    first = timer.clock.mark()
    timer.step(cost, first)
    timer.step(cost, timer.clock.mark())
    assert not cost.draft_times  # nothing read before the device ran it
    timer.clock.ran = True
    third = timer.clock.mark()
    timer.step(cost, third)
    assert len(cost.draft_times) == 3 and cost.draft_times[0] >= cost.draft_times[2]  # in order


def test_a_pairs_verify_cost_starts_from_its_device_priors_and_is_shared_by_its_namespaces(target, tokenizer):
    from agentspec.cost import PairCost
    from agentspec.models import ModelPair

    assert PairCost(torch.device("cuda")).verify.prior == CUDA_VERIFY_COST
    pair = ModelPair(target, tokenizer)
    assert pair.cost.verify.prior == DEFAULT_VERIFY_COST  # the tiny target is on the CPU
    # what a pass costs is the pair's, not a tenant's: every namespace's memory prices with it
    assert pair.tenants.memory().cost is pair.cost.verify is pair.tenants.memory("tenant").cost


def test_a_pairs_pass_time_by_rows_is_measured_where_seen_and_shaped_by_its_prior_beyond():
    curve = PassTimes(min_samples=2)
    for seconds in (1.0, 3.0, 2.0):  # one slow pass among them: the median holds
        curve.observe(1, seconds / 100)
    curve.observe(8, 0.05)
    assert curve.points() == [(1, 0.02)]  # 8 rows seen once: not enough
    curve.observe(8, 0.04)
    assert curve.points() == [(1, 0.02), (8, 0.045)]
    curve.observe(4, 0.01)
    curve.observe(4, 0.01)  # cheaper than one row: noise, pooled with it by their passes (3 and 2)
    assert [n for n, _ in curve.points()] == [1, 4, 8]
    assert [t for _, t in curve.points()] == pytest.approx([0.016, 0.016, 0.045])
    assert rows_bucket(64) == 64 and rows_bucket(65) == 128 and rows_bucket(300) == 512

    cost = PairCost("cpu")
    priced = [cost.pass_s(n, 0) for n in (1, 4, 8)]
    assert priced == [cost.priced_s(n, 0) for n in (1, 4, 8)]  # nothing measured yet
    for _ in range(3):
        cost.observe(1, 0.01)
        cost.observe(4, 0.02)
    assert cost.pass_s(2, 0) == pytest.approx(0.01 + 0.01 / 3)  # between measured row counts
    assert cost.pass_s(8, 0) == pytest.approx(0.02 * priced[2] / priced[1])  # beyond: the prior's shape
    assert cost.verify.verify(4) == pytest.approx(2.0)  # the drafting schedule reads the same passes
    assert cost.latency().decode_passes == 0  # passes of several requests: no context to price by
    cost.observe(1, 0.01, alone=(100, 0.012))  # a request's pass of its own: its step's time
    assert cost.latency().decode_passes == 1 and cost.times.observed == 7
