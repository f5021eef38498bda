"""The suffix drafter, the confidence schedule and ``drafter="auto"``: right drafts, lossless output.

Ladder: hand-written token arrays for the suffix index (frequency, recency, match length, floor,
truncation, eviction); the schedule's pure functions and its calibration and cost model; the stats
that record each pass's draft source; then tiny random models: greedy output equal to
transformers' ``generate`` for every new drafter, sampled output with the target's distribution
(``check_lossless`` of ``test_sampling_lossless``), seeds independent of earlier calls, grammars.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_grammar import FORCED, LIST, gpair, reference, valid_prefix  # noqa: F401 (gpair: a fixture)
from test_grammar import PROMPTS as GRAMMAR_PROMPTS
from test_sampling_lossless import N_DEFAULT, check_lossless, prompts, spair  # noqa: F401 (fixtures)

import agentspec
from agentspec import Draft, ModelPair
from agentspec import grammar as G
from agentspec.cache import PrefixCache
from agentspec.cost import DEFAULT_VERIFY_COST, PassTimes, VerifyCost, isotonic
from agentspec.decode import DEFAULT_DRAFT_CAP
from agentspec.drafters import (
    Calibration,
    ConfidenceSchedule,
    Drafter,
    DraftMemory,
    HybridDrafter,
    ModelDrafter,
    SuffixDrafter,
    SuffixStore,
    build_drafter,
)
from agentspec.drafters.schedule import best_length, positioned, survival, worth_extending
from agentspec.drafters.suffix import SuffixIndex
from agentspec.scheduler import batch_lengths
from agentspec.stats import DecodeStats
from agentspec.telemetry.attributes import source_attributes

VOCAB = 64
N_NEW = 16
FLAT = ((1, 1.0), (32, 1.0))  # verification as cheap as one step (a big model on a GPU, roughly)

pytestmark = pytest.mark.usefixtures("one_thread")


def index_of(*seqs: list[int]) -> SuffixIndex:
    index = SuffixIndex()
    for sid, seq in enumerate(seqs):
        index.extend(sid, seq)
    return index


# --- the suffix index: hand-written arrays ------------------------------------------------------


def test_the_most_frequent_continuation_wins():
    #      "1 2" is followed by 3, 3 and 4; after "1 2 3" always 9; the context ends in "7 1 2"
    seq = [5, 1, 2, 3, 9, 6, 1, 2, 3, 9, 8, 1, 2, 4, 0, 7, 1, 2]
    c = index_of(seq).speculate(seq, k=4)
    assert c.tokens == [3, 9] and c.match_len == 2  # "7 1 2" never occurred before: match "1 2"
    assert c.branches == pytest.approx([2 / 3, 1.0]) and c.probs == pytest.approx([2 / 3, 2 / 3])


def test_ties_go_to_the_latest_occurrence_and_length_grows_with_the_match():
    seq = [1, 5, 8, 1, 6, 8, 1]  # after 1: 5 (older) and 6 (newer), once each
    assert index_of(seq).speculate(seq, k=1).tokens == [6]
    # match "8 1" (m = 2): only "8 1 6" continues it, and two tokens are allowed
    c = index_of(seq).speculate(seq, k=8)
    assert c.tokens == [6, 8] and c.match_len == 2 and c.probs == [1.0, 1.0]


def test_draft_length_is_capped_by_the_match_length():
    text = list(range(10)) + [50]
    for m in (1, 3, 6):
        seq = text + list(range(m))  # the context repeats the first m tokens of the text
        c = index_of(seq).speculate(seq, k=8)
        assert c.match_len == m and c.tokens == (text + list(range(m)))[m : 2 * m], f"{m=} {c=}"


def test_the_probability_floor_cuts_candidates():
    seq = [7, 1, 7, 2, 7, 3, 7, 4, 7]  # after 7: four different tokens, 1/4 each
    index = index_of(seq)
    assert index.speculate(seq, k=4, floor=0.2).tokens == [4]  # 0.25 >= 0.2 (the latest of the ties)
    assert index.speculate(seq, k=4, floor=0.3).tokens == []


def test_truncate_leaves_the_index_as_if_built_fresh():
    rng = random.Random(0)
    index, seq = SuffixIndex(), []
    for _ in range(200):
        if rng.random() < 0.3 and seq:
            n = rng.randrange(len(seq))
            index.truncate(0, n)
            del seq[n:]
        else:
            new = [rng.randrange(6) for _ in range(rng.randint(1, 5))]
            index.extend(0, new)
            seq += new
        fresh = index_of(seq)
        assert {t: v for t, v in index.where.items() if v} == fresh.where and index.live == len(seq)
    assert index.speculate(seq, 5) == fresh.speculate(seq, 5)


def test_the_store_evicts_the_oldest_output_never_the_current_one():
    store = SuffixStore(max_tokens=10)
    a, b, c = store.open(), store.open(), store.open()
    store.append(a, [1, 2, 3, 4])
    store.append(b, [5, 6, 7, 8])
    assert store.speculate([1, 2], 4).tokens == [3, 4]
    store.append(c, [9, 9, 9, 9, 9])  # 13 tokens: the oldest (a) goes
    assert list(store.index.seqs) == [b, c] and store.tokens == 9
    assert store.speculate([1, 2], 4).tokens == []
    store.append(c, [9] * 20)  # the current output alone exceeds the bound: it stays
    assert list(store.index.seqs) == [c] and store.tokens == 25
    assert store.speculate([5, 6], 4).tokens == []


def test_removed_sequences_are_compacted_away():
    index = index_of([1, 2, 3] * 4, [1, 2, 4])
    index.remove(0)  # 12 dead entries > 3 live ones: rebuilt
    assert index.dead == 0 and all(s == 1 for entries in index.where.values() for s, _ in entries)
    assert index.speculate([7, 1, 2], 4).tokens == [4]


def test_the_store_drafts_from_earlier_outputs():
    store = SuffixStore()
    first = SuffixDrafter(store)
    first.candidate([40, 41, 1, 2], k=4)  # the prompt
    first.record([40, 41, 1, 2, 20, 21, 22, 23, 24])  # its verified output
    second = SuffixDrafter(store)
    assert second.candidate([30, 31, 20, 21], k=4).tokens == [22, 23]  # from the first output
    assert second.candidate([30, 31, 20, 21], k=4, use_store=False).tokens == []


# --- the schedule: pure functions, calibration, cost ----------------------------------------------


def curve(points):
    return VerifyCost(prior=points).verify


def test_survival_and_best_length():
    assert survival([0.5, 0.5, 1.0]) == [0.5, 0.25, 0.25]
    cpu = curve(DEFAULT_VERIFY_COST)  # V(2) = 1.64: one token must survive 64% of the time
    assert best_length([0.6], cpu) == 0 and best_length([0.7], cpu) == 1
    assert best_length(survival([0.95] * 8), cpu) == 8
    assert best_length([0.3], curve(FLAT)) == 1  # free verification: any chance pays
    assert best_length([0.3], curve(FLAT), draft_step=0.5) == 0  # unless drafting costs


def test_batch_lengths_admit_the_likeliest_tokens_while_the_pass_pays():
    # a pass costs 1 up to 8 rows, then 0.25 more a row: rows are free until the pass computes
    def pass_s(rows):
        return 1.0 + 0.25 * max(0, rows - 8)

    sure, unsure = survival([0.9] * 4), survival([0.5] * 4)
    assert batch_lengths([sure], 1, pass_s) == [4]  # alone, every row is free: all of it
    assert batch_lengths([sure, unsure], 2, pass_s) == [4, 2]  # 8 rows: then 0.25 buys only S > 0.5
    # eight members fill the free rows: the pass yields 8 tokens a second, so a row (0.25 s) must
    # bring 2 tokens, which no draft token can
    assert batch_lengths([sure] * 8, 8, pass_s) == [0] * 8
    cheaper = batch_lengths([[0.9, 0.2]] * 8, 8, lambda rows: 1.0 + 0.1 * max(0, rows - 8))
    assert cheaper == [1] * 8  # at 0.1 s a row the likely tokens pay (15.2 / 1.8 > 8), the rest not
    assert batch_lengths([[], [0.95]], 2, pass_s) == [0, 1]  # a member without a draft keeps none
    flat = batch_lengths([unsure] * 8, 8, lambda rows: 1.0)  # a flat curve: every token pays
    assert flat == [4] * 8


def test_worth_extending_projects_the_next_acceptance():
    cpu = curve(DEFAULT_VERIFY_COST)
    assert worth_extending([], 0.9, 8, cpu, 0.0)
    assert not worth_extending([], 0.3, 8, cpu, 0.0)
    assert not worth_extending([0.9, 0.8], 0.05, 8, cpu, 0.0)


def test_calibration_learns_acceptance_per_confidence_and_group():
    cal = Calibration()
    assert cal(0.9) == pytest.approx(0.9)  # the prior: confidence means what it says
    for _ in range(50):
        cal.observe([0.9, 0.9, 0.9], n_accepted=0)  # only position 1 is seen: a miss
    assert cal(0.9) < 0.1 and cal(0.95) < 0.1 and cal(0.5) == pytest.approx(0.5)
    assert cal.total[1] == pytest.approx(sum(0.995**i for i in range(50)))  # one trial per draft
    other = positioned(1, 0)  # another kind of evidence (a match length): its own cells
    cal.observe([0.9, 0.9], n_accepted=2, groups=[other, other])
    assert cal(0.9, group=other) > 0.9 > cal(0.9, group=0)
    # a later position of a kind starts from what its first positions showed, then learns its own rate
    assert cal(0.9, group=positioned(0, 2)) < 0.1
    for _ in range(50):
        cal.observe([0.5, 0.5, 0.5], n_accepted=3, groups=[positioned(2, j) for j in range(3)])
        cal.observe([0.5, 0.5], n_accepted=0, groups=[positioned(2, j) for j in range(2)])
    assert cal(0.5, group=positioned(2, 0)) == pytest.approx(0.5, abs=0.05)
    assert cal(0.5, group=positioned(2, 1)) > 0.9  # judged only after a first token accepted


def test_a_second_stage_learns_what_the_first_stages_estimates_turned_out_to_be():
    """A first stage stuck at 0.85 (a prior too heavy to move) accepted half the time where it says so:
    the second stage, per position, moves to 0.5 where it has seen them; it keys its cells by the
    estimates the schedule read, so a fresh copy and other positions keep the first stage's."""
    cal = Calibration(prior=lambda c, group: 0.85, weight=1e9, recalibrate=4.0)
    assert cal(0.3) == pytest.approx(0.85)  # no evidence: the first stage's estimate
    for i in range(200):  # one-token drafts: position 0 only
        cal.observe([0.3], n_accepted=i % 2)
    assert cal(0.3) == pytest.approx(0.5, abs=0.05) and cal(0.8) == pytest.approx(0.5, abs=0.05)
    assert cal(0.3, group=positioned(0, 1)) == pytest.approx(0.85)  # position 1: unseen
    assert cal.fresh()(0.3) == pytest.approx(0.85) and cal.fresh().recalibrate == 4.0
    plain = Calibration(prior=lambda c, group: 0.85, weight=1e9)
    plain.observe([0.3], n_accepted=0)
    assert plain(0.3) == pytest.approx(0.85) and not plain.second  # no stage unless asked
    assert DraftMemory().model_calibration.recalibrate > 0 == DraftMemory().suffix_calibration.recalibrate


