"""Calls running together on one pair share its passes, and each gets exactly its solo output.

Every test starts its calls while holding the pair's lock, so they all join before the first pass
(``start_together``): the passes are shared by construction, not by luck of timing. Greedy outputs
are compared with transformers' own greedy decoding of the target alone; where one differs, the
failure names the logit margin at the first differing token (a near-tie is a rounding question of
the packed pass's row count, anything larger a bug).
"""

from __future__ import annotations

import copy
import threading
import time
from contextlib import contextmanager

import pytest
import torch
from test_grammar import FORCED, LIST, pieces, reference
from test_grammar import PROMPTS as GRAMMAR_PROMPTS

import agentspec
from agentspec import Draft, ModelPair
from agentspec import grammar as G
from agentspec.attention import use_grouped_sdpa
from agentspec.bench.together import start_together
from agentspec.cache import PrefixCache
from agentspec.cost import DEFAULT_VERIFY_COST
from agentspec.decode import DecodeTimeout
from agentspec.drafters import Drafter
from agentspec.memory import DeviceOutOfMemory
from agentspec.request import LOOKAHEAD

N_NEW = 16
LOOKAHEAD_PLUS_ONE = LOOKAHEAD + 1  # Steps a call may have run ahead when its caller cancels, and one more
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def bpair(one_thread, target, draft, tokenizer) -> ModelPair:
    """The conftest pair's models, on the attention the packed pass needs (as ``load_pair`` sets)."""
    t, d = copy.deepcopy(target), copy.deepcopy(draft)
    assert use_grouped_sdpa(t) and use_grouped_sdpa(d)
    return ModelPair(
        target=t, draft=d, tokenizer=tokenizer, name="tiny-batched", prefix_cache=PrefixCache(16 << 20)
    )


@pytest.fixture
def drafts_unbounded(bpair, monkeypatch):
    """Members draft as they would alone, whatever the load (the tests that need their drafts)."""
    monkeypatch.setattr(bpair.scheduler, "load_factor", None)


@pytest.fixture(scope="module")
def cases(bpair, greedy_cases):
    return greedy_cases(bpair.target, 8, N_NEW, every=3, seed=7)


@torch.inference_mode()
def margin_note(model, prompt: list[int], got: list[int], want: list[int]) -> str:
    """Where ``got`` first differs from ``want``: the target's logit margin between the two tokens."""
    i = next(j for j, (a, b) in enumerate(zip(got, want)) if a != b)
    logits = model(input_ids=torch.tensor([prompt + want[:i]])).logits[0, -1]
    return f"first difference at token {i}: margin {float(logits[want[i]] - logits[got[i]]):.3g}"


def assert_same(model, prompt, got, want) -> None:
    assert got == want, margin_note(model, prompt, got, want) if got[: len(want)] != want else "length"


@pytest.mark.parametrize("k", [2, 4, 8])
def test_concurrent_greedy_calls_equal_their_solo_decoding_in_shared_passes(bpair, cases, k):
    drafters = ["model", "prompt_lookup", "none", "suffix", "auto"]
    chosen = cases[:k]
    s = bpair.scheduler.stats
    passes0, members0, timed0 = s.passes, s.members, bpair.cost.times.observed
    forwards = []
    # every forward of the target, lean or transformers', embeds its rows once
    hook = bpair.target.get_input_embeddings().register_forward_hook(lambda *_: forwards.append(1))
    try:
        results = start_together(
            bpair,
            [
                lambda p=p, i=i: agentspec.generate(
                    bpair, p, drafters[i % len(drafters)], False, max_new_tokens=N_NEW
                )
                for i, (p, _) in enumerate(chosen)
            ],
        )
    finally:
        hook.remove()
    for (prompt, want), r in zip(chosen, results):
        assert not isinstance(r, Exception), r
        assert_same(bpair.target, prompt, r.token_ids, want)
    # one target forward per pass, and the passes were shared
    assert len(forwards) == s.passes - passes0
    assert s.members - members0 > s.passes - passes0
    assert bpair.cost.times.observed - timed0 == s.passes - passes0  # each pass timed with all its rows


