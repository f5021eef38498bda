"""Survival estimates reach the caller with each Step, and their calibration is scored as vLLM and
DSpark read acceptance: token j is judged only where every token before it was accepted."""

from __future__ import annotations

import random

import pytest
import torch

import agentspec
from agentspec.bench import calibration
from agentspec.decode import Step
from agentspec.drafters import DraftMemory
from agentspec.drafters.schedule import Calibration


def step(estimates: list[float] | None, accepted: int, source: str = "suffix") -> Step:
    drafted = len(estimates) if estimates is not None else 3
    acceptance = torch.tensor(estimates) if estimates is not None else None  # a head's form
    return Step([1], "", drafted, accepted, 0, 0.0, source=source, acceptance=acceptance)


def test_a_pass_judges_its_draft_up_to_the_first_rejection():
    records = calibration.outcomes([step([0.9, 0.8, 0.7, 0.6], 2), step([0.5, 0.5], 2), step(None, 1)])
    assert [(pos, y) for _, pos, _, y in records] == [(0, True), (1, True), (2, False), (0, True), (1, True)]
    assert records[2][2] == pytest.approx(0.7)


def test_scores_of_estimates_that_know_and_of_the_base_rate():
    knowing = [(0.9, True)] * 9 + [(0.9, False)] + [(0.1, False)] * 9 + [(0.1, True)]
    s = calibration.scores(knowing)
    assert s["ece"] == pytest.approx(0.0, abs=1e-9)
    assert s["base_rate"] == 0.5 and s["base_rate_brier"] == 0.25
    assert s["brier"] == pytest.approx(0.09) and s["brier"] < s["base_rate_brier"]
    overconfident = calibration.scores([(0.9, True)] * 5 + [(0.9, False)] * 5)
    assert overconfident["ece"] == pytest.approx(0.4)
    assert overconfident["brier"] > overconfident["base_rate_brier"]


def test_ece_noise_is_what_perfect_estimates_show_on_as_many_outcomes():
    rnd = random.Random(1)
    few, many = ([(p, rnd.random() < p) for p in (rnd.random() for _ in range(n))] for n in (60, 6000))
    f, m = calibration.scores(few), calibration.scores(many)
    assert m["ece_noise"] < 0.03 < f["ece_noise"]
    assert m["ece"] < 0.03 < f["ece"]  # the same outcomes' ECE is noise alone too
    assert f["ece_p"] > 0.05 and m["ece_p"] > 0.05
    wrong = calibration.scores([(min(1.0, p + 0.15), y) for p, y in many])
    assert wrong["ece_p"] == 0.0 and wrong["ece"] > 0.1
    assert calibration.scores(few) == f  # seeded: the same pairs score the same


def test_replay_reads_each_drafts_estimates_before_learning_from_it():
    log = [[[0.9, 0.9], 0, [0, 1]], [[0.9, 0.9], 2, [0, 1]]]  # a miss at once, then both accepted
    records = calibration.replay(log, Calibration(), "model")
    fresh = Calibration()
    assert records[0] == ("model", 0, pytest.approx(fresh(0.9, 0)), False)
    fresh.observe([0.9, 0.9], 0, [0, 1])
    assert fresh(0.9, 0) < 0.9
    assert records[1:] == [("model", 0, pytest.approx(fresh(0.9, 0)), True),
                           ("model", 1, pytest.approx(fresh(0.9, 1)), True)]  # fmt: skip


def test_the_traces_suite_logs_the_calibrations_the_library_makes():
    """Its evidence is learnt by calibrations set up as a pair's memory sets them (a draft model's
    second stage included), so a run measures the library's estimates."""
    from dataclasses import fields

    from benchmarks.traces import KINDS, logged_memory

    logged, made = logged_memory(), DraftMemory()
    for kind in KINDS:
        a, b = getattr(logged, f"{kind}_calibration"), getattr(made, f"{kind}_calibration")
        assert [getattr(a, f.name) for f in fields(b)] == [getattr(b, f.name) for f in fields(b)]
    logged.model_calibration.observe([0.9, 0.8], 1, [0, 1])
    assert logged.model_calibration.log == [[[0.9, 0.8], 1, [0, 1]]] and logged.model_calibration.second


def test_report_splits_sources_and_positions():
    records = [("suffix", 0, 0.8, True), ("suffix", 9, 0.5, False), ("model", 1, 0.4, False)]
    r = calibration.report(records)
    assert set(r) == {"suffix", "model"}
    assert r["suffix"]["n"] == 2 and set(r["suffix"]["by_position"]) == {"0", "8+"}
    assert r["model"]["by_position"]["1"]["n"] == 1


def test_auto_steps_carry_their_source_and_estimates(target, tokenizer, greedy_cases):
    """``drafter="auto"`` on a pair without a draft model drafts from suffix trees: each Step that
    verified a draft names its source, and a suffix draft carries an estimate per verified token,
    within [0, 1]; the scored outcomes are those passes' judged tokens."""
    pair = agentspec.ModelPair(target=target, tokenizer=tokenizer, name="tiny-calibration")
    steps = []
    for prompt, _ in greedy_cases(target, 6, 24, every=1, seed=3):  # every prompt a repeated pattern
        steps += agentspec.stream(pair, prompt, "auto", False, max_new_tokens=24)
    for s in steps:
        assert (s.source is None) == (s.drafted == 0)
    suffix = [s for s in steps if s.source == "suffix"]
    assert suffix and all(s.acceptance is not None and len(s.acceptance) == s.drafted for s in suffix)
    assert all(0.0 <= a <= 1.0 for s in suffix for a in s.acceptance)
    judged = calibration.outcomes(steps)
    assert len(judged) == sum(min(s.accepted + 1, s.drafted) for s in suffix)