def test_isotonic_pools_violators():
    # (3, 2.0) and the heavier (5, 1.0) pool to 1.25, below (2, 1.5): all three pool to 6.5 / 5
    fitted = isotonic([(2, 1.5, 1.0), (3, 2.0, 1.0), (5, 1.0, 3.0), (9, 2.5, 1.0)])
    assert [x for x, _ in fitted] == [2, 3, 5, 9]
    assert [v for _, v in fitted] == pytest.approx([1.3, 1.3, 1.3, 2.5])
    assert isotonic([(2, 1.2, 1.0), (4, 1.5, 1.0)]) == [(2, 1.2), (4, 1.5)]  # already monotone


def test_the_cost_model_learns_the_curve_from_timed_passes():
    times = PassTimes()
    cost = VerifyCost(times=times)
    assert cost.verify(2) == pytest.approx(1.64) and cost.verify(1) == 1.0  # the prior
    for _ in range(5):
        times.observe(1, 0.100)
        times.observe(3, 0.120)
        times.observe(5, 0.110)  # noisy: faster than 3
    times.observe(1, 5.0)  # one pass delayed by another process: the median ignores it
    assert cost.verify(3) == cost.verify(5) == pytest.approx(1.15)  # fitted non-decreasing
    assert cost.verify(2) == pytest.approx(1.075)  # interpolated
    assert cost.verify(16) == pytest.approx(
        1.15 * 3.05 / (1.79 + 0.89 / 4)
    )  # past the data: the prior's shape
    for _ in range(5):
        cost.observe_draft(0.025)
    assert cost.draft_step == pytest.approx(0.25)
    frozen = cost.frozen()
    frozen.observe_draft(1.0)
    assert frozen.verify(2) == pytest.approx(1.64) and frozen.draft_step == 0.1