def test_a_call_joining_and_one_leaving_mid_decode_change_nothing(bpair, cases, hf_greedy):
    (p1, _), (p2, want2) = cases[0], cases[1]
    long_want = hf_greedy(bpair.target, p1, 40)
    steps = agentspec.stream(bpair, p1, "model", False, max_new_tokens=40)
    got = list(next(steps).tokens)
    joined: list = []
    t = threading.Thread(
        target=lambda: joined.append(agentspec.generate(bpair, p2, "model", False, max_new_tokens=N_NEW))
    )
    t.start()
    for step in steps:
        got += step.tokens
    t.join(timeout=120)
    assert_same(bpair.target, p1, got, long_want)
    assert_same(bpair.target, p2, joined[0].token_ids, want2)


def test_a_stream_closed_early_leaves_the_others_and_the_cache_whole(bpair, cases):
    (p1, _), (p2, want2) = cases[2], cases[3]
    gate = threading.Event()

    def closed_after_two():
        steps = agentspec.stream(bpair, p1, "model", True, max_new_tokens=N_NEW)
        next(steps), next(steps)
        steps.close()
        gate.set()
        return "closed"

    results = start_together(
        bpair, [closed_after_two, lambda: agentspec.generate(bpair, p2, "model", True, max_new_tokens=N_NEW)]
    )
    assert results[0] == "closed" and gate.is_set()
    assert_same(bpair.target, p2, results[1].token_ids, want2)
    bpair.prefix_cache.tree.check()
    again = agentspec.generate(bpair, p1, "model", True, max_new_tokens=N_NEW)  # restores what was saved
    assert_same(bpair.target, p1, again.token_ids, cases[2][1])


class Slow(Drafter):
    """Proposes nothing, slowly: a call drafting with it takes at least ``seconds`` a pass."""

    name = "slow"

    def __init__(self, seconds: float):
        self.seconds = seconds

    def propose(self, seq, k, config, generator) -> Draft:
        time.sleep(self.seconds)
        return Draft([])


def test_a_call_timing_out_beside_others_leaves_them_whole(bpair, cases):
    (p1, _), (p2, want2) = cases[4], cases[5]
    # 16 passes of at least 0.25 s cannot finish within the 2 s timeout, which the join cannot use up
    results = start_together(
        bpair,
        [
            lambda: agentspec.generate(bpair, p1, Slow(0.25), False, max_new_tokens=N_NEW, timeout=2),
            lambda: agentspec.generate(bpair, p2, "model", False, max_new_tokens=N_NEW),
        ],
    )
    assert isinstance(results[0], DecodeTimeout) and "timed out decoding" in str(results[0])
    assert_same(bpair.target, p2, results[1].token_ids, want2)


class Crashing(Drafter):
    name = "crashing"

    def propose(self, seq, k, config, generator) -> Draft:
        raise RuntimeError("the drafter broke")


def test_one_calls_drafter_crashing_falls_back_alone(bpair, cases, drafts_unbounded):
    chosen = cases[:4]
    results = start_together(
        bpair,
        [
            lambda p=p, i=i: agentspec.generate(
                bpair, p, Crashing() if i == 0 else "model", False, max_new_tokens=N_NEW
            )
            for i, (p, _) in enumerate(chosen)
        ],
    )
    for i, ((prompt, want), r) in enumerate(zip(chosen, results)):
        assert_same(bpair.target, prompt, r.token_ids, want)
        assert r.stats.draft_failures == (1 if i == 0 else 0)


def test_an_out_of_memory_pass_is_retried_with_fewer_calls(bpair, cases, monkeypatch, drafts_unbounded):
    import agentspec.scheduler as scheduler

    real, failed = scheduler.forward_packed, []

    def once_out_of_memory(states, *args, **kwargs):
        if len(states) > 2 and not failed:
            failed.append(len(states))
            raise DeviceOutOfMemory("CUDA out of memory (injected)")
        return real(states, *args, **kwargs)

    monkeypatch.setattr(scheduler, "forward_packed", once_out_of_memory)
    chosen = cases[:4]
    results = start_together(
        bpair,
        [lambda p=p: agentspec.generate(bpair, p, "model", False, max_new_tokens=N_NEW) for p, _ in chosen],
    )
    assert failed == [4]
    for (prompt, want), r in zip(chosen, results):
        assert_same(bpair.target, prompt, r.token_ids, want)


def test_a_seeded_sampled_call_draws_the_same_beside_others(bpair, cases):
    prompt = cases[6][0]
    options = dict(max_new_tokens=N_NEW, temperature=1.0, seed=1234)
    alone = agentspec.generate(bpair, prompt, "model", False, **options).token_ids
    results = start_together(
        bpair,
        [lambda: agentspec.generate(bpair, prompt, "model", False, **options)]
        + [
            lambda p=p: agentspec.generate(bpair, p, "model", False, max_new_tokens=N_NEW)
            for p, _ in cases[:3]
        ],
    )
    assert results[0].token_ids == alone


def test_a_long_prompt_joins_in_chunks_beside_decoding_calls(bpair, cases, monkeypatch, hf_greedy):
    monkeypatch.setattr(bpair.scheduler, "prefill_chunk", 8)
    long_prompt = (cases[0][0] * 10)[:90]
    want = hf_greedy(bpair.target, long_prompt, 8)
    s = bpair.scheduler.stats
    s.recent.clear()
    results = start_together(
        bpair,
        [lambda: agentspec.generate(bpair, long_prompt, "none", False, max_new_tokens=8)]
        + [
            lambda p=p: agentspec.generate(bpair, p, "none", False, max_new_tokens=N_NEW)
            for p, _ in cases[1:3]
        ],
    )
    assert_same(bpair.target, long_prompt, results[0].token_ids, want)
    for (prompt, w), r in zip(cases[1:3], results[1:]):
        assert_same(bpair.target, prompt, r.token_ids, w)
    # no pass fed more than a chunk of each prompt (plus a pending token) beside the others' rows
    assert max(rows for _, rows in s.recent) <= 3 * (8 + 1)


def test_a_draft_model_takes_one_step_per_draft_position_for_all_calls(
    bpair, cases, drafts_unbounded, monkeypatch
):
    """Four calls drafting with the draft model: its steps are packed (one forward for all four per
    draft position), so it runs far fewer forwards than the same calls one after another."""
    chosen = cases[:4]
    forwards: list[bool] = []  # per draft forward: packed (several calls' rows) or not
    draft_forward = bpair.draft_forward
    real = type(draft_forward).__call__

    def counted(self, *args, pack=None, **kwargs):
        if self is draft_forward:
            forwards.append(pack is not None)
        return real(self, *args, pack=pack, **kwargs)

    monkeypatch.setattr(type(draft_forward), "__call__", counted)
    alone = [agentspec.generate(bpair, p, "model", False, max_new_tokens=N_NEW) for p, _ in chosen]
    n_alone = len(forwards)
    forwards.clear()
    together = start_together(
        bpair,
        [lambda p=p: agentspec.generate(bpair, p, "model", False, max_new_tokens=N_NEW) for p, _ in chosen],
    )
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert sum(forwards) > 0 and len(forwards) < n_alone / 2, (len(forwards), sum(forwards), n_alone)


def test_under_load_each_call_drafts_within_its_part_of_the_row_budget(bpair, cases, monkeypatch):
    """With a load factor, the pass's rows are priced by the pair's cost model: where rows cost more,
    calls draft less."""
    scheduler = bpair.scheduler
    monkeypatch.setattr(scheduler, "load_factor", 2.0)
    monkeypatch.setattr(scheduler.cost, "rows_within", lambda factor, cached, most=1024: 8)
    chosen = cases[:4]
    steps: list[list] = [[] for _ in chosen]

    def streamed(i: int, prompt: list[int]):
        steps[i] = list(agentspec.stream(bpair, prompt, "model", False, max_new_tokens=N_NEW))
        return [t for s in steps[i] for t in s.tokens]

    results = start_together(bpair, [lambda i=i, p=p: streamed(i, p) for i, (p, _) in enumerate(chosen)])
    for (prompt, want), got in zip(chosen, results):
        assert_same(bpair.target, prompt, got, want)
    # 8 rows for 4 calls: one pending token and at most one draft token each while all four run
    first = [s[: min(len(x) for x in steps)] for s in steps]
    assert all(step.drafted <= 1 for s in first for step in s[1:])
    alone = list(agentspec.stream(bpair, chosen[0][0], "model", False, max_new_tokens=N_NEW))
    assert max(step.drafted for step in alone) > 1  # alone, the same call drafts more: the budget bound it