def test_the_schedule_skips_a_useless_draft_but_probes_it():
    cal = Calibration()
    for _ in range(100):
        cal.observe([0.9], n_accepted=0)
        cal.note_first(cal(0.9))
    sched = ConfidenceSchedule(cal, VerifyCost())
    sched.begin(greedy=True)
    probes = [i for i in range(124) if sched.start(4)]  # the last one a probe
    assert probes == [3, 11, 27, 59, 123], probes  # backing off: 4, 8, 16, 32, 64 skipped steps
    assert sched.probing and sched.include(0.9) and not sched.include(0.9)  # a probe verifies one
    sched.observe(n_accepted=1, n_drafted=1)  # one lucky accept does not end the back-off...
    assert not any(sched.start(4) for _ in range(100))
    for _ in range(400):  # ...evidence that drafting pays does
        cal.observe([0.9, 0.9, 0.9], n_accepted=3)
        cal.note_first(cal(0.9))
    assert sched.start(4) and cal.probe_interval == 4
    later = ConfidenceSchedule(cal, VerifyCost())  # the next call's schedule: the same back-off state
    later.begin(greedy=True)
    assert later.start(4)


def test_the_schedule_stops_where_confidence_drops():
    sched = ConfidenceSchedule(Calibration(), VerifyCost())
    sched.begin(greedy=True)
    assert sched.start(8)  # prior: 70% acceptance per position, worth drafting even on this CPU
    assert sched.include(0.99) and sched.include(0.98) and sched.include(0.97)
    assert not sched.include(0.2)
    assert sched.trim() == 3
    sched.observe(n_accepted=3, n_drafted=3)
    assert sched.shared_calibration.total[1] == pytest.approx(1 + 0.995 + 0.995**2)  # 3 decayed trials