@pytest.mark.parametrize("drafter", ["auto", "model_scheduled"])
def test_a_shared_pass_verifies_the_drafts_likely_to_survive_and_changes_no_reply(
    bpair, cases, monkeypatch, drafter
):
    """Where rows cost more than their drafts are likely to bring, the scheduler cuts the drafts of a
    shared pass to their likeliest prefixes; each reply stays its solo decoding."""
    scheduler = bpair.scheduler
    assert scheduler.schedule_drafts
    monkeypatch.setattr(scheduler.cost, "pricer", lambda cached: lambda rows: 1.0 + 0.3 * rows)
    # each drafter's own view of a pass: the CPU prior, not what earlier tests' shared passes taught
    monkeypatch.setattr(scheduler.cost.verify, "curve", lambda: DEFAULT_VERIFY_COST)
    monkeypatch.setattr(scheduler.cost.verify, "draft_times", [])
    chosen = cases[:4]
    trimmed0, steps = scheduler.stats.trimmed, [[] for _ in chosen]

    def streamed(i: int, prompt: list[int]):
        # a namespace of its own: calibrations that earlier tests taught would bench the draft model
        options = {"namespace": f"trim-{drafter}", "max_new_tokens": N_NEW}
        steps[i] = list(agentspec.stream(bpair, prompt, drafter, False, **options))
        return [t for s in steps[i] for t in s.tokens]

    results = start_together(bpair, [lambda i=i, p=p: streamed(i, p) for i, (p, _) in enumerate(chosen)])
    for (prompt, want), got in zip(chosen, results):
        assert_same(bpair.target, prompt, got, want)
    assert scheduler.stats.trimmed > trimmed0
    trimmed0 = scheduler.stats.trimmed
    assert streamed(0, chosen[0][0]) == chosen[0][1]
    assert scheduler.stats.trimmed == trimmed0  # a call alone drafts as its own schedule says


def test_a_pass_of_several_calls_reads_the_device_once(bpair, cases):
    """Every call's verdict (accept count, token, draft ids) comes back in one host read per pass:
    on a GPU the one wait of the pass, however many calls share it."""
    from agentspec.bench.syncs import HostSyncs

    chosen = cases[:4]
    s = bpair.scheduler.stats
    passes0 = s.passes
    with HostSyncs(bpair) as syncs:
        results = start_together(
            bpair,
            [
                lambda p=p: agentspec.generate(bpair, p, "none", False, max_new_tokens=N_NEW)
                for p, _ in chosen
            ],
        )
    for (prompt, want), r in zip(chosen, results):
        assert_same(bpair.target, prompt, r.token_ids, want)
    assert s.passes - passes0 < sum(r.stats.verify_steps for r in results)  # the passes were shared
    assert syncs.count == s.passes - passes0, syncs.where


@pytest.mark.parametrize("when", ["before the first pass", "after the first step"])
def test_cancelled_calls_end_and_leave_the_scheduler(bpair, cases, when):
    """A cancel (a client that went away) ends the call at the next pass boundary, even while its
    caller waits for a Step that will never come; its verified part is saved, and no member is left."""
    chosen = cases[:3]
    events = [threading.Event() for _ in chosen]
    if when == "before the first pass":
        for e in events:
            e.set()

    def cancelled_call(i: int, prompt: list[int]) -> list:
        steps = []
        for step in agentspec.stream(bpair, prompt, "model", True, cancelled=events[i], max_new_tokens=40):
            steps.append(step)
            events[i].set()  # after the first step at the latest
        return steps

    results = start_together(
        bpair, [lambda i=i, p=p: cancelled_call(i, p) for i, (p, _) in enumerate(chosen)]
    )
    for (_, want), steps in zip(chosen, results):
        assert not isinstance(steps, Exception), steps
        assert len(steps) <= LOOKAHEAD_PLUS_ONE and all(s.finish_reason is None for s in steps)
        got = [t for s in steps for t in s.tokens]
        assert got == want[: len(got)]
    assert bpair.scheduler.running == [] and bpair.scheduler.stats.running == 0
    bpair.prefix_cache.tree.check()