# --- stats: the source of every pass --------------------------------------------------------------


def test_stats_split_passes_by_draft_source():
    s = DecodeStats(drafter="auto")
    s.observe_step(4, 3, "suffix")
    s.observe_step(2, 0, "model")
    s.observe_step(0, 0, "suffix")  # nothing drafted: "none", whatever the source
    s.observe_step(1, 1)  # no source: the drafter's own name
    assert s.source_steps == {"suffix": 1, "model": 1, "none": 1, "auto": 1}
    assert s.source_draft_tokens == {"suffix": 4, "model": 2, "none": 0, "auto": 1}
    assert s.source_accepted_tokens == {"suffix": 3, "model": 0, "none": 0, "auto": 1}
    attrs = source_attributes(s)
    assert attrs["agentspec.source.suffix.accepted_tokens"] == 3
    assert attrs["agentspec.source.model.verify_steps"] == 1
    from agentspec.chat import speculative_metadata

    meta = speculative_metadata(s)
    assert meta["source_steps"] == s.source_steps and meta["source_accepted_tokens"]["suffix"] == 3


# --- tiny models: greedy output equals transformers' generate --------------------------------------


def flat_memory() -> DraftMemory:
    """Drafting memory with a fixed cost model: verification free, a draft step 1/10 of a target step."""
    return DraftMemory(cost=VerifyCost(prior=FLAT, draft_step_prior=0.1))