@pytest.fixture(scope="module")
def grammar_pair(one_thread, tiny_llama, perturbed, fake_tokenizer) -> ModelPair:
    """test_grammar's pair (pieces a grammar can use), on the attention the packed pass needs."""
    target = tiny_llama(3, logit_scale=4.0)
    draft = perturbed(target, seed=4, noise=0.1)
    assert use_grouped_sdpa(target) and use_grouped_sdpa(draft)
    return ModelPair(
        target=target, draft=draft, tokenizer=fake_tokenizer(pieces=pieces(64)), name="g-batched"
    )


@pytest.mark.parametrize("source", ["LIST", "FORCED"])
def test_a_grammar_constrained_call_beside_free_calls(grammar_pair, hf_greedy, source):
    """A constrained call (its own bitmask rows, jump-forward tokens) shares passes with free calls:
    it equals plain constrained decoding, and they equal plain decoding."""
    grammar = G.ebnf({"LIST": LIST, "FORCED": FORCED}[source])
    prompts = GRAMMAR_PROMPTS
    want = reference(grammar_pair, prompts[0], grammar, 16)
    calls = [lambda: agentspec.generate(grammar_pair, prompts[0], "model", False, grammar, max_new_tokens=16)]
    calls += [
        lambda p=p: agentspec.generate(grammar_pair, p, "model", False, max_new_tokens=16)
        for p in prompts[1:]
    ]
    stats = grammar_pair.scheduler.stats
    passes0, members0 = stats.passes, stats.members
    results = start_together(grammar_pair, calls)
    assert stats.members - members0 > stats.passes - passes0  # the passes were shared
    assert results[0].token_ids == want
    for prompt, r in zip(prompts[1:], results[1:]):
        assert_same(grammar_pair.target, prompt, r.token_ids, hf_greedy(grammar_pair.target, prompt, 16))


def test_the_most_urgent_of_competing_prompts_is_prefilled_first(bpair, cases, monkeypatch, hf_greedy):
    """Two long prompts joining at once compete for the passes' rows: the one of lower ``priority``
    feeds its prompt first and reaches its first token in an earlier pass, the other waits; both
    decode exactly."""
    monkeypatch.setattr(bpair.scheduler, "prefill_chunk", 8)
    prompts = [(cases[0][0] * 10)[:90], (cases[1][0] * 10)[:90]]

    def call(i: int, priority: int):
        return list(agentspec.stream(bpair, prompts[i], "none", False, max_new_tokens=1, priority=priority))

    for urgent_one in (0, 1):
        results = start_together(
            bpair, [lambda i=i, u=urgent_one: call(i, 0 if i == u else 5) for i in (0, 1)]
        )
        first = [steps[0].started for steps in results]  # when the pass giving each its token began
        assert first[urgent_one] < first[1 - urgent_one]
        for prompt, steps in zip(prompts, results):
            assert_same(
                bpair.target, prompt, [t for s in steps for t in s.tokens], hf_greedy(bpair.target, prompt, 1)
            )


def test_calls_asking_for_logprobs_read_once_more_per_pass(bpair, cases):
    """Beside other calls in packed passes, a call's log-probabilities are its solo ones, and the
    host reads them in one more read per pass, however many calls ask."""
    from agentspec.bench.syncs import HostSyncs

    chosen = cases[:3]
    solo = [
        [
            e
            for s in agentspec.stream(bpair, p, "prompt_lookup", False, max_new_tokens=N_NEW, logprobs=2)
            for e in s.logprobs
        ]
        for p, _ in chosen
    ]
    s = bpair.scheduler.stats
    passes0 = s.passes
    with HostSyncs(bpair) as syncs:
        results = start_together(
            bpair,
            [
                lambda p=p: list(
                    agentspec.stream(bpair, p, "prompt_lookup", False, max_new_tokens=N_NEW, logprobs=2)
                )
                for p, _ in chosen
            ],
        )
    for want, steps in zip(solo, results):
        got = [e for step in steps for e in step.logprobs]
        assert [e.token for e in got] == [e.token for e in want]
        assert [e.logprob for e in got] == pytest.approx([e.logprob for e in want], abs=1e-4)
    assert sum(step.drafted for steps in results for step in steps) > 0
    assert syncs.count == 2 * (s.passes - passes0), syncs.where


# --- a prompt's rows computed once in flight ------------------------------------------------------

SYSTEM = [(7 * i + 3) % 61 + 2 for i in range(40)]  # a system prompt the calls below share


def shared_prompts(n: int) -> list[list[int]]:
    """``n`` prompts of ``SYSTEM`` and a question of their own, each question's first token its own
    (so the prompts share exactly ``SYSTEM``)."""
    return [SYSTEM + [i] + [(5 * i + j) % 60 + 2 for j in range(3 + i)] for i in range(n)]


def rows_fed(pair: ModelPair, run, model: str = "target") -> tuple[object, int]:
    """``run()``'s result, and the rows the pair's ``model`` ("target" or "draft") computed for it
    (every forward embeds its rows once)."""
    rows: list[int] = []
    hook = (
        getattr(pair, model)
        .get_input_embeddings()
        .register_forward_hook(lambda _m, args, _o: rows.append(args[0].numel()))
    )
    try:
        return run(), sum(rows)
    finally:
        hook.remove()


def test_calls_starting_together_with_one_system_prompt_compute_it_once(bpair, monkeypatch, hf_greedy):
    """Six calls start together with one system prompt: one computes it, the five others sit a pass
    out and copy its rows, so the target computes them once; every reply is its solo one."""
    monkeypatch.setattr(bpair.scheduler, "prefill_chunk", 8)
    prompts = shared_prompts(6)

    def together(drafters: list[str], share: bool):
        monkeypatch.setattr(bpair.scheduler, "share_prompts", share)
        shared0 = bpair.scheduler.stats.shared
        calls = [
            lambda p=p, d=d: agentspec.generate(bpair, p, d, False, max_new_tokens=N_NEW)
            for p, d in zip(prompts, drafters)
        ]
        results, rows = rows_fed(bpair, lambda: start_together(bpair, calls))
        for prompt, r in zip(prompts, results):
            assert not isinstance(r, Exception), r
            assert_same(bpair.target, prompt, r.token_ids, hf_greedy(bpair.target, prompt, N_NEW))
        return results, rows, bpair.scheduler.stats.shared - shared0

    results, _, shared = together(["none", "suffix", "model", "auto", "prompt_lookup", "none"], True)
    assert shared == 5 * len(SYSTEM)
    assert sorted(r.stats.shared_prefix_tokens for r in results) == [0] + [len(SYSTEM)] * 5
    for prompt, r in zip(prompts, results):
        assert r.stats.cached_tokens == r.stats.shared_prefix_tokens
        assert r.stats.prefill_tokens == len(prompt) - r.stats.shared_prefix_tokens
    # without drafts every call feeds the same rows whatever the passes' timing: counted exactly
    _, rows_on, _ = together(["none"] * 6, True)
    _, rows_off, shared_off = together(["none"] * 6, False)
    assert shared_off == 0
    assert rows_off - rows_on == 5 * len(SYSTEM)


@pytest.mark.parametrize("chunk", [8, 1000], ids=["chunked", "whole"])
def test_draft_models_starting_together_compute_their_system_prompt_once(
    bpair, monkeypatch, hf_greedy, chunk
):
    """Six calls drafting with the draft model start together after one system prompt: the draft
    rows of the prompt that one call computes or holds, the others copy (``packed.DraftRound``), both
    where the target's prompts are fed in chunks and in one pass; every reply is its solo one."""
    monkeypatch.setattr(bpair.scheduler, "prefill_chunk", chunk)
    prompts = shared_prompts(6)

    def together(share: bool) -> tuple[int, int]:
        monkeypatch.setattr(bpair.scheduler, "share_prompts", share)
        shared0 = bpair.scheduler.stats.draft_shared
        calls = [
            lambda p=p: agentspec.generate(bpair, p, "model", False, max_new_tokens=N_NEW) for p in prompts
        ]
        results, rows = rows_fed(bpair, lambda: start_together(bpair, calls), "draft")
        for prompt, r in zip(prompts, results):
            assert not isinstance(r, Exception), r
            assert_same(bpair.target, prompt, r.token_ids, hf_greedy(bpair.target, prompt, N_NEW))
        return rows, bpair.scheduler.stats.draft_shared - shared0

    rows_on, shared_on = together(True)
    rows_off, shared_off = together(False)
    assert shared_off == 0 and shared_on == 5 * len(SYSTEM)  # the prompts share exactly SYSTEM
    assert rows_off - rows_on >= shared_on - 2 * N_NEW  # a draft's own rows may vary with its lengths