@pytest.fixture(scope="module")
def cases(one_thread, target, greedy_cases) -> list[tuple[list[int], list[int]]]:
    """(prompt, greedy continuation): half repeat a pattern (suffix drafts), half are random."""
    return greedy_cases(target, 24, N_NEW, every=2, seed=7)


@pytest.fixture(scope="module")
def lone(target, tokenizer) -> ModelPair:
    """The target with no draft model (the embedded default pair's situation)."""
    return ModelPair(target=target, tokenizer=tokenizer, name="tiny-lone")


def run_cases(pair, cases, make, k: int) -> DecodeStats:
    """Every case through a fresh drafter from ``make()``; outputs checked; the summed stats back."""
    total = DecodeStats()
    for prompt, ref in cases:
        r = agentspec.generate(pair, prompt, make(), max_new_tokens=N_NEW, num_draft_tokens=k)
        assert r.token_ids == ref, f"{prompt=}\n{r.token_ids=}\n{ref=}"
        s = r.stats
        assert sum(s.acceptance_histogram) == s.verify_steps == sum(s.source_steps.values()), f"{s=}"
        assert s.accepted_tokens <= s.draft_tokens <= k * s.verify_steps and s.draft_failures == 0, f"{s=}"
        assert s.accepted_tokens + s.verify_steps == s.output_tokens, f"{s=}"
        total.verify_steps += s.verify_steps
        total.draft_tokens += s.draft_tokens
        total.accepted_tokens += s.accepted_tokens
        for src, n in s.source_steps.items():
            total.source_steps[src] = total.source_steps.get(src, 0) + n
    return total


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("name", ["suffix", "model_scheduled", "auto", "auto-lone"])
def test_greedy_equals_generate(pair, lone, cases, name, k):
    memory = flat_memory()
    the_pair = lone if name == "auto-lone" else pair
    s = run_cases(the_pair, cases, lambda: build_drafter(the_pair, name.split("-")[0], memory), k)
    assert 0 < s.accepted_tokens < s.draft_tokens, f"{name}: every path must run: {s=}"
    if name == "auto":  # the choice is visible, and both sources were used
        assert s.source_steps.get("suffix", 0) > 0 and s.source_steps.get("model", 0) > 0, s.source_steps


@pytest.mark.parametrize("name", ["auto", "suffix", "model_scheduled"])
def test_the_names_resolve_with_the_pairs_own_memory(pair, cases, name):
    """``drafter=name`` (the pair's memory, its cost learned from timing) gives the same output."""
    s = run_cases(pair, cases[:8], lambda: name, 4)
    assert s.verify_steps > 0


def test_memory_is_per_pair_and_namespace(pair, lone, tokenizer, perturbed):
    other = ModelPair(target=pair.target, draft=perturbed(pair.target, 9, 0.1), tokenizer=tokenizer)
    m = pair.tenants.memory()
    assert m is pair.tenants.memory(None)
    assert m is not other.tenants.memory() and m is not lone.tenants.memory()
    assert m.store is not other.tenants.memory().store  # pairs never share what they learned
    tenant = pair.tenants.memory("tenant-a")
    assert tenant is pair.tenants.memory("tenant-a") and tenant is not m and tenant.store is not m.store