def test_calls_of_two_namespaces_never_share_their_prompt_rows(bpair, monkeypatch, hf_greedy):
    monkeypatch.setattr(bpair.scheduler, "prefill_chunk", 8)
    prompts = shared_prompts(4)
    shared0 = bpair.scheduler.stats.shared
    results = start_together(
        bpair,
        [
            lambda p=p, i=i: agentspec.generate(
                bpair, p, "none", False, namespace=f"t{i % 2}", max_new_tokens=4
            )
            for i, p in enumerate(prompts)
        ],
    )
    for prompt, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(bpair.target, prompt, 4)
    # two calls per namespace: each namespace computes the system prompt once, its other call copies it
    assert sorted(r.stats.shared_prefix_tokens for r in results) == [0, 0, len(SYSTEM), len(SYSTEM)]
    assert bpair.scheduler.stats.shared - shared0 == 2 * len(SYSTEM)


def test_draft_models_of_two_namespaces_never_share_their_prompt_rows(bpair, monkeypatch, hf_greedy):
    prompts = shared_prompts(4)
    shared0 = bpair.scheduler.stats.draft_shared
    calls = [
        lambda p=p, i=i: agentspec.generate(
            bpair, p, "model", False, namespace=f"t{i % 2}", max_new_tokens=N_NEW
        )
        for i, p in enumerate(prompts)
    ]
    for prompt, r in zip(prompts, start_together(bpair, calls)):
        assert r.token_ids == hf_greedy(bpair.target, prompt, N_NEW)
    # one namespace's first call computes them, its other copies (three would copy in one namespace)
    assert bpair.scheduler.stats.draft_shared - shared0 == 2 * len(SYSTEM)


def test_a_call_joining_copies_the_prompt_rows_of_a_call_decoding(bpair, hf_greedy):
    """A call that joins while another decodes after the same system prompt copies its rows from
    that call's state (the prefix cache has nothing yet: the first call has not saved)."""
    first, second = shared_prompts(2)
    steps = agentspec.stream(bpair, first, "none", True, max_new_tokens=12)
    got = list(next(steps).tokens)  # joined, its prompt computed
    joined = agentspec.generate(bpair, second, "suffix", False, max_new_tokens=N_NEW)
    for step in steps:
        got += step.tokens
    assert got == hf_greedy(bpair.target, first, 12)
    assert joined.token_ids == hf_greedy(bpair.target, second, N_NEW)
    assert joined.stats.shared_prefix_tokens == len(SYSTEM)


def test_rows_copied_from_another_state_are_the_rows_computed(bpair, monkeypatch):
    """``ModelState.take_rows`` gives the keys and values a forward computes; a copy that fails
    leaves the state as it was (the scheduler then lets the call compute them)."""
    from agentspec.kv import GrowingLayer, ModelState

    prompt = shared_prompts(1)[0]
    donor, own, fresh = (ModelState(bpair.target_forward) for _ in range(3))
    donor.forward(prompt, 1)
    own.forward(SYSTEM[:10], 1)
    assert own.take_rows(donor, len(SYSTEM)) == len(SYSTEM) - 10
    fresh.forward(SYSTEM, 1)
    for a, b in zip(own.segments(len(SYSTEM)), fresh.segments(len(SYSTEM))):
        torch.testing.assert_close(a[0], b[0])
        torch.testing.assert_close(a[1], b[1])
    tail = prompt[len(SYSTEM) :]
    torch.testing.assert_close(own.forward(tail, 1), fresh.forward(tail, 1))

    broken = ModelState(bpair.target_forward)
    broken.forward(SYSTEM[:5], 1)
    calls = []

    def fails_second(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory (simulated)")
        return real(self, *args, **kwargs)

    real = GrowingLayer.update
    monkeypatch.setattr(GrowingLayer, "update", fails_second)
    with pytest.raises(RuntimeError, match="simulated"):
        broken.take_rows(donor, len(SYSTEM))
    monkeypatch.setattr(GrowingLayer, "update", real)
    assert broken.ids == SYSTEM[:5]
    assert all(layer.get_seq_length() == 5 for layer in broken.cache.layers)
    assert broken.take_rows(donor, len(SYSTEM)) == len(SYSTEM) - 5


# --- the threads a call runs on ----------------------------------------------------------------------


@pytest.mark.parametrize("drafter", ["model", "auto"])
def test_eight_calls_run_on_their_callers_threads_and_the_pass_thread_only(bpair, hf_greedy, drafter):
    """Eight calls drafting at once: every function of the library runs on a
    caller's thread or on the one pass thread (drafting included: no pool of drafting threads), the
    draft model's steps of the calls packed, and every reply is its solo one."""
    prompts = shared_prompts(8)
    callers: set[int] = set()
    ran: set[int] = set()  # threads that ran a function of the library
    names: dict[int, str] = {}

    def profile(frame, event, _arg) -> None:
        if event == "call" and "/agentspec/" in frame.f_code.co_filename.replace("\\", "/"):
            me = threading.current_thread()
            ran.add(me.ident)
            names[me.ident] = me.name

    def call(prompt: list[int]):
        callers.add(threading.get_ident())
        return agentspec.generate(bpair, prompt, drafter, False, max_new_tokens=N_NEW)

    steps0, passes0 = bpair.scheduler.stats.draft_steps, bpair.scheduler.stats.draft_passes
    threading.setprofile(profile)  # threads started from here on: the callers and the pass thread
    try:
        results = start_together(bpair, [lambda p=p: call(p) for p in prompts])
    finally:
        threading.setprofile(None)
    for prompt, r in zip(prompts, results):
        assert not isinstance(r, Exception), r
        assert_same(bpair.target, prompt, r.token_ids, hf_greedy(bpair.target, prompt, N_NEW))
    assert len(callers) == 8
    others = {names[t] for t in ran - callers}
    assert others <= {"agentspec-passes"}, others
    steps = bpair.scheduler.stats.draft_steps - steps0
    if drafter == "model":  # "auto" may draft from its suffix trees alone
        assert steps > bpair.scheduler.stats.draft_passes - passes0 > 0  # steps of several calls packed


def test_an_engine_thread_that_dies_fails_its_calls_and_the_next_call_starts_a_new_one(bpair, hf_greedy):
    """Whatever kills the engine's thread mid-loop reaches the call waiting on it (no caller waits
    forever), its state left whole; the next call starts a new engine and gives the plain reply."""

    class Died(BaseException):
        pass

    @contextmanager
    def dying():
        raise Died("the engine's thread died")
        yield

    prompt = shared_prompts(1)[0]
    with bpair.scheduler.observing(dying), pytest.raises(Died):
        agentspec.generate(bpair, prompt, "model", False, max_new_tokens=N_NEW)
    r = agentspec.generate(bpair, prompt, "model", False, max_new_tokens=N_NEW)
    assert_same(bpair.target, prompt, r.token_ids, hf_greedy(bpair.target, prompt, N_NEW))
    assert bpair.scheduler.stats.waiting == 0 and bpair.scheduler.stats.running == 0


class Reentrant(Drafter):
    """A drafter that calls the pair it drafts for: from the engine's thread, which would wait on itself."""

    name = "reentrant"

    def __init__(self, pair: ModelPair):
        self.pair = pair

    def propose(self, seq, k, config, generator) -> Draft:
        agentspec.generate(self.pair, seq, "none", max_new_tokens=1)
        return Draft([])


def test_a_call_from_the_engines_own_thread_is_refused_and_the_call_goes_on(bpair, hf_greedy, caplog):
    prompt = shared_prompts(1)[0]
    r = agentspec.generate(bpair, prompt, Reentrant(bpair), False, max_new_tokens=N_NEW)
    assert_same(bpair.target, prompt, r.token_ids, hf_greedy(bpair.target, prompt, N_NEW))
    assert r.stats.draft_failures == 1 and "would wait on itself" in caplog.text