def test_a_namespace_keeps_earlier_outputs_apart(lone, cases):
    prompt, ref = cases[1]  # a random prompt: little to copy from itself
    options = {"max_new_tokens": N_NEW, "num_draft_tokens": 8, "prefix_cache": False}
    runs = [agentspec.generate(lone, prompt, "suffix", namespace=ns, **options) for ns in ("a", "a", "b")]
    assert [r.token_ids for r in runs] == [ref] * 3
    assert lone.tenants.memory("a").store.tokens == 2 * N_NEW
    assert lone.tenants.memory("b").store.tokens == N_NEW
    assert runs[1].stats.accepted_tokens > runs[0].stats.accepted_tokens + N_NEW // 2, [r.stats for r in runs]
    assert runs[2].stats.accepted_tokens < runs[1].stats.accepted_tokens, [r.stats for r in runs]


class OwnDrafter(Drafter):
    """A user's drafter: a name and ``propose`` only (the rest are the base class's defaults)."""

    name = "own"

    def propose(self, seq, k, config, generator):
        return Draft(seq[-k:])  # the context's last tokens again: often wrong, sometimes right


def test_a_drafter_with_only_name_and_propose(pair, cases):
    for prompt, ref in cases[:6]:
        r = agentspec.generate(pair, prompt, OwnDrafter(), max_new_tokens=N_NEW)
        assert r.token_ids == ref and r.stats.drafter == "own" and r.stats.draft_failures == 0
        assert r.stats.draft_tokens <= DEFAULT_DRAFT_CAP * r.stats.verify_steps, r.stats


class EarlierStyleDrafter:
    """A drafter with ``Drafter``'s members that does not subclass it."""

    name = "earlier"

    def propose(self, seq, k, config, generator):
        return Draft(seq[-k:])

    def feedback(self, seq, n_accepted, n_drafted):
        pass

    def reset(self):
        pass


def test_an_object_that_is_not_a_drafter_is_refused(pair):
    """The loop reads what ``Drafter`` declares: an object that does not subclass it is refused,
    with the way to fix it in the message, and the pair serves the next call."""
    for other in (EarlierStyleDrafter(), object()):
        with pytest.raises(ValueError, match="subclass agentspec.Drafter"):
            agentspec.generate(pair, [1, 2, 3], other, max_new_tokens=2)
    assert len(agentspec.generate(pair, [1, 2, 3], "suffix", max_new_tokens=2).token_ids) == 2


def test_auto_is_the_default(pair, lone, cases):
    prompt, ref = cases[0]
    for p in (pair, lone):
        r = agentspec.generate(p, prompt, max_new_tokens=N_NEW)
        assert r.token_ids == ref and r.stats.drafter == "auto"


def test_earlier_outputs_are_drafted_from(pair, cases):
    memory = flat_memory()
    prompt, ref = cases[1]  # a random prompt: little to copy from itself
    runs = [
        agentspec.generate(
            pair, prompt, SuffixDrafter(memory.store), max_new_tokens=N_NEW, num_draft_tokens=8
        )
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids == ref
    assert memory.store.tokens == 2 * N_NEW  # each call's output
    assert runs[1].stats.accepted_tokens > runs[0].stats.accepted_tokens + N_NEW // 2, [r.stats for r in runs]


def test_the_schedule_drafts_little_with_a_bad_draft(target, tokenizer, tiny_llama, cases):
    bad = ModelPair(target=target, draft=tiny_llama(11), tokenizer=tokenizer, name="tiny-bad")
    cpu = DraftMemory(cost=VerifyCost(draft_step_prior=0.1))  # the CPU curve
    fixed = run_cases(bad, cases, lambda: ModelDrafter(bad.draft, VOCAB), 4)
    sched = run_cases(bad, cases, lambda: build_drafter(bad, "model_scheduled", cpu), 4)
    assert fixed.draft_tokens > 3 * fixed.verify_steps  # 4 per pass but where the budget ends
    assert sched.draft_tokens < fixed.draft_tokens / 4, (sched, fixed)
    # each skipped draft saves k draft steps and the verification of k tokens; passes stay ~plain's
    assert sched.verify_steps <= len(cases) * N_NEW


def test_the_schedule_keeps_drafting_with_a_good_draft(pair, cases):
    s = run_cases(pair, cases, lambda: build_drafter(pair, "model_scheduled", flat_memory()), 8)
    assert s.accepted_tokens / s.verify_steps > 1.0, s  # more than one accepted token per pass


def test_auto_restores_and_saves_the_draft_state_with_the_prefix_cache(pair, cases, hf_greedy):
    cache = PrefixCache(1 << 26)
    prompt, _ = cases[0]
    first = agentspec.generate(pair, prompt, "auto", prefix_cache=cache, max_new_tokens=N_NEW)
    longer = prompt + first.token_ids + [3, 4]
    drafter = build_drafter(pair, "auto", flat_memory())
    assert isinstance(drafter, HybridDrafter) and isinstance(drafter.model, ModelDrafter)
    again = agentspec.generate(pair, longer, drafter, prefix_cache=cache, max_new_tokens=N_NEW)
    assert again.token_ids == hf_greedy(pair.target, longer, N_NEW)
    assert again.stats.cached_tokens > len(prompt)


# --- tiny models: sampling ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "prompt", "temperature", "top_p"),
    [
        ("auto", "model", 0.7, 0.8),  # mostly draft-model passes (with q)
        ("auto", "prompt_lookup", 1.3, None),  # suffix (one-hot) and model passes mixed
        ("model_scheduled", "model", 1.0, None),  # lengths cut by confidence, before sampling
    ],
)
def test_sampling_is_lossless(spair, prompts, make, prompt, temperature, top_p):  # noqa: F811
    drafter = build_drafter(spair, make, flat_memory())  # reset by every call: reused across seeds
    print(check_lossless(spair, prompts[prompt], drafter, N_DEFAULT, temperature, top_p))


@pytest.mark.parametrize("name", ["auto", "suffix", "model_scheduled"])
def test_a_seeded_call_does_not_depend_on_earlier_calls(pair, cases, name):
    memory = DraftMemory()
    options = {"max_new_tokens": 20, "temperature": 1.0, "num_draft_tokens": 4, "seed": 5}
    prompt = cases[0][0]
    first = agentspec.generate(pair, prompt, build_drafter(pair, name, memory), **options).token_ids
    for other, _ in cases[:6]:  # fill the tree of outputs, the calibrations and the cost model
        agentspec.generate(pair, other, build_drafter(pair, name, memory), max_new_tokens=N_NEW)
        agentspec.generate(pair, other + prompt, build_drafter(pair, name, memory), **options)
    assert memory.store.tokens > 0 or name == "model_scheduled"
    assert agentspec.generate(pair, prompt, build_drafter(pair, name, memory), **options).token_ids == first


# --- tiny models: grammars ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["auto", "model_scheduled", "suffix"])
@pytest.mark.parametrize("source", ["LIST", "FORCED"])
def test_greedy_constrained_equals_plain_constrained(gpair, name, source):  # noqa: F811
    grammar = G.ebnf({"LIST": LIST, "FORCED": FORCED}[source])
    memory = flat_memory()
    for prompt in GRAMMAR_PROMPTS:
        expected = reference(gpair, prompt, grammar, 24)
        for jump_forward in (True, False):
            d = build_drafter(gpair, name, memory)
            r = agentspec.generate(
                gpair,
                prompt,
                d,
                False,
                grammar,
                max_new_tokens=24,
                jump_forward=jump_forward,
                num_draft_tokens=4,
            )
            assert r.token_ids == expected, (name, jump_forward, prompt)
            assert valid_prefix(gpair, grammar, r.token_ids)


def test_the_hybrid_forwards_the_constraint_to_the_draft_model(gpair):  # noqa: F811
    grammar = G.ebnf(LIST)
    config = agentspec.GenerationConfig(temperature=1.0)
    drafter = build_drafter(gpair, "auto", flat_memory())
    assert isinstance(drafter.model, ModelDrafter) and HybridDrafter().model is None
    for seed in range(5):
        drafter.reset()
        c = G.Constraint.for_pair(gpair, grammar)
        draft = drafter.propose(
            GRAMMAR_PROMPTS[0], 6, config, torch.Generator().manual_seed(seed), constraint=c
        )
        assert drafter.choice == "model" and draft.tokens and c.path == draft.tokens
        assert valid_prefix(gpair, grammar, draft.tokens)
        assert bool((draft.q[~c.masks(len(draft.tokens))] == 0).all())  # q: the masked distributions


# --- survival estimates of model-free drafts --------------------------------------------------------


def test_prompt_lookup_estimates_learn_per_ngram_and_position():
    """With a calibration, a greedy prompt-lookup draft carries an estimate per token, from the prior
    of its matched n-gram's length before evidence; passes that accept everything raise them, a
    trimmed draft teaches only the positions verified, and a sampled draft carries none."""
    from agentspec.drafters.prompt_lookup import LOOKUP_PRIOR, PromptLookupDrafter, lookup_prior
    from agentspec.drafters.schedule import Calibration

    greedy = agentspec.GenerationConfig()
    cal = Calibration(lookup_prior)
    d = PromptLookupDrafter(calibration=cal)
    seq = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # "1 2 3" matched: a 3-gram
    draft = d.propose(seq, 4, greedy, None)
    assert draft.tokens == [4, 5, 6, 7] and draft.survival == pytest.approx([LOOKUP_PRIOR[2]] * 4)
    for _ in range(20):
        d.propose(seq, 4, greedy, None)
        d.feedback(seq + [4, 5, 6, 7, 1], 4, 4)
    learned = d.propose(seq, 4, greedy, None).survival
    assert all(a > 0.9 for a in learned)
    d.trimmed(2)  # only the first two positions verified: one of them rejected
    d.feedback(seq + [4, 9], 1, 2)
    after = d.propose(seq, 4, greedy, None).survival
    # position 2 was judged a miss; later ones were not judged: only their pooled start moved
    assert after[1] < learned[1] and learned[1] - after[1] > 10 * abs(learned[2] - after[2])
    assert d.propose(seq, 4, agentspec.GenerationConfig(temperature=1.0), None).survival is None


def test_suffix_drafts_carry_their_calibrated_estimates():
    from agentspec.drafters.schedule import Calibration
    from agentspec.drafters.suffix import suffix_groups, suffix_prior

    cal = Calibration(suffix_prior)
    d = SuffixDrafter(calibration=cal)
    seq = [5, 6, 7, 8, 9, 5, 6, 7]
    cand = d.candidate(seq, 4)
    draft = d.propose(seq, 4, agentspec.GenerationConfig(), None)
    groups = suffix_groups(cand.match_len, len(cand.tokens))
    assert draft.tokens == cand.tokens and len(draft.survival) == len(draft.tokens) > 0
    assert draft.survival == pytest.approx([cal(b, g) for b, g in zip(cand.branches, groups)])
    d.feedback(seq + draft.tokens[:1] + [0], 1, len(draft.tokens))
    assert cal.total[1] == pytest.approx(min(2, len(draft.tokens)), rel=0.01)  # a hit, a miss (decayed)
    assert SuffixDrafter().propose(seq, 4, agentspec.GenerationConfig(), None).survival is None
